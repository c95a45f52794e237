"""Every command answers in one line with the documented exit code (issue 12 §6), through the real
CLI on a real state dir: a table drives every subcommand with bad inputs (one stderr line, no
Traceback, the README's exit code, nothing written), then each listed input with its expected
outcome. Exit codes: 0 ok, 1 internal, 2 usage/bad input, 3 conflict, 4 not found, 5 unavailable,
6 run did not succeed."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from qlcli import cli, js, ok, rows

from qlagent.cli.main import main as cli_main
from kit import scratch_dir

TASKS = r'''
[[task]]
name = "hello"
command = ["/bin/echo", "hello"]

[[task]]
name = "uses-token"
shell = "/bin/sh"
script = 'echo "${#TOKEN}"'
env = { GREETING = "hi there", MODE = "fast" }
secrets = { TOKEN = "does_not_exist", OTHER = "present" }

[[task]]
name = "flood"
shell = "/bin/sh"
script = 'printf "\377\376"; head -c 5000000 /dev/zero | tr "\0" x'

[[task]]
name = "napper"
shell = "/bin/sh"
script = 'sleep 2'
'''


def tree_digest(root: str) -> str:
    """Names, modes and contents under ``root`` (SQLite's transient -wal/-shm left out): what a
    refused command must leave exactly as it was."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(("-wal", "-shm", ".lock", ".sock")):
                continue
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            h.update(f"{p} {st.st_mode}".encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


@pytest.fixture(scope="module")
def store():
    """An initialised state with the tasks above, one succeeded Run of ``hello`` and the
    Secret ``present``; (state, scratch dir, hello run id)."""
    d = scratch_dir("qlagent-cli-errors-")
    s = os.path.join(d, "state")
    ok(s, "init")
    ok(s, "secret", "set", "present", stdin=b"v")
    f = os.path.join(d, "tasks.toml")
    with open(f, "w") as fh:
        fh.write(TASKS)
    ok(s, "task", "add", "-f", f)
    done = ok(s, "run", "start", "hello", "--wait").stdout.decode().split()[0]
    yield s, d, done
    shutil.rmtree(d, ignore_errors=True)


def _file(d: str, name: str, text: str) -> str:
    p = os.path.join(d, name)
    with open(p, "w") as fh:
        fh.write(text)
    return p


ZERO_UUID = "00000000-0000-4000-8000-000000000000"
# (argv, expected exit code, words the one stderr line must contain). {d}: scratch dir,
# {done}: the succeeded Run of `hello`. Files named here are written by the test first.
BAD = [
    (["--profile", "bogus", "init"], 2, ["--profile", "edge", "standalone"]),
    (["init", "--bogus"], 2, ["unrecognized arguments: --bogus"]),
    (["doctor", "extra"], 2, ["unrecognized arguments: extra"]),
    (["config", "check", "--config", "{d}/missing.toml"], 2, ["config", "cannot read"]),
    (["config", "check", "--config", "{d}/unknown.toml"], 2, ["nonsense", "unknown"]),
    (["config"], 2, ["required"]),
    (["task", "add"], 2, ["-f/--file"]),
    (["task", "add", "-f", "{d}/missing.toml"], 2, ["file", "cannot read"]),
    (["task", "add", "-f", "{d}/notask.toml"], 2, ["task", "no [[task]]", "job"]),
    (["task", "add", "-f", "{d}/envint.toml"], 2, ["task[0].env.N", "an integer"]),
    (["task", "add", "-f", "{d}/negative.toml"], 2, ["task[0].timeout_s", "-5 is outside 1..604800"]),
    (["task", "add", "-f", "{d}/scriptonly.toml"], 2, ["task[0].shell", "script needs shell"]),
    (["task", "add", "-f", "{d}/catchup.toml"], 2, ["task[0].catch_up", "latest, none"]),
    (["task", "add", "-f", "{d}/w.toml"], 2, ["day-of-month", "W (nearest weekday) is not supported"]),
    (["task", "add", "-f", "{d}/dup.toml"], 3, ["hello"]),
    (["task", "ls", "--project", "nope"], 4, ["nope"]),
    (["task", "show", "nope"], 4, ["nope"]),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "0", "--expect-digest", "0" * 64], 2,
     ["--expect-revision", "1..2147483647"]),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "9" * 30, "--expect-digest", "0" * 64],
     2, ["--expect-revision"]),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "x", "--expect-digest", "0" * 64], 2,
     ["--expect-revision", "invalid int"]),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "1", "--expect-digest", "XYZ"], 2,
     ["--expect-digest", "64"]),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "1", "--expect-digest", "0" * 64], 3,
     ["hello"]),
    (["task", "enable", "nope"], 4, ["nope"]),
    (["task", "disable", "nope"], 4, ["nope"]),
    (["task", "rm", "nope"], 4, ["nope"]),
    (["secret", "set", "bad name!"], 2, ["name", "[A-Za-z0-9_.-]"]),
    (["secret", "set", "x", "the-value"], 2, ["value", "stdin"]),
    (["secret", "set", "x"], 2, ["value", "empty"]),
    (["secret", "ls", "--project", "nope"], 4, ["nope"]),
    (["secret", "rm", "nope"], 4, ["nope"]),
    (["secret", "rm", "present"], 3, ["present", "uses-token", "--force"]),
    (["run", "start", "nope"], 4, ["nope"]),
    (["run", "start", "hello", "--wait", "--timeout", "-1"], 2, ["--timeout", "604800"]),
    (["run", "start", "hello", "--wait", "--timeout", "nan"], 2, ["--timeout"]),
    (["run", "start", "hello", "--wait", "--timeout", "inf"], 2, ["--timeout"]),
    (["run", "start", "hello", "--timeout", "5"], 2, ["--timeout", "only with --wait"]),
    (["run", "ls", "--limit", "0"], 2, ["limit", "1..200"]),
    (["run", "ls", "--limit", "201"], 2, ["limit", "1..200"]),
    (["run", "ls", "--limit", "9" * 40], 2, ["limit", "1..200"]),
    # numbers are ASCII decimal, as the HTTP query takes them: int()/float() alone would take
    # Arabic-Indic or fullwidth digits, '1_0' (= 10) and surrounding blanks
    (["run", "ls", "--limit", "\u0663"], 2, ["--limit", "ASCII decimal"]),
    (["run", "ls", "--limit", "\uff13"], 2, ["--limit", "ASCII decimal"]),
    (["run", "ls", "--limit", "1_0"], 2, ["--limit", "ASCII decimal"]),
    (["run", "ls", "--limit", " 5"], 2, ["--limit", "ASCII decimal"]),
    (["run", "logs", "{done}", "--offset", "\u0663"], 2, ["--offset", "ASCII decimal"]),
    (["run", "logs", "{done}", "--limit", "1_0"], 2, ["--limit", "ASCII decimal"]),
    (["run", "start", "hello", "--wait", "--timeout", "\u0663"], 2, ["--timeout", "ASCII decimal"]),
    (["run", "start", "hello", "--wait", "--timeout", "1_0"], 2, ["--timeout", "ASCII decimal"]),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "\u0661", "--expect-digest", "0" * 64],
     2, ["--expect-revision", "ASCII decimal"]),
    (["serve", "--exit-after", "\u0663"], 2, ["--exit-after", "ASCII decimal"]),
    (["run", "ls", "--cursor", "99999999999999999999999999.x"], 2, ["cursor", "0..2^63-1"]),
    (["run", "ls", "--cursor", "-99999999999999999999999999.x"], 2, ["cursor"]),
    (["run", "ls", "--cursor", ""], 2, ["cursor"]),
    (["run", "ls", "--state", "bogus"], 2, ["state", "queued", "succeeded", "timed_out"]),
    (["run", "ls", "--task", "nope"], 4, ["nope"]),
    (["run", "show", "nope"], 4, ["nope"]),
    (["run", "show", ZERO_UUID], 4, [ZERO_UUID]),
    (["run", "logs", "{done}", "--offset", "-1"], 2, ["--offset", "0.."]),
    (["run", "logs", "{done}", "--offset", "9" * 30], 2, ["--offset", "0.."]),
    (["run", "logs", "{done}", "--limit", "0"], 2, ["--limit", "1.."]),
    (["run", "logs", "nope"], 4, ["nope"]),
    (["run", "cancel", "nope"], 4, ["nope"]),
    (["run", "cancel", "{done}"], 3, ["already ended", "succeeded"]),
    (["token", "create", "--subject", "", "--role", "viewer"], 2, ["subject"]),
    (["token", "create", "--subject", "a", "--role", "god"], 2, ["--role", "viewer"]),
    (["token", "revoke", "nope"], 4, ["nope"]),
    (["token", "create", "--subject", "evil\nstate     succeeded exit=0\x1b[2K", "--role", "viewer"], 2,
     ["subject", "U+000A", "no control characters"]),
    (["role", "set", "a\x1b[2K", "viewer"], 2, ["subject", "U+001B"]),
    (["task", "add", "-f", "{d}/desc.toml"], 2, ["task[0].description", "U+001B"]),
    (["--project", "", "task", "ls"], 2, ["--project", "empty"]),
    (["--state-dir", "", "task", "ls"], 2, ["--state-dir", "empty"]),
    (["--project", "", "serve"], 2, ["--project", "empty"]),
    (["run", "ls", "--task", "t" * 100], 2, ["--task", "limit 64"]),
    (["run", "start", "t" * 65], 2, ["task", "limit 64"]),
    (["task", "rm", "t" * 65], 2, ["name", "limit 64"]),
    (["task", "show", "t" * 65], 2, ["name", "limit 64"]),
    (["role", "set", "alice", "god"], 2, ["role", "viewer"]),
    (["serve", "--listen", "nonsense"], 2, ["--listen", "HOST:PORT"]),
    (["serve", "--listen", "localhost:99999"], 2, ["--listen", "0..65535"]),
    (["serve", "--listen", "[::1]:"], 2, ["--listen"]),
    (["serve", "--exit-after", "-1"], 2, ["--exit-after"]),
    (["bogus"], 2, ["invalid choice", "bogus"]),
]

