"""The checks ``qlagent serve`` makes before it touches a database or the network, shared with
``qlagent config check`` (the systemd unit's ExecReload, the OpenWrt converter's validator): a
configuration the check accepts is not refused by ``serve`` for the same values and files.

- ``[cluster]``: the route threads against ``pool_size`` (``bootstrap.check_replica_pool``) and
  the TLS certificate and key (``http.tls.TlsAcceptor``), each refusal naming ``cluster.*``.
- ``[worker]``: the CA file (``bootstrap.worker_ca``), naming ``worker.ca_file``. The credential
  file is checked by ``serve`` only: its rule (owned by the agent's uid, 0600) depends on who
  runs the check, and the OpenWrt converter runs it as root for a service that runs as ``qlagent``.
The rules that need no file (bounds, URL shapes, dispatcher ceilings, ``lease_ttl_s``) are in
``config.validate``, which every command runs when it loads the configuration.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import bootstrap
from .config import Settings


class Preflight(NamedTuple):
    """What the checks built for a replica: its route ``threads`` and its ``tls`` acceptor
    (``http.tls.TlsAcceptor``, None without ``tls_cert``); both None for another role."""

    threads: int | None = None
    tls: object | None = None


def preflight(settings: Settings) -> Preflight:
    """Run the database-free start-up checks of ``settings``' role. Raises ValidationError (exit 2)
    naming the field: ``cluster.pool_size``, ``cluster.tls_cert``, ``cluster.tls_key``,
    ``worker.ca_file`` (a readable PEM holding a CA certificate)."""
    cluster, worker = settings.config.cluster, settings.config.worker
    if cluster is not None:
        threads = bootstrap.check_replica_pool(cluster)
        tls = None
        if cluster.tls_cert is not None:
            from ..http.tls import TlsAcceptor      # loads ssl: only with TLS configured
            tls = TlsAcceptor(cluster.tls_cert, cluster.tls_key)
        return Preflight(threads=threads, tls=tls)
    if worker is not None:
        bootstrap.worker_ca(worker)
    return Preflight()
