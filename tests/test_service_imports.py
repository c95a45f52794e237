"""What a running service has imported, per configuration (issue 14).

Each case runs the real ``qlagent serve`` entry (``qlagent.cli.main.main``: argument parsing,
store, recovery, scheduler, loop, drain) in a fresh interpreter and prints ``sys.modules`` when
it has exited, so every module loaded on the way — at start, by a Run's materialisation, by
an HTTP request — is seen. The heavy modules must stay out of the resident agent: pyroute2
(+23 MiB) and asyncio (+9.6 MiB) for the network gate, cryptography (+9.4 MiB) for Secrets,
OpenSSL (``_hashlib``, ``_ssl``: +3.5 MiB) for tokens. Figures: bench/README.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

from qlcli import ok
from servehelp import add_tasks, runs_of
from test_secrets import write_legacy_store
from kit import free_port
from kit import clean_env, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# … and nothing of the cluster without a [cluster] table (issue 10): its policy, its adapter, its role.
HEAVY = ("pyroute2", "asyncio", "cryptography", "_hashlib", "_ssl", "psycopg", "qlagent.cluster",
         "qlagent.core.cluster", "qlagent.adapters.postgres", "qlagent.service.controlplane",
         "qlagent.worker", "qlagent.adapters.control_client")
PROBE = r'''
import json, sys
from qlagent.cli.main import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "modules": sorted(sys.modules)}))
'''
TASK = '''
[[task]]
name = "t"
schedule = "0 3 * * *"
command = ["/bin/true"]
'''


def serve(state: str, *args: str, until=None) -> set[str]:
    """Run ``qlagent serve ARGS`` in a fresh interpreter; ``until()`` (if given) runs while it
    serves, then SIGTERM drains it. Returns the modules it had loaded by its exit."""
    p = subprocess.Popen([sys.executable, "-c", PROBE, "--state-dir", state, "serve", *args], cwd=REPO,
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if until is not None:
            until()
            p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    result = json.loads(out.decode().splitlines()[-1])
    assert result["rc"] == 0, err
    return set(result["modules"])


def loaded(modules: set[str], names) -> list[str]:
    return sorted(n for n in names if n in modules or any(m.startswith(n + ".") for m in modules))


def test_plain_service_loads_none_of_the_heavy_modules(state, workdir):
    add_tasks(state, workdir, TASK)
    mods = serve(state, "--exit-after", "0.3")
    assert "qlagent.service.scheduler" in mods                    # the probe saw a real start
    assert loaded(mods, (*HEAVY, "nacl", "qlagent.http", "qlagent.adapters.netgate")) == []
    # nor what the plain idle figure was trimmed of (bench/results/service.md): argparse (serve
    # is parsed without it), importlib.resources, dataclasses/inspect, shutil with bz2/lzma, and
    # until its first Run (or a stray found at its start) psutil and subprocess
    assert loaded(mods, ("argparse", "importlib.resources", "dataclasses", "shutil", "bz2", "lzma", "psutil",
                         "subprocess")) == []

def test_http_service_answers_a_token_request_without_openssl(state, workdir):
    add_tasks(state, workdir, TASK)
    token = ok(state, "token", "create", "--subject", "probe", "--role", "viewer").stdout.decode().strip()
    port = free_port()
    answers = []

    def request() -> None:
        def get():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v3/projects/default/runs",
                                         headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    return r.status, json.loads(r.read())
            except OSError:
                return None
        answers.append(wait_until(get, timeout=20, step=0.05))
    mods = serve(state, "--listen", f"127.0.0.1:{port}", until=request)
    assert answers[0][0] == 200 and "items" in answers[0][1]       # authenticated with the token
    assert "qlagent.http.service" in mods
    assert loaded(mods, (*HEAVY, "nacl", "secrets", "hashlib", "qlagent.adapters.netgate")) == []


def test_scraped_metrics_of_the_router_configuration_load_no_heavy_module(state, workdir):
    """``[http] metrics = true`` on the edge Profile (issue 26 §3): ``GET /metrics`` answered
    from figures the agent has, by ``core.metrics`` (stdlib ``re`` only), never prometheus_client."""
    add_tasks(state, workdir, TASK)
    config = os.path.join(workdir, "metrics.toml")
    with open(config, "w") as f:
        f.write("[http]\nmetrics = true\n")
    port = free_port()
    bodies = []

    def scrape() -> None:
        def get():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return r.read()
            except OSError:
                return None
        bodies.append(wait_until(get, timeout=20, step=0.05))
    mods = serve(state, "--config", config, "--profile", "edge", "--listen", f"127.0.0.1:{port}", until=scrape)
    assert b"\nqlagent_service_pids " in bodies[0]
    assert "qlagent.core.metrics" in mods
    assert loaded(mods, (*HEAVY, "nacl", "prometheus_client", "secrets", "hashlib", "qlagent.adapters.netgate")) == []


def test_gated_service_watches_the_network_without_pyroute2(state, workdir):
    add_tasks(state, workdir, TASK.replace('command', 'network = "default_route"\ncommand'))
    mods = serve(state, "--exit-after", "0.3")
    assert "qlagent.adapters.netgate" in mods and "qlagent.adapters.netlink_wake" in mods   # the gate ran
    assert loaded(mods, (*HEAVY, "nacl")) == []


SECRET_TASK = '''
[[task]]
name = "uses-secret"
schedule = "@once"
shell = "/bin/sh"
script = 'test -n "$TOKEN"'
secrets = { TOKEN = "api_token" }
'''


def test_secret_run_decrypts_with_pynacl_only(state, workdir):
    add_tasks(state, workdir, SECRET_TASK)
    ok(state, "secret", "set", "api_token", stdin=b"value-1")
    run_id = ok(state, "run", "start", "uses-secret").stdout.decode().strip()
    mods = serve(state, until=lambda: wait_until(lambda: dict(runs_of(state, "uses-secret"))[run_id] == "succeeded",
                                                 timeout=30))
    assert "nacl.bindings" in mods                                  # the Secret was decrypted here
    assert loaded(mods, HEAVY) == []


def test_cryptography_is_loaded_only_while_an_old_format_row_exists(state, workdir):
    """A store written by the AES-GCM version: the first start re-encrypts (and so loads
    cryptography once); every later start, with a Secret Run, loads only PyNaCl."""
    write_legacy_store(state, {"api_token": b"value-1"})
    add_tasks(state, workdir, SECRET_TASK)
    assert "cryptography" in serve(state, "--exit-after", "0.3")
    run_id = ok(state, "run", "start", "uses-secret").stdout.decode().strip()
    mods = serve(state, until=lambda: wait_until(lambda: dict(runs_of(state, "uses-secret"))[run_id] == "succeeded",
                                                 timeout=30))
    assert "nacl.bindings" in mods and loaded(mods, HEAVY) == []