FILES = {
    "unknown.toml": "nonsense = 1\n",
    "notask.toml": '[[job]]\nname = "x"\n',
    "envint.toml": '[[task]]\nname = "e"\ncommand = ["/bin/true"]\nenv = { N = 5 }\n',
    "negative.toml": '[[task]]\nname = "n"\ncommand = ["/bin/true"]\ntimeout_s = -5\n',
    "scriptonly.toml": '[[task]]\nname = "s"\nscript = "echo"\n',
    "catchup.toml": '[[task]]\nname = "c"\ncommand = ["/bin/true"]\ncatch_up = "always"\n',
    "w.toml": '[[task]]\nname = "w"\nschedule = "0 9 15W * *"\ncommand = ["/bin/true"]\n',
    "dup.toml": '[[task]]\nname = "hello"\ncommand = ["/bin/true"]\n',
    "one.toml": '[[task]]\nname = "hello"\ncommand = ["/bin/echo", "v2"]\n',
    "desc.toml": '[[task]]\nname = "d"\ncommand = ["/bin/true"]\ndescription = "ok\\u001b[2K"\n',
}


@pytest.mark.parametrize("argv, code, words", BAD, ids=[" ".join(a)[:60] for a, _, _ in BAD])
def test_every_subcommand_refuses_bad_input_in_one_line(store, argv, code, words):
    s, d, done = store
    for name, text in FILES.items():
        _file(d, name, text)
    argv = [a.format(d=d, done=done) for a in argv]
    before = tree_digest(s)
    p = cli(s, *argv, stdin=b"")
    err = p.stderr.decode()
    assert p.returncode == code, (argv, p.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qlagent: error: "), (argv, err)
    assert "Traceback" not in err + p.stdout.decode()
    for w in words:
        assert w in lines[0], (argv, w, lines[0])
    assert tree_digest(s) == before, argv                   # nothing written


X = "\udcff"     # how Python gives the argv byte 0xFF, which is not UTF-8 (PEP 383 surrogateescape)
# (argv, the argument the refusal names). Each is refused before it reaches a store or an
# encode, never as `internal error: UnicodeEncodeError` (exit 1).
NOT_UTF8 = [
    (["workers", "enroll", "w2", "--label", f"k{X}=v"], "--label"),
    (["workers", "enroll", "w2", "--label", "a=b", "--label", f"k=v{X}"], "--label"),
    (["workers", "enroll", f"w{X}"], "name"),
    (["--project", X, "task", "ls"], "--project"),
    (["task", "ls", "--project", X], "--project"),
    (["task", "show", X], "name"),
    (["task", "edit", X, "-f", "{d}/one.toml", "--expect-revision", "1", "--expect-digest", "0" * 64], "name"),
    (["task", "edit", "hello", "-f", "{d}/one.toml", "--expect-revision", "1", "--expect-digest", X],
     "--expect-digest"),
    (["task", "enable", X], "name"),
    (["task", "rm", X], "name"),
    (["secret", "set", X], "name"),
    (["secret", "set", "x", X], "value"),
    (["secret", "rm", X], "name"),
    (["run", "start", X], "task"),
    (["run", "ls", "--task", X], "--task"),
    (["run", "ls", "--cursor", X], "--cursor"),
    (["run", "show", X], "run"),
    (["run", "logs", X], "run"),
    (["run", "cancel", X], "run"),
    (["token", "create", "--subject", X, "--role", "viewer"], "--subject"),
    (["token", "revoke", X], "token_id"),
    (["role", "set", X, "viewer"], "subject"),
    (["workers", "drain", X], "name"),
    (["import", "qinglong", "{d}", "--prefix", X, "--dry-run"], "--prefix"),
    (["serve", "--listen", X], "--listen"),                  # the serve fast path (no argparse)
    (["--project", X, "serve"], "--project"),
]


@pytest.mark.parametrize("argv, name", NOT_UTF8, ids=[" ".join(a).replace(X, "<FF>")[:60] for a, _ in NOT_UTF8])
@pytest.mark.parametrize("json_", [False, True], ids=["text", "json"])
def test_an_argument_that_is_not_utf8_is_refused_naming_it(store, argv, name, json_):
    s, d, _ = store
    for fname, text in FILES.items():
        _file(d, fname, text)
    argv = (["--json"] if json_ else []) + [a.format(d=d) for a in argv]
    before = tree_digest(s)
    p = cli(s, *argv, stdin=b"v")
    assert p.returncode == 2, (argv, p.returncode, p.stderr)
    assert p.stderr.decode() == f"qlagent: error: {name}: is not valid UTF-8\n"
    if json_:       # as every other refusal with --json: the error object on stdout
        assert json.loads(p.stdout) == {"error": {"code": "invalid_input", "field": name,
                                                  "message": f"{name}: is not valid UTF-8"}}
    else:
        assert p.stdout == b""
    assert tree_digest(s) == before                          # nothing written


def test_a_not_utf8_argument_is_refused_before_any_store_is_opened(workdir):
    missing = os.path.join(workdir, "never")
    p = cli(missing, "task", "show", X)
    assert (p.returncode, p.stderr) == (2, b"qlagent: error: name: is not valid UTF-8\n")   # not 5 not_initialised
    assert not os.path.exists(missing)


def test_a_path_that_is_not_utf8_is_still_a_path(workdir):
    # A POSIX path is bytes: --state-dir (and --config, -f, import PATH) are not refused for it.
    state = os.path.join(workdir, f"st{X}")
    ok(state, "init")
    assert os.path.isfile(os.path.join(os.fsencode(workdir), b"st\xff", b"qlagent.db"))
    ok(state, "task", "ls")


def test_documented_exit_codes_match_the_readme_table():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md"), encoding="utf-8").read()
    for code, words in ((0, "ok"), (1, "internal"), (2, "usage"), (3, "conflict"), (4, "not found"),
                        (5, "unavailable"), (6, "did not succeed")):
        assert any(line.startswith(f"| {code} ") and words in line.lower() for line in readme.splitlines()), code
    for listed in ("run cancel", "--timeout", "secret rm", "untrusted", "workers drain/resume/rm", "worker_mode"):
        assert listed in readme, listed


# ---- the listed inputs, each with its expected outcome ---------------------------------------

def test_serve_on_a_port_in_use_is_one_line_naming_address_and_errno_exit_5(state):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = cli(state, "serve", "--listen", f"127.0.0.1:{port}", "--exit-after", "5")
    err = p.stderr.decode()
    lines = err.strip().splitlines()
    assert p.returncode == 5 and len(lines) == 1 and "Traceback" not in err, err
    assert f"127.0.0.1:{port}" in lines[0] and "EADDRINUSE" in lines[0]


def test_run_start_wait_timeout_without_a_service_exits_5_and_the_run_carries_on(store):
    s, _, _ = store
    t0 = time.monotonic()
    p = cli(s, "run", "start", "napper", "--wait", "--timeout", "0.5")
    err = p.stderr.decode()
    assert p.returncode == 5 and len(err.strip().splitlines()) == 1, err
    assert "still running after 0.5 s" in err and "keeps running" in err, err
    assert time.monotonic() - t0 < 5
    run_id = err.split("run ")[1].split()[0]
    assert json.loads(ok(s, "run", "show", run_id, "--json").stdout)["state"] == "running"
    # As the README says: the next agent start (here an inline one) ingests its receipt.
    time.sleep(2.5)
    ok(s, "run", "start", "hello", "--wait")
    assert json.loads(ok(s, "run", "show", run_id, "--json").stdout)["state"] == "succeeded"


def test_missing_secret_warned_named_in_the_reason_refused_on_rm_and_listed_by_doctor(store):
    s, d, _ = store
    f = _file(d, "warn.toml", '[[task]]\nname = "warned"\nshell = "/bin/sh"\nscript = "true"\n'
                              'secrets = { TOKEN = "does_not_exist" }\n')
    p = cli(s, "task", "add", "-f", f)
    assert p.returncode == 0
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "warning" in lines[0] and "'does_not_exist'" in lines[0] and "warned" in lines[0]
    p = cli(s, "run", "start", "uses-token", "--wait")
    assert p.returncode == 6
    run_id = p.stdout.decode().split()[0]
    shown = ok(s, "run", "show", run_id).stdout.decode()
    assert "reason=secret_missing:does_not_exist" in shown
    doctor = json.loads(cli(s, "doctor", "--json").stdout)["checks"]
    missing = [c["detail"] for c in doctor if c["name"] == "secrets" and not c["ok"]]
    assert any("uses-token" in m and "'does_not_exist'" in m for m in missing), doctor
    assert any("warned" in m for m in missing)
    # --force removes a used Secret, warning which tasks are left without it.
    ok(s, "secret", "set", "spare", stdin=b"x")
    f = _file(d, "spare.toml", '[[task]]\nname = "spare-user"\ncommand = ["/bin/true"]\nsecrets = { S = "spare" }\n')
    ok(s, "task", "add", "-f", f)
    assert cli(s, "secret", "rm", "spare").returncode == 3
    p = cli(s, "secret", "rm", "spare", "--force")
    assert p.returncode == 0 and b"spare-user" in p.stderr
    ok(s, "task", "rm", "spare-user")
    ok(s, "task", "rm", "warned")


def test_run_logs_json_object_and_truncation_note_on_stderr(store):
    s, _, _ = store
    p = cli(s, "run", "start", "flood", "--wait")
    run_id = p.stdout.decode().split()[0]
    page = json.loads(ok(s, "run", "logs", run_id, "--json", "--limit", "4").stdout)
    assert page["encoding"] == "base64" and base64.b64decode(page["data"]) == b"\xff\xfexx"
    assert (page["offset"], page["length"], page["nextOffset"], page["eof"]) == (0, 4, 4, False)
    assert page["size"] == 4 * 1048576 and page["truncated"] is True
    assert page["truncation"]["quotaBytes"] == 4 * 1048576 and page["truncation"]["bytesDropped"] > 0
    page = json.loads(ok(s, "run", "logs", run_id, "--json", "--offset", "2", "--limit", "3").stdout)
    assert (page["encoding"], page["data"]) == ("utf-8", "xxx")
    plain = cli(s, "run", "logs", run_id)
    assert plain.returncode == 0 and plain.stdout[:4] == b"\xff\xfexx" and len(plain.stdout) == 4 * 1048576
    note = plain.stderr.decode().strip().splitlines()
    assert len(note) == 1 and "truncated at 4194304 bytes" in note[0], note
    hello = json.loads(ok(s, "run", "ls", "--task", "hello", "--json").stdout)["items"][-1]["runId"]
    assert cli(s, "run", "logs", hello).stderr == b""          # nothing to note for a whole log


def test_task_show_lists_env_values_and_secret_names_never_values(store):
    s, _, _ = store
    text = ok(s, "task", "show", "uses-token").stdout.decode()
    assert "env           GREETING=hi there" in text and "env           MODE=fast" in text
    assert "secret        TOKEN <- secret does_not_exist" in text
    doc = json.loads(ok(s, "task", "show", "uses-token", "--json").stdout)
    assert doc["env"]["MODE"] == "fast" and doc["secrets"] == {"OTHER": "present", "TOKEN": "does_not_exist"}
    assert b"v" not in ok(s, "task", "show", "uses-token").stdout.split(b"secret        OTHER")[1][:30]


def test_text_output_escapes_control_characters_in_values(store, workdir):
    """An Env value holding ESC and a newline (legitimate in an environment) is printed escaped
    by ``task show``: it cannot forge a line nor drive the reader's terminal."""
    s, _, _ = store
    path = _file(workdir, "esc.toml", '[[task]]\nname = "esc"\ncommand = ["/bin/true"]\n'
                 'env = { E = "a\\u001b[2Kb\\nstate     succeeded" }\n')
    ok(s, "task", "add", "-f", path)
    out = ok(s, "task", "show", "esc").stdout
    assert b"\x1b" not in out and b"\nstate" not in out
    assert b"env           E=a\\x1b[2Kb\\nstate     succeeded\n" in out
    assert js(s, "task", "show", "esc")["env"]["E"] == "a\x1b[2Kb\nstate     succeeded"   # JSON keeps the value
    ok(s, "task", "rm", "esc")


def test_a_long_missing_run_id_is_quoted_by_a_bounded_prefix(store):
    s, _, _ = store
    p = cli(s, "run", "show", "r" * 100_000)
    line = p.stderr.decode()
    assert p.returncode == 4 and line.count("\n") == 1 and len(line) < 300, line[:300]
    assert "100000 characters" in line


def test_token_revoke_prints_the_id_never_the_token(store):
    s, _, _ = store
    p = ok(s, "token", "create", "--subject", "revoker", "--role", "viewer")
    token = p.stdout.decode().strip()
    token_id = js(s, "token", "ls")["items"][-1]["tokenId"]
    out = ok(s, "token", "revoke", token).stdout.decode()
    assert out == f"token {token_id} revoked\n" and token not in out
    p = cli(s, "token", "revoke", token[:-2] + "zz")                 # a mistyped token: not echoed
    assert p.returncode == 4 and token[:-2].encode() not in p.stderr, p.stderr


def test_run_show_prints_event_instants_in_rfc3339(store):
    s, _, done = store
    text = ok(s, "run", "show", done).stdout.decode()
    assert '"deadlineAt":"20' in text and "deadlineUs" not in text, text


def test_run_show_of_a_live_run_prints_no_none(store):
    s, _, _ = store
    run_id = ok(s, "run", "start", "napper").stdout.decode().strip()      # queued: no service here
    text = ok(s, "run", "show", run_id).stdout.decode()
    assert "None" not in text and "(figures when it ends)" in text
    assert ok(s, "run", "cancel", run_id).stdout.decode().strip() == f"{run_id} cancelled"


def test_doctor_before_init_lists_only_failures(workdir):
    p = cli(os.path.join(workdir, "never"), "doctor")
    lines = p.stdout.decode().strip().splitlines()
    assert p.returncode == 5 and lines and all(ln.startswith("FAIL") for ln in lines), lines


@pytest.mark.parametrize("mode,healthy", [(0o700, True), (0o750, True), (0o751, False), (0o755, False)])
def test_doctor_accepts_the_state_dir_mode_the_packages_set(state, mode, healthy):
    """The .deb and the .ipk make the state dir 0750 (core.limits.STATE_DIR_MODE): doctor passes
    it; one bit for others more is named."""
    os.chmod(state, mode)
    p = cli(state, "doctor", "--json")
    (check,) = [c for c in json.loads(p.stdout)["checks"] if c["name"] == "state dir"]
    assert check["ok"] is healthy, check
    if healthy:
        assert all(c["ok"] for c in json.loads(p.stdout)["checks"] if c["name"] != "network")
    else:
        assert p.returncode == 5 and check["detail"] == f"{state} mode {mode:04o}; expected a directory of mode 0750 or stricter"


def test_schedule_omitted_means_once_and_task_show_says_so(store):
    s, _, _ = store
    assert "schedules     @once" in ok(s, "task", "show", "hello").stdout.decode()


# ---- hypothesis: numeric CLI arguments never escape as a traceback ----------------------------

def _in_process(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.TextIOWrapper(io.BytesIO())):
        try:
            code = cli_main(argv)
        except SystemExit as e:          # argparse's own refusal
            code = e.code
    return code, err.getvalue()


NUMBER = st.one_of(st.integers(min_value=-10**40, max_value=10**40).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.text(alphabet="0123456789.-+e_ \u00b2\u0661xn", min_size=0, max_size=30))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from([("run", "ls", "--limit"), ("run", "ls", "--cursor"), ("run", "logs", "{done}", "--offset"),
                        ("run", "logs", "{done}", "--limit"), ("run", "start", "nope", "--wait", "--timeout"),
                        ("task", "edit", "hello", "-f", "/nonexistent", "--expect-digest", "0" * 64,
                         "--expect-revision")]), NUMBER)
