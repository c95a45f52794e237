"""The names a control-plane replica's TLS certificate carries, against the address it listens
on (issue 20: a replica started with a certificate for other hosts said nothing, and every
Worker then refused it). Uses ``cryptography`` (control-plane side only, never a router) and
``psutil`` for the host's addresses when the replica listens on all of them."""

from __future__ import annotations

import fnmatch
import ipaddress
import socket


def certificate_names(cert_file: str) -> list[str]:
    """The subjectAltName entries of the first certificate in the PEM ``cert_file``, as
    ``DNS:name`` / ``IP:address``; [] when it has none. Raises OSError or ValueError when the
    file cannot be read or parsed (the replica's preflight has already accepted it)."""
    from cryptography import x509
    with open(cert_file, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return ([f"DNS:{n}" for n in san.get_values_for_type(x509.DNSName)]
            + [f"IP:{a}" for a in san.get_values_for_type(x509.IPAddress)])


def listen_names(host: str) -> list[str]:
    """The names a Worker may use for a replica listening on ``host``: ``host`` itself, or for
    an unspecified address (0.0.0.0, ::, "") this host's name and interface addresses."""
    try:
        unspecified = not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        unspecified = False
    if not unspecified:
        return [host]
    import psutil
    return [socket.gethostname()] + [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                                     for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]


def covers(names: list[str], host: str) -> bool:
    """Does a certificate with ``names`` (``certificate_names``) verify for ``host``, as a
    client checking the host name would judge it (IP entries exactly, DNS entries without case,
    one leading ``*.`` label)?"""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for n in names:
        kind, _, value = n.partition(":")
        if kind == "IP" and ip is not None and ipaddress.ip_address(value) == ip:
            return True
        if kind == "DNS" and ip is None and (value.lower() == host.lower() or (
                value.startswith("*.") and "." in host and fnmatch.fnmatch(host.lower().split(".", 1)[1],
                                                                           value[2:].lower()))):
            return True
    return False
