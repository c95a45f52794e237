"""The shape of ``[worker] control_url`` (issue 11): ``https://HOST[:PORT]``, or plain
``http://`` to a loopback host only. Pure (no I/O): ``service.config`` checks every URL with it
when the configuration loads — so ``config check`` refuses what ``serve`` would — and the control
client (``adapters.control_client``) connects to what it returns.
"""

from __future__ import annotations

import ipaddress
import urllib.parse

from .errors import ValidationError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_control_url(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``worker.control_url``: ``https://HOST[:PORT]`` (443), or
    ``http://`` to a loopback host only. Raises ValidationError(field="worker.control_url")."""
    field = "worker.control_url"
    u = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if u is None or u.scheme not in ("https", "http") or not u.hostname or u.path not in ("", "/") \
            or u.query or u.fragment or u.username or u.password:
        raise ValidationError(field, "must be https://HOST[:PORT] (no path, query or user)")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise ValidationError(field, "port outside 1..65535", limit="1..65535") from None
    if u.scheme == "http" and not is_loopback(u.hostname):
        raise ValidationError(field, "plain http:// only to a loopback host; use https:// with ca_file")
    return u.scheme, u.hostname, port
