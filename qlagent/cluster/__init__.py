"""Cluster control-plane policy (ADR-0014, ADR-0108, ADR-0109): transport-agnostic, over the
ports of ``qlagent.core.cluster``; the PostgreSQL adapter implements them."""
