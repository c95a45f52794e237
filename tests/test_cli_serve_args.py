"""``qlagent serve`` is parsed without argparse (issue 14: the service keeps what it imports);
build_parser() stays the reference. Every command line the fast path accepts must give the
namespace argparse gives, and everything else must be left to argparse (help, errors)."""

from __future__ import annotations


import pytest

from qlagent.cli.main import _serve_args, build_parser
from qlagent.cli.serve import cmd_serve
from kit import run_cli

ACCEPTED = [
    ["serve"],
    ["--state-dir", "/s", "serve"],
    ["serve", "--state-dir", "/s"],
    ["--state-dir=/s", "--config", "/c.toml", "--profile", "edge", "--project", "p", "serve"],
    ["--profile", "standalone", "serve", "--listen", "127.0.0.1:0", "--exit-after", "2.5"],
    ["serve", "--listen=[::1]:7380", "--exit-after=0", "--json"],
    ["--json", "serve", "--profile=edge"],
    ["--state-dir", "/a", "serve", "--state-dir", "/b"],            # the last one wins
    ["--state-dir", "serve", "serve"],                               # a value that reads "serve"
    ["serve", "--exit-after", "1000", "--config", ""],
]
REFUSED = [
    [], ["--state-dir", "/s"], ["serve", "serve"], ["serve", "--help"], ["-h", "serve"],
    ["serve", "--listen"], ["serve", "--listen", "--json"], ["--listen", "x", "serve"],
    ["serve", "--profile", "tiny"], ["serve", "--exit-after", "soon"], ["serve", "--state", "/s"],
    ["serve", "extra"], ["task", "ls"], ["serve", "--json=1"], ["serve", "--exit-after", "-1"],
    ["serve", "--exit-after", "1e3"], ["serve", "--exit-after", "\u0663"], ["serve", "--exit-after", "nan"],
]


def reference(argv: list[str]) -> dict:
    """What main() makes of build_parser()'s namespace."""
    ns = vars(build_parser().parse_args(argv))
    for k in ("state_dir", "config", "profile", "project"):
        ns.setdefault(k, None)
    ns.setdefault("json", False)
    return ns


@pytest.mark.parametrize("argv", ACCEPTED, ids=" ".join)
def test_fast_path_gives_argparses_namespace(argv):
    fast = _serve_args(argv)
    assert fast is not None
    assert vars(fast) == reference(argv)
    assert fast.handler is cmd_serve


@pytest.mark.parametrize("argv", REFUSED, ids=lambda a: " ".join(a) or "(empty)")
def test_everything_else_goes_to_argparse(argv):
    assert _serve_args(argv) is None


def test_a_bad_serve_option_is_argparses_usage_error():
    p = run_cli("serve", "--profile", "tiny", text=True)
    assert p.returncode == 2 and "invalid choice: 'tiny'" in p.stderr and "Traceback" not in p.stderr
