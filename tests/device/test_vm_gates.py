"""Issue 22 gates in an arm64 router VM (Debian 13, systemd 257, cgroup v2, the project's .deb
installed by apt), short forms. The long forms: tests/device/vmkit.py (README, bench/README.md).

One boot runs the seed (edge then standalone), memory-hog, PID 1 and full-flash gates in turn;
the power-cut gate is its own series of boots (3 cuts + a last checking boot) in a second VM
at the same time. Each test
asserts the guest's checks for its gate (tests/device/guest/gate.py names them) and prints the
figures it measured."""

from __future__ import annotations

import json
import sys
import threading

import pytest

import vmkit

pytestmark = [pytest.mark.slow, pytest.mark.vm]

MODES = ["seed", "hog", "pid1", "flash"]


@pytest.fixture(scope="module")
def power_cuts(vm_image):
    """The power-cut series runs in its own VM beside the router boot: both guests spend much
    of their time waiting (schedules, drains, boots), so together they take little more
    wall time than the longer one alone."""
    box: dict = {}

    def series():
        try:
            box["series"] = vmkit.powercut_series(vm_image, cuts=3,
                                                  log=lambda s: print(s, file=sys.stderr, flush=True))
        except Exception as e:  # noqa: BLE001 — reported by the test
            box["error"] = repr(e)

    th = threading.Thread(target=series, daemon=True)
    th.start()
    yield th, box
    th.join()
    if "series" in box:
        box["series"]["vm"].cleanup()


@pytest.fixture(scope="module")
def router_boot(vm_image, power_cuts):
    results, rec, vm = vmkit.run_modes(vm_image, MODES)
    yield {"results": results, "boot": rec, "console": vm.console_tail(6000)}
    vm.cleanup()


def _gate(router_boot, mode: str, prefix: str | None = None) -> dict:
    res = router_boot["results"].get(mode)
    assert res is not None, (f"the guest wrote no result for {mode}; boot {router_boot['boot']}; console:\n"
                             + router_boot["console"])
    print(json.dumps({"boot": router_boot["boot"], "guest": res.get("guest"), "figures": res["figures"]},
                     indent=1, default=str), file=sys.stderr)
    mine = {k: v for k, v in res["checks"].items() if prefix is None or k.startswith(prefix)}
    assert mine, f"no checks for {prefix or mode}: {res['checks']}"
    failed = {k: v["detail"] for k, v in mine.items() if not v["ok"]}
    assert not failed, json.dumps(failed, indent=1, default=str)
    return res


def test_guest_is_the_router(router_boot):
    res = router_boot["results"]["seed"]
    assert res is not None, router_boot["console"]
    g = res["guest"]
    assert g["machine"] == "aarch64" and g["cgroup"] == "cgroup2fs", g
    assert "systemd 257" in g["systemd"], g
    assert g["service_at_boot"]["ActiveState"] == "active", g


def test_seed_edge(router_boot):
    _gate(router_boot, "seed", "seed.edge.")


def test_seed_standalone(router_boot):
    _gate(router_boot, "seed", "seed.standalone.")


def test_memory_hog(router_boot):
    _gate(router_boot, "hog")


def test_pid1(router_boot):
    _gate(router_boot, "pid1")


def test_full_flash(router_boot):
    _gate(router_boot, "flash")


def test_power_cut(power_cuts):
    th, box = power_cuts
    th.join()
    assert "error" not in box, box.get("error")
    summary = vmkit.summarize_powercut(box["series"])
    print(json.dumps(summary, indent=1, default=str), file=sys.stderr)
    assert summary["error"] is None, summary["error"]
    assert summary["cuts"] >= 3, summary
    assert summary["survived"] == summary["cuts"], summary
    assert not summary["failed"], json.dumps(summary["failed"], indent=1, default=str)
