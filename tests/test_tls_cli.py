"""``qlagent tls ca create`` / ``tls cert create --server`` (issue 26): real files, a real TLS
handshake with the certificate made, refusals that write nothing, and the expiry warning of
``config check`` and ``doctor``."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import stat
import threading

import pytest
from qlcli import cli, ok


def _mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _handshake(ca: str, cert: str, key: str, server_hostname: str) -> None:
    """A TLS server on loopback with ``cert``/``key``; a client trusting only ``ca`` connects
    naming ``server_hostname``. Raises ssl.SSLCertVerificationError when it refuses."""
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(cert, key)
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def serve():
        conn, _ = lsock.accept()
        try:
            with sctx.wrap_socket(conn, server_side=True) as s:
                s.sendall(b"hi")
        except (ssl.SSLError, OSError):
            pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    cctx.load_verify_locations(ca)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                cctx.wrap_socket(raw, server_hostname=server_hostname) as s:
            assert s.recv(2) == b"hi"
    finally:
        t.join(10)
        lsock.close()


def test_ca_and_server_certificate_verify_for_their_names_only(workdir):
    d = os.path.join(workdir, "tls")
    os.mkdir(d)
    ca = json.loads(ok(workdir, "tls", "ca", "create", "--dir", d, "--days", "400", "--json").stdout)
    assert (_mode(ca["certFile"]), _mode(ca["keyFile"])) == (0o644, 0o600)
    srv = json.loads(ok(workdir, "tls", "cert", "create", "--server", "--name", "cp.example.net,localhost,127.0.0.1",
                        "--dir", d, "--json").stdout)
    assert srv["names"] == ["DNS:cp.example.net", "DNS:localhost", "IP:127.0.0.1"]
    assert (_mode(srv["certFile"]), _mode(srv["keyFile"])) == (0o644, 0o600)
    for name in ("localhost", "127.0.0.1", "cp.example.net"):
        _handshake(ca["certFile"], srv["certFile"], srv["keyFile"], name)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ca["certFile"], srv["certFile"], srv["keyFile"], "other.example.net")
    # Another CA's client refuses this server: the trust is the CA made here, nothing else.
    other = os.path.join(workdir, "other")
    os.mkdir(other)
    ok(workdir, "tls", "ca", "create", "--dir", other)
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(os.path.join(other, "qlagent-ca.pem"), srv["certFile"], srv["keyFile"], "localhost")


LABEL63 = "a" * 63
NAME253 = ".".join([LABEL63] * 3 + ["b" * 61])     # the longest DNS name (253 characters)


def test_limits_themselves_are_accepted(workdir):
    d = os.path.join(workdir, "tls")
    os.mkdir(d)
    ca = json.loads(ok(workdir, "tls", "ca", "create", "--dir", d, "--days", "3650", "--common-name", "c" * 64,
                       "--json").stdout)
    assert ca["notAfter"] > "2036"
    names = [NAME253, f"{LABEL63}.example", "*.example.net", "::1"] + [f"h{i}" for i in range(28)]
    srv = json.loads(ok(workdir, "tls", "cert", "create", "--server", "--name", ",".join(names), "--dir", d,
                        "--days", "825", "--json").stdout)
    assert len(srv["names"]) == 32 and srv["names"][0] == f"DNS:{NAME253}" and "IP:::1" in srv["names"]
    one = os.path.join(workdir, "one")
    os.mkdir(one)
    ok(workdir, "tls", "ca", "create", "--dir", one, "--days", "1")
    ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", one, "--days", "1")


@pytest.mark.parametrize("args,code,field", [
    (["ca", "create", "--days", "0"], 2, "--days"),
    (["ca", "create", "--days", "-1"], 2, "--days"),
    (["ca", "create", "--days", "3651"], 2, "--days"),
    (["ca", "create", "--days", "1e3"], 2, "--days"),
    (["ca", "create", "--common-name", ""], 2, "--common-name"),
    (["ca", "create", "--common-name", "c" * 65], 2, "--common-name"),
    (["ca", "create", "--common-name", "a\nb"], 2, "--common-name"),
    (["ca", "create"], 3, "exists"),
    (["cert", "create", "--name", "localhost"], 2, "--server"),
    (["cert", "create", "--server", "--name", "bad name"], 2, "--name"),
    (["cert", "create", "--server", "--name", "a,a"], 2, "--name"),
    (["cert", "create", "--server", "--name", "A,a"], 2, "--name"),
    (["cert", "create", "--server", "--name", ""], 2, "--name"),
    (["cert", "create", "--server", "--name", "a,,b"], 2, "--name"),
    (["cert", "create", "--server", "--name", "-a.example"], 2, "--name"),
    (["cert", "create", "--server", "--name", "a" * 64], 2, "--name"),
    (["cert", "create", "--server", "--name", NAME253 + "b"], 2, "--name"),
    (["cert", "create", "--server", "--name", "*.*.example"], 2, "--name"),
    (["cert", "create", "--server", "--name", "fe80::1%eth0"], 2, "--name"),
    (["cert", "create", "--server", "--name", ",".join(f"h{i}" for i in range(33))], 2, "--name"),
    (["cert", "create", "--server", "--name", "localhost", "--days", "826"], 2, "--days"),
    (["cert", "create", "--server", "--name", "localhost", "--days", "0"], 2, "--days"),
    (["cert", "create", "--server", "--name", "localhost", "--ca", "/nonexistent/ca.pem"], 2, "--ca"),
    (["cert", "create", "--server", "--name", "localhost", "--ca-key", "SELF"], 2, "--ca-key"),
    (["cert", "create", "--server", "--name", "localhost", "--ca", "SRV"], 2, "--ca"),
    (["cert", "create", "--server", "--name", "localhost"], 3, "exists"),
])
def test_bad_input_is_one_line_naming_the_field_and_writes_nothing(workdir, args, code, field):
    d = os.path.join(workdir, "tls")
    os.mkdir(d)
    ok(workdir, "tls", "ca", "create", "--dir", d)
    ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d)
    args = [{"SELF": os.path.join(d, "qlagent-server-key.pem"), "SRV": os.path.join(d, "qlagent-server.pem")}
            .get(a, a) for a in args]
    before = {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)}
    p = cli(workdir, "tls", *args, "--dir", d)
    err = p.stderr.decode()
    assert p.returncode == code, err
    assert err.count("\n") == 1 and err.startswith("qlagent: error:") and field in err, err
    assert {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d)} == before


def test_force_replaces_and_a_server_certificate_never_outlives_its_ca(workdir):
    d = workdir
    ok(workdir, "tls", "ca", "create", "--dir", d, "--days", "10")
    first = open(os.path.join(d, "qlagent-ca.pem")).read()
    ok(workdir, "tls", "ca", "create", "--dir", d, "--days", "10", "--force")
    assert open(os.path.join(d, "qlagent-ca.pem")).read() != first
    ca_end = json.loads(ok(workdir, "tls", "ca", "create", "--dir", d, "--days", "10", "--force",
                           "--json").stdout)["notAfter"]
    srv = json.loads(ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d,
                        "--days", "365", "--json").stdout)
    assert srv["notAfter"] == ca_end


def _write_config(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def test_config_check_and_doctor_warn_thirty_days_before_expiry(workdir):
    short, long_ = os.path.join(workdir, "short"), os.path.join(workdir, "long")
    for d, days in ((short, "20"), (long_, "400")):
        os.mkdir(d)
        ok(workdir, "tls", "ca", "create", "--dir", d, "--days", days)
        ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d)
    cred = os.path.join(workdir, "worker.cred")
    with open(cred, "w") as f:
        f.write("qlw_" + "A" * 43 + "\n")
    os.chmod(cred, 0o600)
    state = os.path.join(workdir, "state")
    for d, warned in ((short, True), (long_, False)):
        worker = _write_config(os.path.join(d, "worker.toml"), f"""