def test_fuzzed_numeric_cli_arguments_answer_one_line(store, argv, value):
    s, _, done = store
    args = ["--state-dir", s, *[a.format(done=done) for a in argv], value]
    if argv[:2] == ("run", "logs"):
        args.append("--json")
    code, err = _in_process(args)
    assert code in (0, 2, 4), (args, code, err)
    if code:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qlagent: error: ") and "Traceback" not in err, (args, err)


@pytest.mark.parametrize("argv, code, error_code", [
    (["run", "ls", "--json", "--limit", "x"], 2, "usage"),             # argparse's refusal
    (["run", "ls", "--json", "--bogus"], 2, "usage"),
    (["task", "show", "--json"], 2, "usage"),                          # missing NAME
    (["run", "ls", "--json", "--limit", "0"], 2, "invalid_input"),
    (["run", "show", "nope", "--json"], 4, "run_not_found"),
])
def test_json_refusals_are_one_json_object_on_stdout_and_one_line_on_stderr(store, argv, code, error_code):
    """A script reading --json output gets an error object for every refusal, usage errors
    included, as the README says; the human line stays on stderr."""
    s, _, _ = store
    p = cli(s, *argv, stdin=b"")
    assert p.returncode == code, p.stderr
    out = json.loads(p.stdout)
    assert out["error"]["code"] == error_code and out["error"]["message"], out
    lines = p.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qlagent: error: ")
    assert out["error"]["message"] in lines[0]


