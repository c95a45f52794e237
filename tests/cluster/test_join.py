"""The one-line join (issue 26): ``workers enroll NAME --join-token`` on a real replica serving
HTTPS with a certificate from ``qlagent tls``; ``worker join TOKEN`` writes a configuration
that ``doctor`` accepts against that replica; a truncated (at any length), damaged, used,
expired (by the control plane's record or the router's clock), foreign-CA, unreachable,
removed-Worker or rotated-credential token is one line and writes nothing."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgspec
import pytest
from conftest import create_database, db_url, drop_database
from test_cluster_serve import Env, Replica
from kit import free_port, run_cli, wait_until

from qlagent.core.jointoken import decode_token, encode_token


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=120)


@pytest.fixture(scope="module")
def cp(pg_url):
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="qlagent-join-", dir=base)
    tls = os.path.join(root, "tls")
    os.mkdir(tls)
    assert _cli("tls", "ca", "create", "--dir", tls).returncode == 0
    assert _cli("tls", "cert", "create", "--server", "--name", "localhost,127.0.0.1", "--dir", tls).returncode == 0
    # (sweep_interval_s: the unplaceable-Run check of the status test comes within a second)
    env = Env(root, pg_url, f'tls_cert = "{tls}/qlagent-server.pem"\ntls_key = "{tls}/qlagent-server-key.pem"\n'
                            'sweep_interval_s = 0.5\n')
    env.ok("init")
    replica = Replica(env)
    yield env, replica, tls
    assert replica.stop() == 0
    shutil.rmtree(root, ignore_errors=True)


def _enroll(env, name: str, *extra: str, port: int) -> str:
    out = json.loads(env.ok("workers", "enroll", name, "--join-token", "--url", f"https://localhost:{port}",
                            *extra, "--json"))
    assert set(out) == {"workerId", "name", "joinToken"} and out["joinToken"].startswith("qlj1.")
    return out["joinToken"]


def _router(env, tag: str) -> str:
    d = os.path.join(env.root, f"router-{tag}")
    os.mkdir(d)
    return d


def _join(router: str, token: str, *extra: str) -> subprocess.CompletedProcess:
    return _cli("worker", "join", token, "--config", os.path.join(router, "qlagent.toml"),
                "--state-dir", os.path.join(router, "state"), *extra)


def _refused(p: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = p.stderr.decode()
    assert p.returncode == code, err
    assert err.startswith("qlagent: error:") and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def test_join_writes_config_credential_and_ca_that_doctor_accepts(cp):
    env, replica, tls = cp
    token = _enroll(env, "r1", "--label", "site=lab", "--label", "rack=2", port=replica.port)
    router = _router(env, "ok")
    p = _join(router, token, "--label", "site=lab", "--json")
    assert p.returncode == 0, (p.stdout, p.stderr)
    out = json.loads(p.stdout)
    assert out["name"] == "r1" and out["next"]
    cred, ca = os.path.join(router, "worker.cred"), os.path.join(router, "cp-ca.pem")
    assert stat.S_IMODE(os.stat(cred).st_mode) == 0o600 and stat.S_IMODE(os.stat(ca).st_mode) == 0o644
    assert open(ca).read() == open(os.path.join(tls, "qlagent-ca.pem")).read()
    checks = {c["name"]: c for c in out["checks"] if c["name"] in ("credential", "ca file", "control", "worker")}
    assert all(c["ok"] for c in out["checks"]), out["checks"]
    assert "known as r1" in checks["worker"]["detail"]
    # Shown once: neither the credential nor the token is kept where the control plane could show it again.
    kept = env.sql("SELECT row_to_json(w)::text FROM workers w UNION ALL SELECT row_to_json(j)::text FROM join_tokens j")
    assert kept and not any(decode_token(token).credential in row or token in row for (row,) in kept)
    # config check takes what was written, and the same token is refused now: it was used.
    ok = _cli("config", "check", "--config", os.path.join(router, "qlagent.toml"), "--json")
    assert ok.returncode == 0, ok.stderr
    worker = json.loads(ok.stdout)["config"]["worker"]
    assert worker["worker_id"] == out["workerId"] and worker["labels"] == {"site": "lab"}
    again = _router(env, "again")
    _refused(_join(again, token), 3, "TOKEN", "used")
    assert os.listdir(again) == []
    # Joining over a config that has a [worker] already needs --force.
    _refused(_join(router, _enroll(env, "r1b", port=replica.port)), 3, "--force")


def test_join_doctor_and_the_joined_worker_on_the_router_load_no_cryptography_nor_psycopg(cp):
    """``worker join``, ``doctor`` over what it wrote and then the Worker itself (``serve``,
    its Session open and its ``/metrics`` scraped), each in a fresh interpreter that lists its
    modules at exit: the standard library's ssl only, as a router has neither ``cryptography``
    nor ``psycopg`` (issue 26 §1)."""
    env, replica, _ = cp
    router = _router(env, "imports")
    out = os.path.join(router, "modules.json")
    config = os.path.join(router, "qlagent.toml")
    probe = ("import atexit, json, os, sys\nfrom qlagent.cli.main import main\n"
             "atexit.register(lambda: open(os.environ['MODULES_OUT'], 'w').write(json.dumps(sorted(sys.modules))))\n"
             "sys.exit(main(sys.argv[1:]))\n")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}

    def modules(what: str) -> list[str]:
        with open(out) as f:
            mods = json.load(f)
        os.unlink(out)
        heavy = [m for m in mods if m.split(".")[0] in ("cryptography", "psycopg", "psycopg_pool")]
        assert "ssl" in mods and heavy == [], (what, heavy)
        return mods
    for args in (["worker", "join", _enroll(env, "imp", port=replica.port), "--config", config,
                  "--state-dir", os.path.join(router, "state")], ["doctor", "--config", config]):
        p = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True,
                           env={**run_env, "MODULES_OUT": out}, timeout=120)
        assert p.returncode == 0, (args[0], p.stdout, p.stderr)
        modules(args[0])
    port = free_port()
    with open(config, "a") as f:
        f.write(f'\n[http]\nlisten = "127.0.0.1:{port}"\nmetrics = true\n')
    journal = os.path.join(router, "worker.log")
    with open(journal, "wb") as log:
        worker = subprocess.Popen([sys.executable, "-c", probe, "--config", config, "serve"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=log, env={**run_env, "MODULES_OUT": out})
    try:
        def scraped() -> bool:
            assert worker.poll() is None, open(journal).read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return b"qlagent_worker_session_open 1" in r.read()
            except OSError:
                return False
        wait_until(scraped, 30, "the joined Worker's Session open on its /metrics", detail=lambda: open(journal).read())
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0, open(journal).read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert "qlagent.worker.runtime" in modules("serve")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_join_as_root_gives_the_credential_and_state_to_the_service_user_and_checks_as_that_user(cp):
    env, replica, _ = cp
    router = _router(env, "user")
    nobody = pwd.getpwnam("nobody")
    os.chmod(env.root, 0o755)           # the service's user reaches its files (mkdtemp made 0700)
    p = _join(router, _enroll(env, "usr", port=replica.port), "--user", "nobody", "--json")
    # doctor runs as nobody: where nobody may execute this interpreter (a package's
    # /usr/bin/python3) it reads the 0600 credential it owns and is known to the replica; where
    # it may not (a venv under root's 0700 home) the join says so in one failed check, exit 5.
    runs = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", "pass"],
                          capture_output=True).returncode == 0
    assert p.returncode == (0 if runs else 5), (p.stdout, p.stderr)
    out = json.loads(p.stdout)
    cred = os.stat(os.path.join(router, "worker.cred"))
    assert (cred.st_uid, stat.S_IMODE(cred.st_mode)) == (nobody.pw_uid, 0o600) and out["user"] == "nobody"
    assert os.stat(os.path.join(router, "state")).st_uid == nobody.pw_uid
    if runs:
        assert all(c["ok"] for c in out["checks"]), out["checks"]
    else:
        assert [(c["name"], c["ok"]) for c in out["checks"]] == [("doctor", False)], out["checks"]
        assert "PermissionError" in out["checks"][0]["detail"] and b"Traceback" not in p.stderr
    _refused(_join(_router(env, "nouser"), _enroll(env, "usr2", port=replica.port), "--user", "no-such-user"),
             2, "--user", "no-such-user")
    assert os.listdir(os.path.join(env.root, "router-nouser")) == []


def test_bad_tokens_are_one_line_and_write_nothing(cp):
    env, replica, tls = cp
    router = _router(env, "bad")
    token = _enroll(env, "r2", port=replica.port)
    # Cut anywhere: each base64 remainder (1, 2, 3 characters short) and the prefix alone.
    for cut in (token[:-1], token[:-2], token[:-3], token[:-12], token[:len(token) // 2], "qlj1."):
        _refused(_join(router, cut), 2, "TOKEN", "truncated")
    for other in ("qlj2." + token[5:], "", token[5:]):
        _refused(_join(router, other), 2, "TOKEN", "not a join token")
    # Decodes, but not as `workers enroll` makes one: the part is named, before the config is judged.
    t = decode_token(token)
    for bad, part in ((msgspec.structs.replace(t, worker_id="../etc"), "Worker ID"),
                      (msgspec.structs.replace(t, urls=["https://cp.example.net/path"]), "URL"),
                      (msgspec.structs.replace(t, credential="qlw_short"), "credential")):
        _refused(_join(router, encode_token(bad)), 2, "TOKEN", "damaged", part)
    # Expired by the router's clock (the token says so): refused before the control plane is asked.
    past = encode_token(msgspec.structs.replace(t, expires_at_s=int(time.time()) - 5))
    _refused(_join(router, past), 3, "TOKEN", "expired", "this host's clock")
    # The token's expiry is the control plane's record, not what the token says.
    env.sql("UPDATE join_tokens SET expires_at_us = 0 WHERE worker_id = "
            "(SELECT worker_id FROM workers WHERE name = 'r2' AND state <> 'removed')")
    _refused(_join(router, token), 3, "TOKEN", "expired")
    # Another control plane's CA pinned in the token: this replica's certificate is refused.
    other = os.path.join(env.root, "other-ca")
    os.mkdir(other)
    assert _cli("tls", "ca", "create", "--dir", other).returncode == 0
    foreign = _enroll(env, "r3", "--ca", os.path.join(other, "qlagent-ca.pem"), port=replica.port)
    _refused(_join(router, foreign), 2, "TOKEN", "not signed by the CA in the token")
    # No replica there.
    unreachable = json.loads(env.ok("workers", "enroll", "r4", "--join-token", "--url", "https://localhost:1",
                                    "--json"))["joinToken"]
    _refused(_join(router, unreachable), 5, "localhost:1")
    # A Worker removed since the token was made.
    removed = _enroll(env, "r5", port=replica.port)
    env.ok("workers", "rm", "r5")
    _refused(_join(router, removed), 4, "TOKEN", "removed")
    # The credential rotated since the token was made: the token's credential is refused.
    rotated = _enroll(env, "r6", port=replica.port)
    env.ok("workers", "rotate-credential", "r6")
    _refused(_join(router, rotated), 4, "TOKEN", "rotated")
    assert os.listdir(router) == []


@pytest.mark.parametrize("ttl", [60, 604_800])
def test_token_ttl_limits_themselves_are_accepted(cp, ttl):
    env, replica, _ = cp
    before = int(time.time())
    token = decode_token(_enroll(env, f"ttl{ttl}", "--token-ttl", str(ttl), port=replica.port))
    assert before + ttl <= token.expires_at_s <= int(time.time()) + ttl


@pytest.mark.parametrize("args,field", [
    ([], "--url"),
    (["--url", "ftp://x"], "--url"),
    (["--url", "https://localhost:7380", "--ca", "/nonexistent.pem"], "--ca"),
    (["--url", "https://localhost:7380", "--token-ttl", "59"], "--token-ttl"),
    (["--url", "https://localhost:7380", "--token-ttl", "604801"], "--token-ttl"),
])
def test_bad_join_token_options_enroll_nothing(cp, args, field):
    env, _, _ = cp
    p = env.cli("workers", "enroll", "nope", "--join-token", *args)
    _refused(p, 2, field)
    assert "nope" not in env.ok("workers", "ls")


def _worker_config(config: str) -> dict:
    ok = _cli("config", "check", "--config", config, "--json")
    assert ok.returncode == 0, ok.stderr
    return json.loads(ok.stdout)["config"]["worker"]


def test_rotate_credential_keeps_the_worker_id_and_refuses_the_old_one_at_once(cp):
    env, replica, _ = cp
    url = f"https://localhost:{replica.port}"
    first = json.loads(env.ok("workers", "enroll", "rot", "--label", "site=lab", "--slots", "3", "--join-token",
                              "--url", url, "--json"))
    listed = {w["name"]: w for w in json.loads(env.ok("workers", "ls", "--json"))["items"]}
    assert listed["rot"]["labels"] == {"site": "lab"}
    assert "site=lab" in next(ln for ln in env.ok("workers", "ls").splitlines() if ln.startswith("rot "))
    router = _router(env, "rot")
    assert _join(router, first["joinToken"], "--label", "site=lab").returncode == 0
    config = os.path.join(router, "qlagent.toml")
    # The enrolled slots are written: the Worker runs 3 at once, not 1.
    assert _worker_config(config)["slots"] == 3
    # The operator's own [worker] keys, and a table of their own after it.
    with open(config) as f:
        text = f.read().replace("slots = 3", "slots = 2\nheartbeat_interval_s = 2\npull_wait_s = 7")
    with open(config, "w") as f:
        f.write(text + '\n[http]\nmetrics = true\n')
    rotated = json.loads(env.ok("workers", "rotate-credential", "rot", "--join-token", "--url", url, "--json"))
    assert rotated["workerId"] == first["workerId"]
    # The router's credential (the old one) is refused now.
    doctor = json.loads(_cli("doctor", "--config", config, "--json").stdout)["checks"]
    assert [c["ok"] for c in doctor if c["name"] == "worker"] == [False]
    p = _join(router, rotated["joinToken"], "--force", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["workerId"] == first["workerId"]
    doctor = json.loads(_cli("doctor", "--config", config, "--json").stdout)["checks"]
    assert [c["ok"] for c in doctor if c["name"] == "worker"] == [True]
    # --force replaced what the token carries and kept every other key.
    worker = _worker_config(config)
    assert (worker["slots"], worker["heartbeat_interval_s"], worker["pull_wait_s"]) == (2, 2.0, 7)
    assert worker["labels"] == {"site": "lab"} and worker["worker_id"] == first["workerId"]
    assert "metrics = true" in open(config).read()
    plain = json.loads(env.ok("workers", "rotate-credential", "rot", "--json"))
    assert plain["workerId"] == first["workerId"] and plain["credential"].startswith("qlw_")
    _refused(env.cli("workers", "rotate-credential", "nobody"), 4, "nobody")


NOWHERE = """
[[task]]
name = "nowhere"
executor = "remote_worker"
placement = { required = { site = "nowhere" } }
shell = "/bin/sh"
script = "true"
"""


def test_status_shows_the_database_replicas_workers_queue_and_a_credential_clash(cp):
    from qlagent.adapters.postgres.connection import open_pool
    from qlagent.adapters.postgres.registry import PgWorkerRegistry
    from qlagent.cluster.registry import WorkerRegistry
    env, replica, _ = cp
    clash = json.loads(env.ok("workers", "enroll", "twice", "--json"))
    pool = open_pool(env.url, 1)
    try:            # two processes with one credential: each hello replaces the other's Session
        registry = WorkerRegistry(PgWorkerRegistry(pool))
        for _ in range(4):
            registry.open_session(clash["workerId"], clash["credential"])
    finally:
        pool.close()
    out = json.loads(env.ok("status", "--json"))
    assert out["database"]["role"] == "primary" and out["database"]["standbys"] == []
    assert out["workers"]["online"]["count"] >= 1 and out["workers"]["online"]["freeSlots"] >= 1
    assert out["clashes"] == [{"name": "twice", "replaced": 3}]
    assert out["runs"]["queued"] == 0 and out["runs"]["oldestQueuedAgeS"] is None
    # The replica, by host and pid, with its pool and LISTEN sessions; the CLI's own is left out.
    (seen,) = out["replicas"]
    assert seen["name"].endswith(f"/{replica.proc.pid}") and seen["connections"] >= 2, out
    assert all(c["application"] is None or not c["application"].startswith("qlagent replica") for c in out["clients"])
    # A Run no Worker could take: queued, then unplaceable, its age growing.
    tasks = os.path.join(env.root, "nowhere.toml")
    with open(tasks, "w") as f:
        f.write(NOWHERE)
    env.ok("task", "add", "-f", tasks)
    run_id = env.ok("run", "start", "nowhere").split()[0]

    def aged() -> dict | None:
        runs = json.loads(env.ok("status", "--json"))["runs"]
        return runs if runs["unplaceable"] == 1 and runs["oldestQueuedAgeS"] >= 1 else None
    assert wait_until(aged, 20, "the Run found unplaceable, queued a second")["queued"] == 1
    text = env.ok("status")
    assert "primary" in text and "twice (3 Sessions replaced" in text
    assert f"/{replica.proc.pid} (" in next(ln for ln in text.splitlines() if ln.startswith("replicas "))
    assert "1 queued (1 unplaceable), oldest queued " in text
    env.ok("run", "cancel", run_id)
    plain = os.path.join(env.root, "plain.toml")
    with open(plain, "w") as f:
        f.write('profile = "edge"\n')
    _refused(_cli("status", "--config", plain, "--state-dir", os.path.join(env.root, "plain")), 2, "cluster")


def test_status_counts_free_slots_in_words_on_a_fleet_of_its_own(tmp_path):
    """A database of its own (the module's has Workers of the other tests): one online Worker
    with one slot reads "1 free slot", another with two makes it "3 free slots"."""
    from qlagent.adapters.postgres.connection import open_pool
    from qlagent.adapters.postgres.registry import PgWorkerRegistry
    from qlagent.cluster.registry import WorkerRegistry
    name = create_database("status_words")
    try:
        env = Env(str(tmp_path), db_url(name))
        env.ok("init")
        lines = []
        for worker, slots in (("one", "1"), ("two", "2")):
            enrolled = json.loads(env.ok("workers", "enroll", worker, "--slots", slots, "--json"))
            pool = open_pool(env.url, 1)
            try:
                WorkerRegistry(PgWorkerRegistry(pool)).open_session(enrolled["workerId"], enrolled["credential"])
            finally:
                pool.close()
            lines += [ln for ln in env.ok("status").splitlines() if ln.startswith("workers ")]
        assert lines == ["workers    online 1 (1 free slot)", "workers    online 2 (3 free slots)"]
    finally:
        drop_database(name)


def test_join_on_openwrt_writes_uci_options(cp):
    env, replica, _ = cp
    standin = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "openwrt_standin")
    uci = os.path.join(env.root, "uci")
    os.mkdir(uci)
    router = _router(env, "openwrt")
    token = _enroll(env, "owrt", "--label", "site=roof", "--slots", "2", port=replica.port)
    with open(os.path.join(uci, "heartbeat_interval_s"), "w") as f:
        f.write("2.5")             # the operator's own option: kept
    p = run_cli("worker", "join", token, "--uci", "--dir", router, "--label", "site=roof",
                env={"UCI_DIR": uci, "PATH": standin + os.pathsep + os.environ["PATH"]}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "/etc/init.d/qlagent restart" in p.stdout.decode()

    def opt(name: str):
        path = os.path.join(uci, name)
        return [open(os.path.join(path, e)).read() for e in sorted(os.listdir(path))] if os.path.isdir(path) \
            else open(path).read()
    assert opt("control_url") == [f"https://localhost:{replica.port}"]
    assert opt("credential_file") == os.path.join(router, "worker.cred")
    assert opt("ca_file") == os.path.join(router, "cp-ca.pem") and opt("label") == ["site=roof"]
    assert len(opt("worker_id")) == 36 and os.path.exists(os.path.join(uci, ".committed"))
    assert opt("slots") == "2" and opt("heartbeat_interval_s") == "2.5"
    assert sorted(os.listdir(router)) == ["cp-ca.pem", "worker.cred"]


def test_join_refuses_what_the_control_plane_would_refuse_at_the_hello_and_writes_nothing(cp):
    """A label the enrolment does not grant, slots above the enrolled ones, a heartbeat too slow
    for the replica's Session TTL (30 s): refused by join (one line, exit 2), as ``serve`` would
    refuse it; the heartbeat also by ``doctor`` and by ``serve`` before ``worker.ready``."""
    env, replica, _ = cp
    router = _router(env, "narrow")
    token = _enroll(env, "narrow", "--slots", "2", port=replica.port)
    _refused(_join(router, token, "--label", "site=x"), 2, "--label", "site=x", "not granted by the enrolment",
             "labels: none")
    assert os.listdir(router) == []
    config = os.path.join(router, "qlagent.toml")
    for extra, words in (("slots = 3", ("worker.slots", "3 exceeds the enrolled 2")),
                         ("heartbeat_interval_s = 10", ("worker.heartbeat_interval_s", "10 s", "30 s"))):
        text = f'[worker]\nworker_id = "{decode_token(token).worker_id}"\ncontrol_url = "https://localhost:1"\n' \
               f'credential_file = "/nonexistent"\n{extra}\n'
        with open(config, "w") as f:
            f.write(text)
        _refused(_join(router, token, "--force"), 2, *words)
        assert sorted(os.listdir(router)) == ["qlagent.toml"] and open(config).read() == text
    # The token is still unused: it joins with what the enrolment grants.
    os.unlink(config)
    assert _join(router, token).returncode == 0
    # The cadence made too slow afterwards: doctor names both values, serve refuses it before
    # it says ready or opens a Session.
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace("slots = 2", "slots = 2\nheartbeat_interval_s = 10"))
    checks = json.loads(_cli("doctor", "--config", config, "--json").stdout)["checks"]
    beat = [c for c in checks if c["name"] == "heartbeat"]
    assert [c["ok"] for c in beat] == [False] and "10 s" in beat[0]["detail"] and "30 s" in beat[0]["detail"]
    generation = "SELECT generation FROM workers WHERE name = 'narrow' AND state <> 'removed'"
    before = env.sql(generation)
    p = run_cli("serve", "--config", config, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2 and "worker.heartbeat_interval_s" in err and "worker.ready" not in err, err
    assert env.sql(generation) == before