[worker]
worker_id = "00000000-0000-4000-8000-000000000000"
control_url = "https://localhost:1"
credential_file = "{cred}"
ca_file = "{d}/qlagent-ca.pem"
""")
        cluster = _write_config(os.path.join(d, "cluster.toml"), f"""
[cluster]
database = "postgresql://postgres@127.0.0.1:5432/qlagent_none"
tls_cert = "{d}/qlagent-server.pem"
tls_key = "{d}/qlagent-server-key.pem"
""")
        for config, field in ((worker, "worker.ca_file"), (cluster, "cluster.tls_cert")):
            p = cli(state, "config", "check", "--config", config, "--json")
            assert p.returncode == 0, p.stderr
            (cert,) = json.loads(p.stdout)["certificates"]
            assert (cert["field"], cert["ok"]) == (field, not warned)
            assert (f"qlagent: warning: {field}" in p.stderr.decode()) == warned
        p = cli(state, "doctor", "--config", worker, "--json")
        (line,) = [c for c in json.loads(p.stdout)["checks"] if c["name"] == "certificate"]
        assert line["ok"] == (not warned) and "worker.ca_file" in line["detail"]
        # 20 days from its creation: 20 within the second it was made, 19 after (whole days).
        assert bool(re.search(r"expires in (19|20) days", line["detail"])) == warned