def test_a_cluster_config_without_psycopg_is_one_line_exit_5_naming_the_extra(tmp_path):
    # psycopg is the optional `cluster` extra (README): a router's install has none. `workers ls`
    # and the rest say so in one line, never "internal error: ModuleNotFoundError" (exit 1).
    import site
    import subprocess
    import sys
    bare = tmp_path / "site"                  # this interpreter's packages, psycopg really absent
    bare.mkdir()
    for sp in site.getsitepackages():
        for entry in os.listdir(sp):
            if not entry.startswith("psycopg") and not (bare / entry).exists():
                os.symlink(os.path.join(sp, entry), bare / entry)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = tmp_path / "cp.toml"
    config.write_text('[cluster]\ndatabase = "postgresql://postgres@127.0.0.1:1/none"\n')
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{repo}:{bare}"}
    for args in (["workers", "ls"], ["task", "ls"], ["doctor"], ["serve"]):
        p = subprocess.run([sys.executable, "-S", "-m", "qlagent.cli.main", "--state-dir", str(tmp_path / "st"),
                            "--config", str(config), *args], capture_output=True, env=env, timeout=60)
        lines = p.stderr.decode().strip().splitlines()
        assert p.returncode == 5 and len(lines) == 1, (args, p.stderr)
        assert "pip install 'qlagent[cluster]'" in lines[0] and "Traceback" not in lines[0], lines
    assert not (tmp_path / "st" / "qlagent.db").exists()


