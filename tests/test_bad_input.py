"""Every bad input of issue 2, through the real CLI: exit 2, a one-line error naming the field
and the limit, no traceback, nothing written. Plus the edges that must still pass.

Limits: core/limits.py (kernel MAX_ARG_STRLEN 131072 per argv string / env entry incl. NUL,
256 argv entries, 131072 argv bytes in all, revision 1..2147483647, digest 64 lowercase hex).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import pytest
from qlcli import cli, js, ok
from kit import scratch_dir

TABLES = ("tasks", "task_revisions", "execution_revisions", "context_recipes")
EXISTING = '[[task]]\nname = "existing"\ncommand = ["/bin/true"]\n'


@pytest.fixture(scope="module")
def store():
    d = scratch_dir("qlagent-bad-")
    s = os.path.join(d, "state")
    ok(s, "init")
    f = os.path.join(d, "existing.toml")
    with open(f, "w") as fh:
        fh.write(EXISTING)
    ok(s, "task", "add", "-f", f)
    yield s, d
    shutil.rmtree(d, ignore_errors=True)


def snapshot(state: str) -> dict:
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        return {t: sorted(map(tuple, c.execute(f"SELECT * FROM {t}"))) for t in TABLES}


def write(d: str, text: str) -> str:
    p = os.path.join(d, "input.toml")
    with open(p, "w", encoding="utf-8") as f:
        f.write(text)
    return p


def refused(store, args: list[str], field: str, *must_mention: str, exact: bool = True) -> dict:
    """Run a refused command; assert exit 2, field+limit in the one-line error, nothing written."""
    state, _ = store
    before = snapshot(state)
    p = cli(state, *args, "--json")
    err = p.stderr.decode()
    assert p.returncode == 2, (p.returncode, err)
    assert "Traceback" not in err and "Traceback" not in p.stdout.decode()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qlagent: error: "), err
    assert field in lines[0], (field, err)
    for word in must_mention:
        assert word in lines[0], (word, err)
    doc = json.loads(p.stdout)["error"]
    assert doc["code"] == "invalid_input"
    assert doc["field"] == field if exact else doc["field"].startswith(field), doc
    assert snapshot(state) == before
    return doc


def task(body: str) -> str:
    return '[[task]]\nname = "x"\n' + body + "\n"


def add(store, body: str) -> list[str]:
    return ["task", "add", "-f", write(store[1], body)]


def test_unknown_toml_field(store):
    refused(store, add(store, task('command = ["/bin/true"]\ncolour = "red"')), "task[0].colour", "unknown field")


def test_unknown_field_in_nested_table(store):
    refused(store, add(store, task('command = ["/bin/true"]\nretry = { max_attempts = 2, jitter = 1 }')),
            "task[0].retry.jitter", "unknown field")


def test_relative_argv0(store):
    refused(store, add(store, task('command = ["true", "-x"]')), "task[0].command[0]", "absolute path")


def test_shell_not_in_allowlist(store):
    refused(store, add(store, task('shell = "/bin/zsh"\nscript = "echo hi"')), "task[0].shell",
            "/bin/zsh", "/bin/sh", "/bin/bash")


def test_argv_over_count_bound(store):
    argv = json.dumps(["/bin/echo"] + ["a"] * 256)          # 257 entries
    doc = refused(store, add(store, task(f"command = {argv}")), "task[0].command", "257", "256")
    assert doc["limit"] == 256


def test_argv_over_total_bytes(store):
    argv = json.dumps(["/bin/echo", "a" * 70_000, "b" * 70_000])   # each fits, together > 131072
    doc = refused(store, add(store, task(f"command = {argv}")), "task[0].command", "131072")
    assert doc["limit"] == 131_072


def test_one_argv_string_over_kernel_limit(store):
    argv = json.dumps(["/bin/echo", "a" * 131_072])          # + NUL = 131073 bytes
    refused(store, add(store, task(f"command = {argv}")), "task[0].command[1]", "131072")


@pytest.mark.parametrize("key, why", [("QL3_X", "QL3_"), ("ql3_lower", "QL3_"), ("1BAD", "POSIX"),
                                      ("A-B", "POSIX")])
def test_bad_env_key(store, key, why):
    refused(store, add(store, task(f'command = ["/bin/true"]\nenv = {{ "{key}" = "v" }}')),
            f"task[0].env.{key}", why)


def test_reserved_prefix_refused_for_secret_refs_too(store):
    refused(store, add(store, task('command = ["/bin/true"]\nsecrets = { QL3_TOKEN = "tok" }')),
            "task[0].secrets.QL3_TOKEN", "QL3_")


def test_nul_in_env_value(store):
    refused(store, add(store, task('command = ["/bin/true"]\nenv = { A = "x\\u0000y" }')), "task[0].env.A", "NUL")


def test_nul_in_argv(store):
    refused(store, add(store, task('command = ["/bin/echo", "x\\u0000y"]')), "task[0].command[1]", "NUL")


def test_200_kib_env_value(store):
    doc = refused(store, add(store, task(f'command = ["/bin/true"]\nenv = {{ BIG = "{"v" * 200 * 1024}" }}')),
                  "task[0].env.BIG", "131072")
    assert doc["limit"] == 131_072


@pytest.mark.parametrize("revision", ["0", "-1", "2147483648"])
def test_edit_revision_out_of_range(store, revision):
    state, d = store
    digest = js(state, "task", "show", "existing")["contentDigest"]
    f = write(d, EXISTING.replace("/bin/true", "/bin/false"))
    refused(store, ["task", "edit", "existing", "-f", f, "--expect-revision", revision, "--expect-digest", digest],
            "--expect-revision", "1..2147483647")


@pytest.mark.parametrize("digest", ["A" * 64, "a" * 63, "a" * 65, "g" * 64, "sha256:" + "a" * 57])
def test_edit_digest_not_64_lowercase_hex(store, digest):
    f = write(store[1], EXISTING.replace("/bin/true", "/bin/false"))
    refused(store, ["task", "edit", "existing", "-f", f, "--expect-revision", "1", "--expect-digest", digest],
            "--expect-digest", "64")


def test_bad_fence_is_refused_before_the_store_is_opened(tmp_path):
    """Even without a store (which would be exit 5) a malformed fence is bad input (exit 2)."""
    f = tmp_path / "t.toml"
    f.write_text(EXISTING)
    p = cli(str(tmp_path / "never-initialised"), "task", "edit", "existing", "-f", str(f),
            "--expect-revision", "0", "--expect-digest", "0" * 64)
    assert p.returncode == 2 and b"--expect-revision" in p.stderr
    assert not (tmp_path / "never-initialised").exists()


def test_cron_line_with_seven_fields(store):
    refused(store, add(store, task('command = ["/bin/true"]\nschedule = "0 0 0 * * * *"')), "task[0].schedule[0]",
            "7 fields", "5", "6", exact=False)      # the sub-field is the schedule parser's to name


def test_duplicate_task_name_in_file(store):
    body = task('command = ["/bin/true"]') + task('command = ["/bin/false"]')
    refused(store, add(store, body), "task[1].name", "duplicate", "'x'")


def test_duplicate_task_name_in_project_is_a_conflict(store):
    """Against the store the name clash is a conflict (exit 3), still one line and nothing written."""
    state, d = store
    before = snapshot(state)
    p = cli(state, "task", "add", "-f", write(d, EXISTING))
    assert p.returncode == 3 and b"'existing' already exists" in p.stderr and b"Traceback" not in p.stderr
    assert snapshot(state) == before


# ---- edges that must pass ------------------------------------------------------------------

def test_env_entry_of_exactly_the_kernel_limit_passes_and_one_more_byte_fails(store):
    state, d = store
    value = "v" * (131_072 - len("K=") - 1)                  # "K=" + value + NUL == 131072 bytes
    p = ok(state, "task", "add", "-f", write(d, '[[task]]\nname = "edge-env"\ncommand = ["/bin/true"]\n'
                                                f'env = {{ K = "{value}" }}\n'))
    assert b"edge-env" in p.stdout
    refused(store, add(store, task(f'command = ["/bin/true"]\nenv = {{ K = "{value}v" }}')), "task[0].env.K",
            "131072")


def test_multibyte_value_is_measured_in_utf8_bytes(store):
    value = "é" * 65_535                                     # 131070 bytes in UTF-8, 65535 characters
    refused(store, add(store, task(f'command = ["/bin/true"]\nenv = {{ K = "{value}" }}')), "task[0].env.K",
            "131072")


def test_256_argv_entries_pass(store):
    state, d = store
    argv = json.dumps(["/bin/echo"] + ["a"] * 255)
    ok(state, "task", "add", "-f", write(d, f'[[task]]\nname = "edge-argv"\ncommand = {argv}\n'))
    assert len(js(state, "task", "show", "edge-argv")["definition"]["execution"]["argv"]) == 256


# ---- operator files that are not what they should be ---------------------------------------

def test_task_file_nested_too_deeply(store):
    refused(store, add(store, task('command = ["/bin/true"]\nlabels = { a = ' + "[" * 100_000 + "]" * 100_000
                                   + " }")), "file", "too deeply")


def test_task_file_that_is_a_directory(store):
    refused(store, ["task", "add", "-f", store[1]], "file", "cannot read")


def test_config_file_over_its_size_limit(store):
    p = os.path.join(store[1], "big.toml")
    with open(p, "w") as f:
        f.write("# " + "x" * 65_536 + "\n")
    refused(store, ["--config", p, "config", "check"], "config", "65536")


def test_config_file_nested_too_deeply(store):
    p = os.path.join(store[1], "deep.toml")
    with open(p, "w") as f:
        f.write("labels = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n")
    refused(store, ["--config", p, "config", "check"], "config", "too deeply")


def test_config_path_that_is_a_directory(store):
    refused(store, ["--config", store[1], "config", "check"], "config", "cannot read")


@pytest.mark.parametrize("body, field", [
    ('name = "x\\n"\ncommand = ["/bin/true"]', "task[0].name"),
    ('name = "x"\ncommand = ["/bin/true"]\nmemory_max = "48M\\n"', "task[0].memory_max"),
    ('name = "x"\ncommand = ["/bin/true"]\numask = "0027\\n"', "task[0].umask"),
    ('name = "x"\ncommand = ["/bin/true"]\nnetwork = "interface:wan\\n"', "task[0].network"),
    ('name = "x"\ncommand = ["/bin/true"]\nsecrets = { TOKEN = "tok\\n" }', "task[0].secrets.TOKEN"),
])
def test_a_trailing_newline_is_not_part_of_a_valid_name_or_size(store, body, field):
    """``$`` in a Python pattern also matches before a final newline: "x\\n" passed as a task
    name (stored with the newline, listed on two lines) and "48M\\n" as a size."""
    refused(store, ["task", "add", "-f", write(store[1], "[[task]]\n" + body + "\n")], field, exact=False)


def test_a_secret_name_with_a_trailing_newline_is_refused(store):
    state, _ = store
    p = cli(state, "secret", "set", "tok\n", stdin=b"value")
    err = p.stderr.decode()
    assert p.returncode == 2 and err.count("\n") == 1 and "name" in err and "Traceback" not in err, err
    assert "tok" not in cli(state, "secret", "ls").stdout.decode()


def test_too_many_secrets_are_named_as_secrets(store):
    refs = ", ".join(f'S{i} = "s{i}"' for i in range(300))
    doc = refused(store, add(store, task(f'command = ["/bin/true"]\nenv = {{ A = "1" }}\nsecrets = {{ {refs} }}')),
                  "task[0].secrets", "300 secrets", "256")
    assert doc["field"] == "task[0].secrets" and doc["limit"] == 256


@pytest.mark.parametrize("written, shown", [("99999999999999999999999", "99999999999999999999999"),
                                             ("1e308", "1e+308"), ("-5", "-5"), ("9" * 400, "9" * 64 + "… (400 digits)")])
def test_an_out_of_range_duration_is_quoted_as_written_in_a_short_line(store, written, shown):
    doc = refused(store, add(store, task(f'command = ["/bin/true"]\ntimeout_s = {written}')),
                  "task[0].timeout_s", f"{shown} is outside 1..", "seconds")
    assert len(doc["message"]) < 160, doc["message"]


@pytest.mark.parametrize("profile, most", [("edge", 15), ("standalone", 63)])
def test_max_concurrent_runs_must_fit_the_profiles_pid_budget(store, profile, most):
    state, d = store
    cfg = os.path.join(d, "runs.toml")
    for n, code in ((most, 0), (most + 1, 2), (64, 2)):
        with open(cfg, "w") as f:
            f.write(f'profile = "{profile}"\nmax_concurrent_runs = {n}\n')
        p = cli(state, "--config", cfg, "config", "check")
        err = p.stderr.decode()
        assert p.returncode == code, (n, err)
        if code:
            assert err.count("\n") == 1 and "max_concurrent_runs" in err and f"1..{most}" in err, err
