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
    (["cert", "create", "--server", "--name", "a" * 64], 2, "at most 63"),
    (["cert", "create", "--server", "--name", f"{'a' * 64}.example"], 2, "at most 63"),
    (["cert", "create", "--server", "--name", NAME253 + "b"], 2, "at most 253"),
    (["cert", "create", "--server", "--name", "256.1.1.1"], 2, "is not an IP address"),
    (["cert", "create", "--server", "--name", "01.2.3.4"], 2, "is not an IP address"),
    (["cert", "create", "--server", "--name", "1.2.3"], 2, "is not an IP address"),
    (["cert", "create", "--server", "--name", "bücher.example"], 2, "'xn--bcher-kva.example'"),
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
    p = ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d, "--days", "365", "--json")
    assert json.loads(p.stdout)["notAfter"] == ca_end
    # Said, not silent: one line on stderr naming --days and the CA's end.
    err = p.stderr.decode()
    assert err.count("\n") == 1 and "--days 365 cut to the CA's end" in err and ca_end in err, err


def _write_config(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def test_config_check_and_doctor_warn_thirty_days_before_expiry(workdir):
    cred = os.path.join(workdir, "worker.cred")
    with open(cred, "w") as f:
        f.write("qlw_" + "A" * 43 + "\n")
    os.chmod(cred, 0o600)
    state = os.path.join(workdir, "state")
    # 30 days from now is within the warning by the time it is read; 31 days is not.
    for days, warned in (("20", True), ("30", True), ("31", False), ("400", False)):
        d = os.path.join(workdir, f"days{days}")
        os.mkdir(d)
        ok(workdir, "tls", "ca", "create", "--dir", d, "--days", days)
        ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d)
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
        for config, field in ((worker, "worker.ca_file"), (cluster, "cluster.tls_cert")):
            # (the cluster's database does not exist: doctor fails that line, and still reads the certificate)
            p = cli(state, "doctor", "--config", config, "--json")
            (line,) = [c for c in json.loads(p.stdout)["checks"] if c["name"] == "certificate"]
            assert line["ok"] == (not warned) and field in line["detail"], line
            # N days from its creation: N within the second it was made, N - 1 after (whole days);
            # the server certificate's own default lifetime is 365 days.
            n = int(days) if field == "worker.ca_file" else min(int(days), 365)
            assert re.search(rf"expires in ({n - 1}|{n}) days", line["detail"]), line


def test_tls_reads_neither_the_configuration_nor_the_state_directory(workdir):
    """On a packaged control plane root runs ``tls``, and the state directory belongs to the
    service's user, which root's trust rules refuse: ``tls`` must not read it, nor the
    configuration (here one that does not even parse, beside a world-writable state dir)."""
    state = os.path.join(workdir, "state")
    os.mkdir(state)
    os.chmod(state, 0o777)
    config = _write_config(os.path.join(workdir, "broken.toml"), "[[[")
    assert cli(state, "--config", config, "config", "check").returncode in (2, 5)
    d = os.path.join(workdir, "tls")
    os.mkdir(d)
    for args in (["ca", "create"], ["cert", "create", "--server", "--name", "localhost"]):
        p = cli(state, "--config", config, "tls", *args, "--dir", d)
        assert p.returncode == 0 and not p.stderr, p.stderr
    assert sorted(os.listdir(d)) == ["qlagent-ca-key.pem", "qlagent-ca.pem", "qlagent-server-key.pem",
                                     "qlagent-server.pem"]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_as_root_the_server_key_goes_to_the_service_user_and_the_ca_key_stays_roots(workdir):
    import pwd
    d = os.path.join(workdir, "tls")
    os.mkdir(d)
    ok(workdir, "tls", "ca", "create", "--dir", d)
    nobody = pwd.getpwnam("nobody")
    out = json.loads(ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d,
                        "--user", "nobody", "--json").stdout)
    assert out["user"] == "nobody"
    owners = {n: (os.stat(os.path.join(d, n)).st_uid, _mode(os.path.join(d, n))) for n in os.listdir(d)}
    assert owners == {"qlagent-ca-key.pem": (0, 0o600), "qlagent-ca.pem": (0, 0o644),
                      "qlagent-server-key.pem": (nobody.pw_uid, 0o600), "qlagent-server.pem": (0, 0o644)}
    assert "(0600, user nobody: keep it on this host)" in ok(
        workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d, "--user", "nobody",
        "--force").stdout.decode()
    # Without --user: the packaged service's user `qlagent` when it exists, else root itself.
    try:
        service = pwd.getpwnam("qlagent").pw_uid
    except KeyError:
        service = 0
    ok(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", d, "--force")
    assert os.stat(os.path.join(d, "qlagent-server-key.pem")).st_uid == service
    other = os.path.join(workdir, "other")
    os.mkdir(other)
    ok(workdir, "tls", "ca", "create", "--dir", other)
    before = sorted(os.listdir(other))
    p = cli(workdir, "tls", "cert", "create", "--server", "--name", "localhost", "--dir", other,
            "--user", "no-such-user")
    assert p.returncode == 2 and p.stderr.decode().count("\n") == 1 and "--user" in p.stderr.decode(), p.stderr
    assert sorted(os.listdir(other)) == before
