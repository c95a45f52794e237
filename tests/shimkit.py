"""Helpers shared by the shim-shim and process-tree tests: the router-task scripts,
a minimal task environment and a shim spec on real files."""

from __future__ import annotations

import os
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "examples", "router-tasks")
EDGE_LOG = 4194304
PATH_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}


def make_spec(tmp_path, argv, env=None, quota=EDGE_LOG, linger=0.5, cwd="/"):
    """A shim spec with a fresh 0700 run directory and an empty 0600 Artifact under tmp_path."""
    attempt_id = str(uuid.uuid4())
    run_dir = tmp_path / "runs" / attempt_id
    run_dir.mkdir(parents=True, mode=0o700)
    artifact = tmp_path / (attempt_id + ".log")
    os.close(os.open(artifact, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return {"attempt_id": attempt_id, "argv": argv, "env": PATH_ENV if env is None else env,
            "cwd": cwd, "run_dir": str(run_dir), "artifact_path": str(artifact),
            "quota_bytes": quota, "linger_s": linger}
