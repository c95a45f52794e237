"""``qlagent import qinglong`` (issue 15): a 2.x data directory built here (the two Sequelize
tables in a fresh SQLite file, scripts, config.sh) comes across in one command; the 2.x files
stay byte-identical; the variable a script sees is byte-identical to the 2.x joined value."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest
from qlcli import cli, js, ok
from servehelp import runs_of, start_serve

from qlagent.core.qinglong import (QlConfig, QlCron, QlEnv, QlPanel, Toolset, assign_names, base_name,
                                   parse_config_sh, plan_import)
from kit import clean_env, qlagent_argv, wait_until

CRON_TABLE = ("CREATE TABLE Crontabs (id INTEGER PRIMARY KEY AUTOINCREMENT, name VARCHAR(255), command TEXT, "
              "schedule VARCHAR(255), isDisabled NUMBER DEFAULT 0, labels JSON, extra_schedules JSON, "
              "task_before TEXT, task_after TEXT, sub_id NUMBER, isSystem NUMBER DEFAULT 0, status NUMBER, "
              "pid NUMBER, log_path TEXT)")
ENV_TABLE = ("CREATE TABLE Envs (id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT, value TEXT, "
             "status NUMBER DEFAULT 0, position NUMBER, remarks TEXT, is_pinned NUMBER)")

# Same-name Envs with positions out of order, one disabled; quotes, $, backticks, a newline,
# a tab, trailing spaces and non-ASCII. 2.x joins the enabled ones with '&' in its list order,
# position DESCENDING (EnvService.envs(): ORDER BY position DESC): B (30), D (20.5), A (10).
V_A = 'pt_key=AAA;pt_pin=中文;  '
V_B = 'q"u\'o $HOME `id` $(id) ${X}\nline2\t '
V_C = "DISABLED-VALUE"
V_D = "back\\slash&amp;"
JOINED = (V_B + "&" + V_D + "&" + V_A).encode()

CONFIG_SH = r'''## 2.x config.sh
AutoDelCron="true"
export PUSH_KEY="pk-123"
export TG_TOKEN='single $quoted `x` "d"'
export BARE=bare\ word
export EVAL1="$(touch PWNED)"
export EVAL2=`touch PWNED`
export EVAL3="${HOME}/x"
export JD_COOKIE="from-config"
export EMPTY_ONE=""
export MULTI="line1
line2 \"q\" \$ok"
'''


def make_panel(root: str, crons: list[dict], envs: list[dict], config: str | None = CONFIG_SH,
               scripts: dict[str, str] | None = None, wal: bool = False, env_created_at: bool = False) -> str:
    """A 2.x data directory: db/database.sqlite (Crontabs, Envs), scripts/, config/config.sh.

    ``env_created_at``: the Envs table has Sequelize's ``createdAt`` column (text timestamps)."""
    data = os.path.join(root, "ql", "data")
    for d in ("db", "scripts", "config", "log"):
        os.makedirs(os.path.join(data, d), exist_ok=True)
    c = sqlite3.connect(os.path.join(data, "db", "database.sqlite"))
    if wal:
        c.execute("PRAGMA journal_mode=WAL")
    c.execute(CRON_TABLE)
    c.execute(ENV_TABLE[:-1] + ", createdAt DATETIME)" if env_created_at else ENV_TABLE)
    for row in crons:
        c.execute(f"INSERT INTO Crontabs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
    for row in envs:
        c.execute(f"INSERT INTO Envs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", tuple(row.values()))
    c.commit()
    c.close()
    for name, body in (scripts or {}).items():
        path = os.path.join(data, "scripts", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(body)
    if config is not None:
        with open(os.path.join(data, "config", "config.sh"), "w") as f:
            f.write(config)
    return data


ENVS = [
    {"name": "JD_COOKIE", "value": V_A, "status": 0, "position": 10},
    {"name": "JD_COOKIE", "value": V_B, "status": 0, "position": 30},
    {"name": "JD_COOKIE", "value": V_C, "status": 1, "position": 20},
    {"name": "JD_COOKIE", "value": V_D, "status": 0, "position": 20.5},
    {"name": "ONLY_DISABLED", "value": "x", "status": 1, "position": 1},
    {"name": "bad-name", "value": "x", "status": 0, "position": 1},
]

CRONS = [
    {"name": "京东 签到", "command": "task sign.py now", "schedule": "5 0 8 * * *",
     "labels": '["jd", "每日"]', "extra_schedules": '[{"schedule": "0 20 * * *"}]'},
    {"name": "dup", "command": "task dup.py", "schedule": "*/5 * * * *"},
    {"name": "dup", "command": "dup.py arg1 'two words'", "schedule": "*/7 * * * *"},
    {"name": "off", "command": "task off.sh", "schedule": "0 3 * * *", "isDisabled": 1},
    {"name": "拉库", "command": "ql repo https://example.invalid/x.git", "schedule": "0 1 * * *"},
    {"name": "with before", "command": "task hello.sh a", "schedule": "0 4 * * *",
     "task_before": "echo before", "task_after": "echo after"},
    {"name": "question", "command": "task q.py", "schedule": "0 8 ? * *"},
    {"name": "gone", "command": "task missing.py", "schedule": "0 9 * * *"},
    {"name": "system", "command": "ql update", "schedule": "0 2 * * *", "isSystem": 1},
    {"name": "conc", "command": "task sign.py conc JD_COOKIE", "schedule": "0 6 * * *"},
]
SCRIPTS = {"sign.py": "print('sign')\n", "dup.py": "print('dup')\n", "off.sh": "echo off\n",
           "hello.sh": "echo hello\n", "q.py": "print('q')\n"}


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def tree(path: str) -> dict[str, str]:
    """Every file under ``path`` → SHA-256 (what "unchanged" means for a directory)."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = sha(p)
    return out


def one_line_error(p: subprocess.CompletedProcess, code: int, *words: str) -> str:
    err = p.stderr.decode()
    assert p.returncode == code, (p.returncode, err)
    assert "Traceback" not in err and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


@pytest.fixture
def panel(workdir):
    return make_panel(workdir, CRONS, ENVS, scripts=SCRIPTS)


# ---- the import over the CLI -----------------------------------------------------------------

def test_import_maps_every_case_and_leaves_the_2x_files_unchanged(state, panel, workdir):
    before = tree(panel)
    report = js(state, "import", "qinglong", panel)
    assert tree(panel) == before                   # hash of every 2.x file; no -wal/-shm/-journal created
    assert not os.path.exists(os.path.join(panel, "scripts", "PWNED"))     # config.sh was never run

    tasks = {t["cronName"] + f"#{t['cronId']}": t for t in report["tasks"]}
    assert {t["action"] for t in report["tasks"]} == {"created"}
    sign = tasks["京东 签到#1"]["task"]
    assert sign.startswith("sign-") and len(sign) == len("sign-") + 8         # Chinese name → stem + hash
    assert tasks["dup#2"]["task"] == "dup" and tasks["dup#3"]["task"] == "dup-3"
    assert tasks["off#4"]["enabled"] is False
    skipped = {s["cronId"]: s["reason"] for s in report["skipped"]}
    assert "ql repo" in skipped[5] and "panel-internal" in skipped[5]
    assert "'?'" in skipped[7] and "day-of-month" in skipped[7]
    assert "missing.py" in skipped[8] and "isSystem" in skipped[9] and "'conc'" in skipped[10]
    assert set(skipped) == {5, 7, 8, 9, 10}
    renamed = {r["cronId"]: r["task"] for r in report["renamed"]}
    assert renamed[1] == sign and renamed[3] == "dup-3" and renamed[6] == "with-before"

    scripts = os.path.join(panel, "scripts")
    show = js(state, "task", "show", sign)["definition"]
    assert show["schedules"] == ["5 0 8 * * *", "0 20 * * *"]                  # 6-field + extra_schedules
    assert show["labels"] == {"qinglong.id": "1", "jd": "", "每日": ""}
    assert show["description"] == "京东 签到"
    ex = show["execution"]
    assert ex["kind"] == "local_process" and ex["cwd"] == scripts
    assert ex["argv"][1:] == [os.path.join(scripts, "sign.py")] and ex["argv"][0].endswith("/python3")
    dup3 = js(state, "task", "show", "dup-3")["definition"]["execution"]
    assert dup3["argv"][1:] == [os.path.join(scripts, "dup.py"), "arg1", "two words"]
    hello = js(state, "task", "show", "with-before")["definition"]["execution"]
    assert hello["kind"] == "shell" and hello["shell"] == "/bin/bash"
    lines = hello["script"].splitlines()
    assert lines[0] == "set -e" and lines[1] == "echo before" and lines[3] == "echo after"
    assert lines[2].endswith(f"/bash {os.path.join(scripts, 'hello.sh')} a")

    secrets = {s["env"]: s for s in report["secrets"]}
    assert set(secrets) == {"JD_COOKIE", "PUSH_KEY", "TG_TOKEN", "BARE", "MULTI"}
    assert secrets["JD_COOKIE"]["bytes"] == len(JOINED) and secrets["JD_COOKIE"]["parts"] == 3
    assert secrets["JD_COOKIE"]["source"] == "envs" and secrets["PUSH_KEY"]["source"] == "config.sh"
    assert {s["action"] for s in report["secrets"]} == {"created"}
    not_imported = {(v["name"], v["source"]): v["reason"] for v in report["skippedVariables"]}
    assert "$(…)" in not_imported[("EVAL1", "config.sh")] and "`…`" in not_imported[("EVAL2", "config.sh")]
    assert "${…}" in not_imported[("EVAL3", "config.sh")]
    assert "Env of the same name wins" in not_imported[("JD_COOKIE", "config.sh")]
    assert "POSIX" in not_imported[("bad-name", "envs")] and ("EMPTY_ONE", "config.sh") in not_imported
    assert ("ONLY_DISABLED", "envs") not in not_imported and "ONLY_DISABLED" not in secrets
    assert {n["name"] for n in js(state, "secret", "ls")["items"]} == {f"qinglong.{e}" for e in secrets}
    # Every imported Task references every imported variable under its own name.
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        recipes = [json.loads(r[0]) for r in c.execute("SELECT recipe_json FROM context_recipes")]
    assert recipes and all(r["secretRefs"] == {e: f"qinglong.{e}" for e in secrets} for r in recipes)
    # No secret value in the report or in any output.
    assert b"pt_key=AAA" not in cli(state, "import", "qinglong", panel).stdout
    assert "pt_key=AAA" not in json.dumps(report)


def test_an_import_creates_its_project_only_when_it_writes(state, panel, workdir):
    # --project of a Project not there yet: a refused or dry-run import leaves none behind.
    def projects():
        with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
            return c.execute("SELECT * FROM projects ORDER BY name").fetchall()
    before = projects()
    one_line_error(cli(state, "--project", "ql", "import", "qinglong", panel, "--prefix", "Bad/"), 2, "prefix")
    one_line_error(cli(state, "--project", "ql", "import", "qinglong", os.path.join(workdir, "nope")), 2,
                   "does not exist")
    assert js(state, "--project", "ql", "import", "qinglong", panel, "--dry-run")["tasks"]
    assert projects() == before
    tasks = [t["task"] for t in js(state, "--project", "ql", "import", "qinglong", panel)["tasks"]]
    assert [p[1] for p in projects()] == ["default", "ql"]
    assert sorted(h["name"] for h in js(state, "--project", "ql", "task", "ls")["items"]) == sorted(tasks)
    assert js(state, "task", "ls") == {"items": []}


def test_plain_text_report_names_imported_skipped_renamed_and_secrets(state, panel):
    out = ok(state, "import", "qinglong", "--dry-run", os.path.join(panel, "db", "database.sqlite")).stdout.decode()
    assert out.startswith("dry run, nothing written: 5 cron(s) imported")
    assert "created   dup-3 rev 1" in out and "5 cron(s) skipped:" in out
    assert "cron 5 '拉库': panel-internal command (ql repo)" in out
    assert "cron 3 'dup' -> dup-3" in out
    assert "created   qinglong.JD_COOKIE -> $JD_COOKIE" in out and "(config.sh line 6)" in out


def test_dry_run_writes_nothing(state, panel):
    def counts():
        with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
            return [c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                    for t in ("tasks", "task_revisions", "secrets", "context_recipes")]
    empty = counts()
    report = js(state, "import", "qinglong", panel, "--dry-run")
    assert report["dryRun"] is True and len(report["tasks"]) == 5 and len(report["secrets"]) == 5
    assert counts() == empty == [0, 0, 0, 0]


def test_rerun_is_idempotent_and_a_changed_cron_appends_one_revision(state, panel, workdir):
    js(state, "import", "qinglong", panel)
    again = js(state, "import", "qinglong", panel)
    assert {t["action"] for t in again["tasks"]} == {"unchanged"}
    assert {s["action"] for s in again["secrets"]} == {"unchanged"}
    with sqlite3.connect(os.path.join(panel, "db", "database.sqlite")) as c:
        c.execute("UPDATE Crontabs SET schedule = '*/9 * * * *' WHERE id = 2")
        c.execute("UPDATE Envs SET value = 'changed' WHERE position = 10")
        c.execute("DELETE FROM Crontabs WHERE id = 4")
    # The user's own Task under a name a cron maps to is left alone (reported, not overwritten).
    with open(os.path.join(workdir, "own.toml"), "w") as f:
        f.write('[[task]]\nname = "new-one"\ncommand = ["/bin/true"]\n')
    ok(state, "task", "add", "-f", os.path.join(workdir, "own.toml"))
    with sqlite3.connect(os.path.join(panel, "db", "database.sqlite")) as c:
        c.execute("INSERT INTO Crontabs (name, command, schedule) VALUES ('new one', 'task dup.py', '0 5 * * *')")
    report = js(state, "import", "qinglong", panel)
    third = {t["cronId"]: t for t in report["tasks"]}
    assert third[2]["action"] == "revised" and third[2]["revision"] == 2
    assert {t["action"] for i, t in third.items() if i != 2} == {"unchanged"} and 11 not in third
    taken = {k["cronId"]: k["reason"] for k in report["skipped"]}[11]
    assert "'new-one' exists and was not imported from this cron" in taken
    assert {s["env"]: s["action"] for s in report["secrets"]}["JD_COOKIE"] == "updated"
    assert js(state, "task", "show", "dup")["revision"] == 2
    assert js(state, "task", "show", "off")["revision"] == 1         # deleted in 2.x: kept here
    assert js(state, "task", "show", "new-one")["definition"]["execution"]["argv"] == ["/bin/true"]
    secrets = {s["env"]: s["action"] for s in js(state, "import", "qinglong", panel)["secrets"]}
    assert secrets["JD_COOKIE"] == "unchanged"                        # updated by the third run already


def test_env_scope_none_imports_secrets_without_references(state, panel):
    report = js(state, "import", "qinglong", panel, "--env-scope", "none", "--prefix", "home-")
    assert all(t["task"].startswith("home-") for t in report["tasks"])
    assert {s["secret"] for s in report["secrets"]} >= {"qinglong.home-JD_COOKIE", "qinglong.home-MULTI"}
    with sqlite3.connect(os.path.join(state, "qlagent.db")) as c:
        assert all(json.loads(r[0])["secretRefs"] == {} for r in c.execute("SELECT recipe_json FROM context_recipes"))


def test_serve_runs_imported_sh_and_py_crons_with_the_byte_exact_2x_value(state, workdir):
    data = make_panel(workdir, [
        {"name": "shell 脚本", "command": "task sh_probe.sh", "schedule": "* * * * * *"},
        {"name": "py", "command": "task sub/py_probe.py", "schedule": "* * * * * *"},
        {"name": "ordered", "command": "task order.sh", "schedule": "* * * * * *",
         "task_before": "printf 'before\\n' >> order.txt", "task_after": "printf 'after\\n' >> order.txt"},
    ], ENVS, scripts={
        "sh_probe.sh": 'printf "%s" "$JD_COOKIE" > sh.out.tmp && printf "%s" "$MULTI" > multi.out && '
                       'mv sh.out.tmp sh.out\n',
        "sub/py_probe.py": "import os\nopen('py.out.tmp', 'wb').write(os.environb[b'JD_COOKIE'])\n"
                           "os.rename('py.out.tmp', 'py.out')\n",
        "order.sh": "printf 'script\\n' >> order.txt\n"})
    db_hash = sha(os.path.join(data, "db", "database.sqlite"))
    ok(state, "import", "qinglong", data)
    scripts = os.path.join(data, "scripts")
    p = start_serve(state, env=clean_env())
    try:
        wait_until(lambda: os.path.exists(os.path.join(scripts, "sh.out"))
                   and os.path.exists(os.path.join(scripts, "py.out"))
                   and open(os.path.join(scripts, "order.txt")).read().count("\n") >= 3
                   if os.path.exists(os.path.join(scripts, "order.txt")) else False, timeout=30)
    finally:
        p.stop()
    with open(os.path.join(scripts, "sh.out"), "rb") as f:
        assert f.read() == JOINED
    with open(os.path.join(scripts, "py.out"), "rb") as f:       # cwd is the scripts dir, not sub/
        assert f.read() == JOINED
    with open(os.path.join(scripts, "multi.out"), "rb") as f:
        assert f.read() == b'line1\nline2 "q" $ok'
    with open(os.path.join(scripts, "order.txt")) as f:
        assert f.read().splitlines()[:3] == ["before", "script", "after"]
    for task in ("py", "ordered"):
        assert "succeeded" in {s for _, s in runs_of(state, task)}
        assert {r["triggerType"] for r in js(state, "run", "ls", "--task", task)["items"]} == {"cron"}
    assert sha(os.path.join(data, "db", "database.sqlite")) == db_hash


def test_live_wal_database_is_read_with_its_wal_and_left_byte_identical(state, workdir):
    data = make_panel(workdir, [{"name": "first", "command": "task dup.py", "schedule": "0 1 * * *"}], ENVS,
                      scripts=SCRIPTS, wal=True)
    db = os.path.join(data, "db", "database.sqlite")
    # A live 2.x panel: its connection is open and the newest cron is still only in the -wal.
    panel_conn = sqlite3.connect(db)
    panel_conn.execute("PRAGMA wal_autocheckpoint=0")
    panel_conn.execute("INSERT INTO Crontabs (name, command, schedule) VALUES ('in-wal', 'task q.py', '0 2 * * *')")
    panel_conn.commit()
    try:
        assert os.path.getsize(db + "-wal") > 0
        before = tree(os.path.join(data, "db"))
        report = js(state, "import", "qinglong", data)
        assert tree(os.path.join(data, "db")) == before        # db, -wal and -shm byte-identical, none added
    finally:
        panel_conn.close()
    assert {t["task"] for t in report["tasks"]} == {"first", "in-wal"}


def test_wal_database_at_rest_gets_no_wal_or_shm(state, workdir):
    data = make_panel(workdir, [{"name": "first", "command": "task dup.py", "schedule": "0 1 * * *"}], [],
                      scripts=SCRIPTS, wal=True)
    before = tree(data)
    assert [t["task"] for t in js(state, "import", "qinglong", data)["tasks"]] == ["first"]
    assert tree(data) == before


# ---- bad input: one line, exit 2 or 5, nothing written -----------------------------------------

def test_not_a_qinglong_directory(state, workdir):
    os.makedirs(os.path.join(workdir, "empty"))
    before = tree(state)
    one_line_error(cli(state, "import", "qinglong", os.path.join(workdir, "empty")), 2, "db/database.sqlite")
    one_line_error(cli(state, "import", "qinglong", os.path.join(workdir, "nope")), 2, "does not exist")
    other = os.path.join(workdir, "other.sqlite")
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    one_line_error(cli(state, "import", "qinglong", other, "--scripts-dir", workdir), 2, "Crontabs",
                   "not a qinglong 2.x database")
    assert tree(state) == before


def test_corrupt_database(state, panel):
    db = os.path.join(panel, "db", "database.sqlite")
    before = tree(state)
    with open(db, "r+b") as f:
        f.seek(100)
        f.write(os.urandom(8000))
    one_line_error(cli(state, "import", "qinglong", panel), 2, "database", "cannot be read")
    with open(db, "wb") as f:
        f.write(b"not sqlite at all\n" * 10)
    one_line_error(cli(state, "import", "qinglong", panel), 2, "not a SQLite database")
    assert tree(state) == before


def test_locked_database(state, panel):
    db = os.path.join(panel, "db", "database.sqlite")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sqlite3, sys\nc = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
                               "c.execute('BEGIN EXCLUSIVE')\nc.execute(\"UPDATE Envs SET value = 'w'\")\n"
                               "print('held', flush=True)\nsys.stdin.read()\n", db],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        before = tree(state)
        one_line_error(cli(state, "import", "qinglong", panel), 5, "locked")
        assert tree(state) == before
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert js(state, "import", "qinglong", panel)["tasks"]            # the lock gone, the import works


def test_unreadable_scripts_dir(state, panel, workdir):
    scripts = os.path.join(panel, "scripts")
    before = tree(state)
    os.chmod(scripts, 0)
    try:
        # Root reads a mode-000 directory; without CAP_DAC_OVERRIDE/READ_SEARCH it cannot.
        p = subprocess.run(["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                            "--bounding-set=-dac_override,-dac_read_search",
                            *qlagent_argv("--state-dir", state, "import", "qinglong", panel)],
                           capture_output=True, timeout=60, env=clean_env())
    finally:
        os.chmod(scripts, 0o755)
    one_line_error(p, 2, "scripts-dir", scripts, "not readable")
    assert tree(state) == before
    one_line_error(cli(state, "import", "qinglong", panel, "--scripts-dir", os.path.join(workdir, "x")), 2,
                   "scripts-dir", "not a directory")
    one_line_error(cli(state, "import", "qinglong", panel, "--prefix", "Bad/"), 2, "prefix")


# ---- the pure plan -----------------------------------------------------------------------------

def test_config_sh_is_read_as_shell_words_without_a_shell():
    conf = parse_config_sh(CONFIG_SH.encode() + b"export RAW=\xff\xfe\nexport A=1 B=2\nexport OPEN='x\n")
    got = {e.name: e.value for e in conf.exports}
    assert got == {"PUSH_KEY": b"pk-123", "TG_TOKEN": b'single $quoted `x` "d"', "BARE": b"bare word",
                   "JD_COOKIE": b"from-config", "EMPTY_ONE": b"", "MULTI": b'line1\nline2 "q" $ok',
                   "RAW": b"\xff\xfe"}
    refused = {r.name: (r.line, r.reason) for r in conf.refused}
    assert refused["EVAL1"] == (6, "needs shell evaluation ($(…))")
    assert refused["EVAL3"][1] == "needs shell evaluation (${…})"
    assert refused["A"][1] == "more than one word after '='" and refused["OPEN"][1] == "unterminated single quote"
    assert conf.other_lines == 1                                      # AutoDelCron="true"
    # The last export of a name decides, as in a shell.
    assert {e.name: e.value for e in parse_config_sh(b"export X=1\nexport X=2\n").exports} == {"X": b"2"}
    assert not parse_config_sh(b"export X=1\nexport X=$(id)\n").exports
    # An export that runs only on a condition (or in a function) is reported, not imported.
    guarded = parse_config_sh(b'if [ -z "$X" ]; then\n  export B=2\nfi\nexport C=3\nfoo() {\n  export D=4\n}\n'
                              b'echo "all done"\nfor x in 1; do echo; done\nexport E=5\n')
    assert [e.name for e in guarded.exports] == ["C", "E"]
    assert {r.name: r.reason for r in guarded.refused} == {
        "B": "inside an if, case, loop or function: it may not run", "D": "inside an if, case, loop or function: "
        "it may not run"}


def test_names_are_valid_deterministic_and_collisions_keep_their_cron():
    assert base_name("Daily Check-in!", None) == "daily-check-in"
    assert base_name("京东签到", "/s/jd_sign.js") == base_name("京东签到", "/s/jd_sign.js") != base_name("京东签", None)
    assert base_name("京东签到", "/s/jd_sign.js").startswith("jd_sign-")
    assert base_name("", None).startswith("cron-")
    crons = tuple(QlCron(id=i, name=n, command="task a.py", schedule="* * * * *")
                  for i, n in ((9, "a"), (3, "a"), (5, "a-9"), (7, "x" * 80)))
    names = assign_names(crons, "p-", {})
    assert names == {3: "p-a", 9: "p-a-9-2", 5: "p-a-9", 7: "p-" + "x" * 62}


def _plan(envs, crons=(), scope="all"):
    panel = QlPanel(database="/d/db/database.sqlite", scripts_dir="/d/scripts", crons=tuple(crons),
                    envs=tuple(envs), config=QlConfig())
    tools = Toolset(interpreters={"python3": "/usr/bin/python3", "bash": "/bin/bash"}, bash_shell=True)
    return plan_import(panel, frozenset({"/d/scripts/a.py", "/d/scripts/b.js"}), tools, env_scope=scope)


def test_env_values_join_in_2x_order_byte_exact_and_limits():
    envs = [QlEnv(id=1, name="K", value=b"one ", enabled=True, position=1.0),
            QlEnv(id=2, name="K", value=b"two\n", enabled=True, position=3.0),
            QlEnv(id=3, name="K", value=b"off", enabled=False, position=2.0),
            QlEnv(id=4, name="BIG", value=b"x" * 65_536, enabled=True, position=1.0),
            QlEnv(id=5, name="BIGGER", value=b"x" * 65_537, enabled=True, position=1.0),
            QlEnv(id=6, name="QL3_X", value=b"x", enabled=True, position=1.0)]
    plan = _plan(envs)
    assert {s.env: s.value for s in plan.secrets} == {"K": b"two\n&one ", "BIG": b"x" * 65_536}
    reasons = {v.name: v.reason for v in plan.skipped_variables}
    assert "65537 bytes (limit 65536)" in reasons["BIGGER"] and "reserved" in reasons["QL3_X"]


def test_many_variables_fit_every_task_and_too_many_are_refused_once():
    many = [QlEnv(id=i, name=f"V{i}", value=b"v", enabled=True) for i in range(40)]
    cron = QlCron(id=1, name="a", command="task a.py", schedule="* * * * *")
    plan = _plan(many, [cron])
    assert len(plan.tasks[0].prepared.recipe.secret_refs) == 40      # more than 15 Secrets in one Task
    huge = [QlEnv(id=i, name=f"V{i}", value=b"v" * 65_536, enabled=True) for i in range(16)]
    with pytest.raises(Exception, match="env-scope"):
        _plan(huge, [cron])
    assert _plan(huge, [cron], scope="none").tasks[0].prepared.recipe.secret_refs == {}


def test_missing_interpreter_and_shell_syntax_are_reported_per_cron():
    crons = [QlCron(id=1, name="js", command="task b.js", schedule="* * * * *"),
             QlCron(id=2, name="pipe", command="task a.py | tee x", schedule="* * * * *"),
             QlCron(id=3, name="ok", command="task /ql/data/scripts/a.py -- --flag", schedule="* * * * *")]
    plan = _plan([], crons)
    reasons = {s.cron_id: s.reason for s in plan.skipped}
    assert "node (for .js) was not found" in reasons[1] and "needs a shell" in reasons[2]
    assert [t.prepared.definition.execution.argv for t in plan.tasks] == [
        ("/usr/bin/python3", "/d/scripts/a.py", "--flag")]


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_js_cron_uses_node_when_present(state, workdir):
    data = make_panel(workdir, [{"name": "js", "command": "task a.js", "schedule": "0 1 * * *"}], [],
                      scripts={"a.js": "console.log(1)\n"})
    report = js(state, "import", "qinglong", data)
    argv = js(state, "task", "show", report["tasks"][0]["task"])["definition"]["execution"]["argv"]
    assert argv[0].endswith("/node") and argv[1] == os.path.join(data, "scripts", "a.js")


# ---- limits at their edges ------------------------------------------------------------------------

def test_variable_count_and_size_limits_at_their_edge():
    cron = QlCron(id=1, name="a", command="task a.py", schedule="* * * * *")
    full = [QlEnv(id=i, name=f"V{i:03d}", value=b"v", enabled=True) for i in range(256)]
    assert len(_plan(full, [cron]).tasks[0].prepared.recipe.secret_refs) == 256
    with pytest.raises(Exception, match="257 variables"):
        _plan([*full, QlEnv(id=999, name="W", value=b"v", enabled=True)], [cron])
    # 16 entries of 3 + 2 + 65275 bytes = MAX_ENV_TOTAL - ENV_RESERVE exactly.
    edge = [QlEnv(id=i, name=f"V{i:02d}", value=b"v" * 65_275, enabled=True) for i in range(16)]
    assert len(_plan(edge, [cron]).secrets) == 16
    edge[0] = QlEnv(id=0, name="V00", value=b"v" * 65_276, enabled=True)
    with pytest.raises(Exception, match="1044480"):
        _plan(edge, [cron])


def test_cron_count_limit_at_its_edge():
    crons = [QlCron(id=i, name="maintenance", command="ql update", schedule="0 1 * * *") for i in range(1, 1001)]
    assert len(_plan([], crons).skipped) == 1000
    with pytest.raises(Exception, match="1001 crons"):
        _plan([], [*crons, QlCron(id=1001, name="x", command="ql update", schedule="0 1 * * *")])


def test_config_and_env_row_limits_at_their_edge(workdir):
    from qlagent.adapters.qinglong import MAX_ENV_ROWS, read_config, read_database
    from qlagent.core.errors import ValidationError
    from qlagent.core.qinglong import MAX_CONFIG_BYTES
    conf = os.path.join(workdir, "config.sh")
    with open(conf, "wb") as f:
        f.write(b"export A=1\n" + b"#" * (MAX_CONFIG_BYTES - 12) + b"\n")
    assert [e.name for e in read_config(conf).exports] == ["A"]
    with open(conf, "ab") as f:
        f.write(b"\n")
    with pytest.raises(ValidationError, match="1048576"):
        read_config(conf)
    data = make_panel(workdir, [], [{"name": "K", "value": "v", "position": i} for i in range(MAX_ENV_ROWS)])
    db = os.path.join(data, "db", "database.sqlite")
    assert len(read_database(db)[1]) == MAX_ENV_ROWS
    with sqlite3.connect(db) as c:
        c.execute("INSERT INTO Envs (name, value) VALUES ('K', 'v')")
    with pytest.raises(ValidationError, match="10000"):
        read_database(db)


def test_hot_journal_of_a_crashed_writer_is_rolled_back_in_a_private_copy(state, workdir):
    crons = [{"name": f"c{i}", "command": "task dup.py", "schedule": "0 1 * * *", "log_path": "x" * 3000}
             for i in range(200)]
    data = make_panel(workdir, crons, [], scripts=SCRIPTS)
    db = os.path.join(data, "db", "database.sqlite")
    # A 2.x writer dies mid-transaction after spilling changed pages into the file: a hot journal.
    crash = ("import os, sqlite3, sys\nc = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
             "c.execute('PRAGMA cache_size=1')\nc.execute('BEGIN')\n"
             "c.execute(\"UPDATE Crontabs SET name = 'torn', log_path = hex(randomblob(1600))\")\n"
             "os.kill(os.getpid(), 9)\n")
    subprocess.run([sys.executable, "-c", crash, db], timeout=60)
    assert os.path.getsize(db + "-journal") > 0
    before = tree(data)
    report = js(state, "import", "qinglong", data)
    assert tree(data) == before                                   # the journal is not rolled back in place
    assert sorted(t["cronName"] for t in report["tasks"]) == sorted(f"c{i}" for i in range(200))


# ---- hostile or odd 2.x data: skipped or reported, never a crash or a hang ----------------------

def _raw_rows(panel: str, *sql: str) -> None:
    c = sqlite3.connect(os.path.join(panel, "db", "database.sqlite"))
    for s in sql:
        c.execute(s)
    c.commit()
    c.close()


def test_non_utf8_bytes_skip_only_that_cron_and_never_crash_the_report(state, workdir):
    # A name typed as GBK through the sqlite3 shell (京东 = BE A9 B6 AB), an argument and a
    # task_before with a stray byte, an Env name with one: the rest still comes across.
    panel = make_panel(workdir, [{"name": "good", "command": "task ok.sh", "schedule": "0 1 * * *"}], [],
                       config=None, scripts={"ok.sh": "echo ok\n"})
    _raw_rows(panel,
              "INSERT INTO Crontabs (name, command, schedule) VALUES (CAST(X'BEA9B6AB' AS TEXT), 'task ok.sh', "
              "'0 2 * * *')",
              "INSERT INTO Crontabs (name, command, schedule) VALUES ('arg', CAST(X'7461736B206F6B2E736820FF' AS "
              "TEXT), '0 3 * * *')",
              "INSERT INTO Crontabs (name, command, schedule, task_before) VALUES ('before', 'task ok.sh', "
              "'0 4 * * *', CAST(X'6563686F20FF' AS TEXT))",
              "INSERT INTO Envs (name, value, status, position) VALUES (CAST(X'41FF' AS TEXT), 'v', 0, 1)")
    before = tree(panel)
    for extra in ((), ("--json",)):
        p = cli(state, "import", "qinglong", panel, "--dry-run", *extra)
        assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr.decode()
    report = js(state, "import", "qinglong", panel)
    assert sorted(t["cronId"] for t in report["tasks"]) == [1, 2]
    reasons = {k["cronId"]: k["reason"] for k in report["skipped"]}
    assert "command is not valid UTF-8" in reasons[3] and "task_before is not valid UTF-8" in reasons[4]
    assert [v["reason"] for v in report["skippedVariables"]] == ["not a POSIX environment name"]
    assert "\ufffd" in report["tasks"][1]["cronName"]
    assert tree(panel) == before


def test_cells_of_unexpected_types_are_reported_not_a_traceback(state, workdir):
    deep = "[" * 100_000 + "]" * 100_000
    panel = make_panel(workdir, [
        {"name": b"blob-name", "command": "task ok.sh", "schedule": "0 1 * * *"},
        {"name": "blob-command", "command": b"task ok.sh", "schedule": "0 2 * * *"},
        {"name": "int-labels", "command": "task ok.sh", "schedule": "0 3 * * *", "labels": 5},
        {"name": "int-extra", "command": "task ok.sh", "schedule": "0 4 * * *", "extra_schedules": 3},
        {"name": "deep-labels", "command": "task ok.sh", "schedule": "0 5 * * *", "labels": deep},
    ], [{"name": b"BLOB_NAME", "value": "v", "status": 0, "position": 1}], config=None,
        scripts={"ok.sh": "echo ok\n"})
    report = js(state, "import", "qinglong", panel)
    assert {t["cronName"]: t["task"] for t in report["tasks"]} == {
        "blob-name": "blob-name", "blob-command": "blob-command", "int-labels": "int-labels",
        "deep-labels": "deep-labels"}
    assert [k["reason"] for k in report["skipped"]] == ["extra_schedules is not a JSON array"]
    assert [s["env"] for s in report["secrets"]] == ["BLOB_NAME"]
    # A table without an integer id column is not a 2.x table: one line, exit 2, nothing written.
    _raw_rows(panel, "CREATE TABLE T AS SELECT * FROM Crontabs", "DROP TABLE Crontabs",
              "ALTER TABLE T RENAME TO Crontabs",
              "INSERT INTO Crontabs (id, name, command, schedule) VALUES ('abc', 'x', 'task ok.sh', '0 1 * * *')")
    before = tree(state)
    one_line_error(cli(state, "import", "qinglong", panel, "--prefix", "p"), 2, "Crontabs", "id")
    assert tree(state) == before


def test_fifo_or_device_as_config_sh_is_refused_not_waited_on(state, workdir):
    panel = make_panel(workdir, [{"name": "a", "command": "task ok.sh", "schedule": "0 1 * * *"}], [], config=None,
                       scripts={"ok.sh": "echo ok\n"})
    conf = os.path.join(panel, "config", "config.sh")
    os.mkfifo(conf)                   # nobody ever writes to it: reading it would block for ever
    before = tree(state)
    one_line_error(cli(state, "import", "qinglong", panel), 2, "config.sh", "not a regular file")
    os.unlink(conf)
    os.symlink("/dev/zero", conf)
    one_line_error(cli(state, "import", "qinglong", panel), 2, "config.sh", "not a regular file")
    assert tree(state) == before
    # A FIFO given as PATH is named for what it is, not "does not exist".
    fifo = os.path.join(workdir, "database.sqlite")
    os.mkfifo(fifo)
    one_line_error(cli(state, "import", "qinglong", fifo), 2, "PATH", "not a regular file or a directory")


def test_a_script_outside_the_scripts_dir_is_not_imported(state, workdir):
    crons = [{"name": "up", "command": "task ../../etc/x.sh", "schedule": "0 1 * * *"},
             {"name": "abs", "command": "task /usr/local/x.sh", "schedule": "0 2 * * *"},
             {"name": "sub", "command": "task sub/../ok.sh", "schedule": "0 3 * * *"},
             {"name": "docker", "command": "task /ql/data/scripts/ok.sh", "schedule": "0 4 * * *"}]
    panel = make_panel(workdir, crons, [], config=None, scripts={"ok.sh": "echo ok\n"})
    # The files exist: only where they are decides.
    for p in (os.path.join(panel, "..", "etc", "x.sh"), os.path.join(workdir, "usr", "local", "x.sh")):
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write("echo outside\n")
    report = js(state, "import", "qinglong", panel, "--scripts-dir", os.path.join(panel, "scripts"))
    assert sorted(t["cronName"] for t in report["tasks"]) == ["docker", "sub"]
    reasons = {k["cronName"]: k["reason"] for k in report["skipped"]}
    assert set(reasons) == {"up", "abs"} and all("outside the scripts dir" in r for r in reasons.values()), reasons


def test_a_cron_renamed_in_2x_revises_its_task_instead_of_adding_a_second(state, workdir):
    crons = [{"name": "old name", "command": "task ok.sh", "schedule": "0 1 * * *"}]
    panel = make_panel(workdir, crons, [], config=None, scripts={"ok.sh": "echo ok\n"})
    js(state, "import", "qinglong", panel)
    # The same cron id from ANOTHER panel (its own scripts dir) is not this cron.
    other = make_panel(os.path.join(workdir, "other"), crons, [], config=None, scripts={"ok.sh": "echo ok\n"})
    js(state, "import", "qinglong", other, "--prefix", "o-")
    with sqlite3.connect(os.path.join(panel, "db", "database.sqlite")) as c:
        c.execute("UPDATE Crontabs SET name = 'new name', schedule = '0 2 * * *' WHERE id = 1")
    report = js(state, "import", "qinglong", panel)
    assert [(t["task"], t["action"], t["revision"]) for t in report["tasks"]] == [("old-name", "revised", 2)]
    heads = {t["name"]: t for t in js(state, "task", "ls")["items"]}
    assert sorted(heads) == ["o-old-name", "old-name"]                 # not a second Task running ok.sh
    assert [x["cron"] for x in heads["old-name"]["schedules"]] == ["0 2 * * *"] and heads["o-old-name"]["revision"] == 1
    again = js(state, "import", "qinglong", panel)
    assert [(t["task"], t["action"]) for t in again["tasks"]] == [("old-name", "unchanged")]
    assert {r["cronId"]: r["task"] for r in again["renamed"]} == {1: "old-name"}


def test_a_2x_path_env_does_not_replace_every_tasks_path(state, workdir):
    # 2.x sourced `export PATH="$PATH:/opt/x"` (evaluated); byte-exact it would be the literal
    # `$PATH:/opt/x` for every imported Task, and no command on PATH would be found.
    panel = make_panel(workdir, [{"name": "probe", "command": "task probe.sh", "schedule": "0 1 * * *"}],
                       [{"name": "PATH", "value": "$PATH:/opt/x", "status": 0, "position": 1},
                        {"name": "TOKEN", "value": "t", "status": 0, "position": 1}],
                       config=None, scripts={"probe.sh": "id -u > id.out\n"})
    report = js(state, "import", "qinglong", panel)
    assert [s["env"] for s in report["secrets"]] == ["TOKEN"]
    assert [(v["name"], v["source"]) for v in report["skippedVariables"]] == [("PATH", "envs")]
    assert "the agent sets PATH" in report["skippedVariables"][0]["reason"]
    p = start_serve(state, env=clean_env())
    try:
        ok(state, "run", "start", "probe", "--wait", "--timeout", "30")
    finally:
        p.stop()
    assert os.path.exists(os.path.join(panel, "scripts", "id.out"))


def test_a_path_that_is_not_utf8_is_refused_in_one_line(state, workdir):
    # A Task's cwd and command are stored as UTF-8 JSON: a scripts dir named in another encoding
    # cannot be one; say so instead of a traceback.
    panel = make_panel(os.path.join(workdir, "p\udcff"), [{"name": "a", "command": "task ok.sh",
                                                          "schedule": "0 1 * * *"}], [], config=None,
                       scripts={"ok.sh": "echo ok\n"})
    before = tree(state)
    for args in ((panel,), (os.path.join(panel, "db", "database.sqlite"), "--scripts-dir",
                             os.path.join(panel, "scripts"))):
        for extra in ((), ("--json",), ("--dry-run",)):
            one_line_error(cli(state, "import", "qinglong", *args, *extra), 2, "PATH", "not valid UTF-8")
    assert tree(state) == before


def test_a_huge_extra_schedules_list_is_refused_for_its_cron_without_stalling(state, workdir):
    # 200 000 distinct lines in one cell: de-duplicated in one pass (a pairwise scan would take
    # the 60 s the CLI helper allows many times over), then refused for that cron only.
    extra = json.dumps([{"schedule": f"{i % 60} {i // 60 % 24} {i // 1440 % 28 + 1} {i // 40320 % 12 + 1} *"}
                        for i in range(200_000)])
    panel = make_panel(workdir, [{"name": "many", "command": "task ok.sh", "schedule": "0 1 * * *",
                                  "extra_schedules": extra},
                                 {"name": "fine", "command": "task ok.sh", "schedule": "0 2 * * *"}], [],
                       config=None, scripts={"ok.sh": "echo ok\n"})
    report = js(state, "import", "qinglong", panel)
    assert [t["cronName"] for t in report["tasks"]] == ["fine"]
    assert "200001 schedules, more than 16" in report["skipped"][0]["reason"]


def test_removing_a_same_name_cron_in_2x_keeps_the_other_on_its_task(state, workdir):
    crons = [{"name": "x", "command": "task ok.sh", "schedule": "0 1 * * *"},
             {"name": "x", "command": "task ok.sh", "schedule": "0 2 * * *"}]
    panel = make_panel(workdir, crons, [], config=None, scripts={"ok.sh": "echo ok\n"})
    assert [t["task"] for t in js(state, "import", "qinglong", panel)["tasks"]] == ["x", "x-2"]
    with sqlite3.connect(os.path.join(panel, "db", "database.sqlite")) as c:
        c.execute("DELETE FROM Crontabs WHERE id = 1")            # cron 2 now maps to the plain "x"
        c.execute("UPDATE Crontabs SET schedule = '0 3 * * *' WHERE id = 2")
    report = js(state, "import", "qinglong", panel)
    assert report["skipped"] == []
    assert [(t["task"], t["action"], t["revision"]) for t in report["tasks"]] == [("x-2", "revised", 2)]
    assert [x["cron"] for x in js(state, "task", "show", "x-2")["schedules"]] == ["0 3 * * *"]
    assert js(state, "task", "show", "x")["revision"] == 1          # cron 1's Task: kept, untouched


def test_same_name_envs_at_one_position_join_oldest_first_as_2x_lists_them(state, workdir):
    # 2.x EnvService.envs(): ORDER BY position DESC, createdAt ASC. At one position the older row
    # comes first although it was inserted later (a higher id): neither newest-first nor id order.
    panel = make_panel(workdir, [{"name": "probe", "command": "task probe.sh", "schedule": "0 1 * * *"}], [
        {"name": "K", "value": "newer", "status": 0, "position": 5, "createdAt": "2024-03-02 08:00:00.000 +00:00"},
        {"name": "K", "value": "older", "status": 0, "position": 5, "createdAt": "2024-03-01 08:00:00.000 +00:00"},
        {"name": "K", "value": "top", "status": 0, "position": 9, "createdAt": "2024-03-03 08:00:00.000 +00:00"},
    ], config=None, scripts={"probe.sh": 'printf "%s" "$K" > k.out\n'}, env_created_at=True)
    ok(state, "import", "qinglong", panel)
    p = start_serve(state, env=clean_env())
    try:
        ok(state, "run", "start", "probe", "--wait", "--timeout", "30")
    finally:
        p.stop()
    with open(os.path.join(panel, "scripts", "k.out"), "rb") as f:
        assert f.read() == b"top&older&newer"
