"""Fixtures every test directory shares (the helpers they stand on are in ``kit.py`` and
``qlcli.py``)."""

from __future__ import annotations

import os
import shutil

import pytest
from qlcli import ok
from kit import scratch_dir


@pytest.fixture
def workdir():
    """A fresh directory on tmpfs if available (else the system temp dir), removed afterwards."""
    d = scratch_dir("qlagent-test-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def state(workdir):
    """An initialised state directory."""
    s = os.path.join(workdir, "state")
    ok(s, "init")
    return s
