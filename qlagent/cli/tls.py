"""``qlagent tls ca create`` and ``qlagent tls cert create --server`` (issue 26): the control
plane's CA and a replica's certificate, made on the control-plane side
(``bootstrap.make_tls_ca``/``make_server_certificate`` over ``adapters.tls_ca``, ``cryptography``,
loaded inside the handlers, so no other command loads it).

Neither reads the configuration or the state directory: root runs them on a packaged control
plane, where the state belongs to the service's user. The replica's key goes to that user
(``--user``, default ``qlagent`` when run as root and it exists, as ``worker join`` gives a
Worker its credential); the CA key stays with whoever made it.

``--json`` prints ``{"certFile", "keyFile", "notAfter", "names"}`` (``names``: the
subjectAltNames, [] for the CA; with ``cert create`` also ``"user"``, the key's owner). Refusals:
exit 2 naming ``--days``, ``--common-name``, ``--name``, ``--server``, ``--ca``, ``--ca-key``,
``--user`` or ``--dir``; exit 3 ``file_exists`` for an output file already there without
``--force``. Nothing is written by a refused command."""

from __future__ import annotations

import os
import sys
import time

from ..core import errors as E


def _report(ctx, cert: str, key: str, names: list[str], end_s: int, role: str, user: str | None = None) -> int:
    from .common import fmt_us as _fmt_us, print_json as _print_json
    end = end_s * 1_000_000
    if ctx.args.json:
        out = {"certFile": os.path.abspath(cert), "keyFile": os.path.abspath(key), "notAfter": _fmt_us(end),
               "names": names}
        _print_json(out if user is None else {**out, "user": user})
    else:
        width = len(role) + 13
        print(f"{role + ' certificate':<{width}}{cert} (0644, valid until {_fmt_us(end)})")
        owner = f", user {user}" if user is not None else ""
        print(f"{role + ' key':<{width}}{key} (0600{owner}: keep it on this host)")
        if names:
            print(f"{'names':<{width}}{', '.join(names)}")
    return 0


def cmd_ca_create(ctx) -> int:
    from ..bootstrap import make_tls_ca
    a = ctx.args
    cert, key, end = make_tls_ca(a.dir, a.days, a.common_name, a.force)
    return _report(ctx, cert, key, [], end, "CA")


def cmd_cert_create(ctx) -> int:
    a = ctx.args
    if not a.server:
        raise E.ValidationError("--server", "required: only a replica's server certificate is made (a Worker "
                                            "proves itself with its credential, not a certificate)")
    from ..bootstrap import make_server_certificate
    from .join import service_user
    uid, gid, user = service_user(a.user)
    asked = int(time.time()) + a.days * 86_400
    cert, key, names, end = make_server_certificate(a.dir, a.name, a.ca, a.ca_key, a.days, a.force, (uid, gid))
    if end < asked - 3600:      # not a second's drift: the CA ends first
        from .common import fmt_us as _fmt_us
        print(f"qlagent: --days {a.days} cut to the CA's end ({_fmt_us(end * 1_000_000)}, {(end - time.time()) / 86_400:.1f} "
              "days): a certificate cannot outlive its CA", file=sys.stderr)
    return _report(ctx, cert, key, names, end, "server", user)


def register(sub, name: str, help_: str) -> None:
    """Add ``tls ca create`` and ``tls cert create`` to ``sub`` (the top-level subparsers);
    ``common`` is the parent parser of the common options."""
    from .common import options
    common = options()
    from .common import ascii_int as _ascii_int
    tls = sub.add_parser(name, help=help_).add_subparsers(
        dest="sub", required=True, metavar="SUB")
    ca = tls.add_parser("ca", help="the CA").add_subparsers(dest="action", required=True, metavar="ACTION")
    c = ca.add_parser("create", parents=[common], help="make a CA key (0600) and certificate (0644)")
    c.set_defaults(handler=cmd_ca_create, reads_config=False)
    c.add_argument("--dir", default=".", help="where to write qlagent-ca.pem and qlagent-ca-key.pem (default .)")
    c.add_argument("--days", type=_ascii_int, default=1825, help="lifetime in days (1..3650, default 1825)")
    c.add_argument("--common-name", default="qlagent CA", help="the CA's subject CN (1..64 characters)")
    c.add_argument("--force", action="store_true", help="replace files already there")
    cert = tls.add_parser("cert", help="replica certificates").add_subparsers(dest="action", required=True,
                                                                              metavar="ACTION")
    s = cert.add_parser("create", parents=[common], help="make a replica's key and certificate signed by the CA")
    s.set_defaults(handler=cmd_cert_create, reads_config=False)
    s.add_argument("--server", action="store_true", help="a server (replica) certificate (required)")
    s.add_argument("--name", required=True, metavar="HOST[,HOST…]",
                   help="the DNS names and IP addresses Workers dial (subjectAltNames, ≤ 32)")
    s.add_argument("--dir", default=".", help="where to write qlagent-server.pem and qlagent-server-key.pem")
    s.add_argument("--ca", default=None, help="the CA certificate (default DIR/qlagent-ca.pem)")
    s.add_argument("--ca-key", default=None, help="the CA key (default: qlagent-ca-key.pem beside --ca)")
    s.add_argument("--days", type=_ascii_int, default=365, help="lifetime in days (1..825, default 365)")
    s.add_argument("--user", default=None, help="the service's user, owner of the key (default qlagent when run "
                                                "as root and it exists, else you)")
    s.add_argument("--force", action="store_true", help="replace files already there")
