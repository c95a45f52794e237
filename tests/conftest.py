"""Fixtures every test directory shares (the helpers they stand on are in ``kit.py`` and
``qlcli.py``)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from qlcli import ok


@pytest.fixture
def workdir():
    """A fresh directory on tmpfs if available (else the system temp dir), removed afterwards."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix="qlagent-test-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def state(workdir):
    """An initialised state directory."""
    s = os.path.join(workdir, "state")
    ok(s, "init")
    return s