# ---- memory_max (issue 22 §3): a Task's memory limit, at each edge ----------------------------

EDGE_SHARE = 80 * 1_048_576      # edge: 128 MiB less the agent's 48


@pytest.mark.parametrize("value,stored", [('"4M"', 4_194_304), ("4194304", 4_194_304), ('"48M"', 50_331_648),
                                          ('"81920K"', EDGE_SHARE), (str(EDGE_SHARE), EDGE_SHARE)])
def test_memory_max_accepted_at_its_edges_is_stored_in_bytes(state, workdir, value, stored):
    path = os.path.join(workdir, "t.toml")
    with open(path, "w") as f:
        f.write(f'[[task]]\nname = "t"\ncommand = ["/bin/true"]\nmemory_max = {value}\n')
    ok(state, "task", "add", "-f", path)
    assert js(state, "task", "show", "t")["definition"]["execution"]["memoryMax"] == stored


@pytest.mark.parametrize("value,message", [
    ('"4194303"', "4194303 bytes is below the floor of 4 MiB"),
    ("0", "0 bytes is below the floor of 4 MiB"),
    (str(EDGE_SHARE + 1), f"{EDGE_SHARE + 1} bytes is over the edge profile's share for runs: 80 MiB of 128 MiB "
                          "(48 MiB stay the agent's)"),
    ('"209M"', "219152384 bytes is over every Profile's share for runs (208 MiB)"),
    ('"lots"', "'lots' is not a size: bytes, or a number with K, M or G (e.g. \"48M\")"),
    ('"1.5M"', "'1.5M' is not a size: bytes, or a number with K, M or G (e.g. \"48M\")"),
    ('"48MB"', "'48MB' is not a size: bytes, or a number with K, M or G (e.g. \"48M\")"),
])
def test_memory_max_refused_with_one_line_and_nothing_written(state, workdir, value, message):
    path = os.path.join(workdir, "t.toml")
    with open(path, "w") as f:
        f.write(f'[[task]]\nname = "t"\ncommand = ["/bin/true"]\nmemory_max = {value}\n')
    p = cli(state, "task", "add", "-f", path)
    err = p.stderr.decode()
    assert p.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"qlagent: error: task[0].memory_max: {message}"), err
    assert rows(state, "tasks") == 0
