"""The fleet Worker (issue 11), one house: its runtime here — one selectors loop (``runtime``)
over its control client, durable inbox and local runs, one concept per module: ``job`` (an open
inbox row), ``recovery`` (restart), ``session`` (hello, heartbeats), ``pull`` (offers),
``sends`` (ACKs, the row's advance), ``spawn`` (the shim), ``logs`` (chunk upload), ``stops``
(fencing, timeouts, kills) — and its pure decisions in ``worker.policy``."""
