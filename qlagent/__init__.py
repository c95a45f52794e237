"""qlagent: schedules and runs tasks on routers and edge boxes.

Layers (imports only point downwards; ``tests/test_import_boundaries.py`` checks it):

- ``qlagent.core``       pure domain: models, digests, limits, profiles, state machine, ports. No I/O.
- ``qlagent.adapters``   SQLite, filesystem, processes, secrets, netlink: implement core ports.
- ``qlagent.dispatch``   LocalRunDispatcher and materialiser (ADR-0071); depends on core + execution.
- ``qlagent.execution``  coordinator and run lifecycle (ADR-0070/0072 role); depends on core.
- ``qlagent.service`` / ``qlagent.http`` / ``qlagent.cli``  entry points that only wire.
"""

__version__ = "0.1.0"
