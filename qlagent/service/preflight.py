"""The checks ``qlagent serve`` makes before it touches a database or the network, shared with
``qlagent config check`` (the systemd unit's ExecReload, the OpenWrt converter's validator): a
configuration the check accepts is not refused by ``serve`` for the same values and files.

- ``[cluster]``: the route threads against ``pool_size`` (``bootstrap.check_replica_pool``) and
  the TLS certificate and key (``http.tls.TlsAcceptor``), each refusal naming ``cluster.*``.
- ``[worker]``: the CA file (``bootstrap.worker_ca``), naming ``worker.ca_file``; the credential
  file when it is there (``bootstrap.worker_credential``: mode 0600, a Worker credential), naming
  ``worker.credential_file``. Its owner and its absence are ``serve``'s to judge: the OpenWrt
  converter runs the check as root for a service that runs as ``qlagent``, possibly before the
  credential is installed.
The rules that need no file (bounds, URL shapes, dispatcher ceilings, ``lease_ttl_s``) are in
``config.validate``, which every command runs when it loads the configuration.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from .. import bootstrap
from ..core.settings import Settings


class Preflight(NamedTuple):
    """What the checks built for a replica: its route ``threads`` and its ``tls`` acceptor
    (``http.tls.TlsAcceptor``, None without ``tls_cert``); both None for another role."""

    threads: int | None = None
    tls: object | None = None


def preflight(settings: Settings) -> Preflight:
    """Run the database-free start-up checks of ``settings``' role. Raises ValidationError (exit 2)
    naming the field: ``cluster.pool_size``, ``cluster.tls_cert``, ``cluster.tls_key``,
    ``worker.ca_file`` (a readable PEM holding a CA certificate), ``worker.credential_file``."""
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
        if os.path.lexists(worker.credential_file):
            bootstrap.worker_credential(worker, owner=False)
    return Preflight()
