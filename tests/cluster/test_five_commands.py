"""README "A fleet in five commands" (issue 26), run as written: the configuration file and
the commands are read from the README section, with only the host-specific values replaced
(``/etc/qlagent`` and ``/var/lib/qlagent`` → this test's directories, ``cp.example.net`` →
localhost, port 7380 → a free one, the database URL → this module's), ``systemctl restart
qlagent`` → starting ``qlagent serve`` for that host, and ``sudo -u qlagent`` → this test's own
user (it has no service user to switch to; ``tests/test_tls_cli.py`` and
``tests/cluster/test_join.py`` check, as root, what each command gives that user). Real
PostgreSQL, a real replica serving HTTPS with the certificate ``qlagent tls`` made, a real Worker
joined with the token, a Run whose log reads back through the control plane."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile

from kit import Serve, free_port, qlagent_argv

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def _section() -> tuple[list[str], list[list[str]]]:
    """(the TOML blocks, the sh blocks' command lines) of the README section, in order."""
    text = open(README).read()
    body = text.split("## A fleet in five commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(toml|sh)\n(.*?)```", body, re.S)
    tomls = [b for kind, b in blocks if kind == "toml"]
    shs = [[ln for ln in b.splitlines() if ln.strip()] for kind, b in blocks if kind == "sh"]
    return tomls, shs


class Host:
    """A machine of the walkthrough: its /etc/qlagent and state directory, the environment
    that points ``qlagent`` at them, and its service (a :class:`kit.Serve`) when started, ready
    once its journal has a ``ready`` line."""

    def __init__(self, root: str, name: str, ready: str) -> None:
        self.etc = os.path.join(root, name, "etc")
        self.state = os.path.join(root, name, "state")
        os.makedirs(self.etc)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("QLAGENT_")}
        self.env.update(QLAGENT_CONFIG=os.path.join(self.etc, "qlagent.toml"), QLAGENT_STATE_DIR=self.state,
                        QLAGENT_LOG="stderr")
        self.service: Serve | None = None
        self.ready = ready

    def run(self, line: str, subst: dict[str, str]) -> str:
        """Run one README line (``a && b`` as two); stdout of the last command."""
        out = ""
        for part in line.split("&&"):
            for old, new in subst.items():
                part = part.replace(old, new)
            argv = shlex.split(part)
            if argv[:3] == ["sudo", "-u", "qlagent"]:
                argv = argv[3:]
            if argv == ["systemctl", "restart", "qlagent"]:
                self.restart()
                continue
            assert argv[0] == "qlagent", part
            p = subprocess.run(qlagent_argv(*argv[1:]), capture_output=True,
                               env=self.env, cwd=self.etc, timeout=120)
            assert p.returncode == 0 and b"Traceback" not in p.stderr, (part, p.stdout, p.stderr)
            out = p.stdout.decode()
        return out

    def restart(self) -> None:
        self.stop()
        self.service = Serve(env=self.env, ready=self.ready)

    def stop(self) -> None:
        if self.service is not None and self.service.poll() is None:
            assert self.service.stop(30) == 0, self.service.journal()


def test_the_readme_walkthrough_runs_a_task_on_a_joined_worker_over_https(pg_url):
    tomls, shs = _section()
    config, hello = tomls
    control, router_lines, run_lines = shs
    assert [ln.replace("sudo -u qlagent ", "").split()[:3] for ln in control + router_lines] == [
        ["qlagent", "tls", "ca"], ["qlagent", "tls", "cert"], ["qlagent", "init", "&&"],
        ["qlagent", "workers", "enroll"], ["qlagent", "worker", "join"]]
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="qlagent-five-", dir=base)
    cp, router = Host(root, "cp", "service.ready"), Host(root, "router", "worker.ready")
    port = str(free_port())
    subst = {"/etc/qlagent": cp.etc, "/var/lib/qlagent": cp.state, "cp.example.net": "localhost", "7380": port,
             "0.0.0.0": "127.0.0.1", "postgresql://qlagent@db.example.net/qlagent": pg_url}
    try:
        text = config
        for old, new in subst.items():
            text = text.replace(old, new)
        with open(cp.env["QLAGENT_CONFIG"], "w") as f:
            f.write(text)
        token = ""
        for line in control:
            token = cp.run(line, subst).strip()
        assert token.startswith("qlj1.") and "\n" not in token
        (join,) = router_lines
        router.run(join.replace("qlj1.…", token), {})
        assert router.service is not None and router.service.poll() is None
        add, start, logs = run_lines
        argv = shlex.split(add)
        with open(argv[argv.index("-f") + 1].replace("/etc/qlagent", cp.etc), "w") as f:
            f.write(hello)
        cp.run(add, subst)
        started = cp.run(start, subst)
        run_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", started).group(0)
        assert cp.run(logs.partition("#")[0].replace("RUN_ID", run_id), subst) == "hello from the fleet\n"
    finally:
        router.stop()
        cp.stop()
        shutil.rmtree(root, ignore_errors=True)
