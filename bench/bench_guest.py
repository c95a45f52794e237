"""The issue 24 benches in the router VM's arm64 guest (§4, a slow CPU): Debian 13, cgroup v2, the
.deb installed by apt, qemu-system-aarch64 under TCG (tests/device/vmkit.py), all figures of one
boot, each beside its baseline measured in the same rounds inside the guest:

- dispatch → task exec through the installed package's fork server (bench_forkserver.latency:
  ``processes.ForkServer`` of /usr/lib/python3/dist-packages, shim → ``date +%s%N``) against a
  bare ``os.posix_spawn`` of the same program, and the interpreter-per-run path;
- the fork server's idle USS and a fork-served Run's extra PIDs and USS while it drains ``yes``
  past the 4 MiB edge quota (bench_forkserver.overhead);
- the drainer's throughput against ``cat`` through the same FIFO (bench_drainer.throughput,
  ``--mib`` of output; 0 skips it);
- ``qlagent --version``, ``--help``, ``run ls`` (1,000 Runs), ``task ls`` (50 Tasks) of
  ``/usr/bin/qlagent`` with the package's config file, each beside a bare script doing its own
  work, against ``python3 -I -S -c pass`` (bench_cli.measure, InstalledForm; the guest has no
  GNU time, peak RSS is wait4's), and ``serve`` → READY=1 on the edge Profile over 50 cron Tasks.

The guest side (``in_guest``) runs as root from tests/device/guest/gate.py's ``bench`` mode with
qlagent.service stopped; its figures and the printed tables go to result-bench.json on the
control disk. It is a bench, not a gate: nothing here is asserted, and the test suite never
boots it.

    python3 bench/bench_guest.py [--rounds 5] [--fs-rounds 15] [--mib 16] [--out FILE.json]

(root; builds or reuses the image, as ``vmkit.py image`` does; a boot takes minutes.)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# What the control disk carries besides gate.py: these benches and the helper they import.
CTL_FILES = ["bench/bench_guest.py", "bench/bench_forkserver.py", "bench/bench_drainer.py", "bench/bench_cli.py",
             "tests/shimkit.py"]
MiB = 1024 * 1024


class _Tee(io.StringIO):
    """What the benches print: kept for the result and shown on the way (the guest's gate.log)."""

    def write(self, s: str) -> int:
        sys.__stdout__.write(s)
        return super().write(s)


def in_guest(rounds: int, fs_rounds: int, mib: int) -> dict:
    """In the guest: every figure of the module docstring. Returns {"load": [start, end] 1-min
    load averages, "qlagent": the imported package's file and version, "forkserver_latency":
    bench_forkserver.latency's dict (ms), "forkserver_overhead": its rows (PIDs, USS and
    Private_Dirty bytes), "drainer_s": {path: median seconds} ({} when ``mib`` is 0), "cli":
    bench_cli.report's figures (ms, × pass), "report": the printed tables}."""
    sys.path[:0] = [HERE]
    import bench_cli
    import bench_drainer
    import bench_forkserver
    import qlagent
    out: dict = {"load": [os.getloadavg()[0]], "python": sys.version.split()[0],
                 "qlagent": {"file": qlagent.__file__, "version": qlagent.__version__},
                 "rounds": rounds, "fs_rounds": fs_rounds, "mib": mib}
    tmp = tempfile.mkdtemp(prefix="qlbench-guest-", dir="/var/tmp")   # /tmp is RAM (256 MiB) here
    buf = _Tee()
    try:
        with contextlib.redirect_stdout(buf):
            fs = bench_forkserver.fork_server(tmp)
            arms = {"installed": fs}
            out["forkserver_latency"] = bench_forkserver.latency(tmp, fs_rounds, arms)
            out["forkserver_overhead"] = bench_forkserver.overhead(tmp, arms)
            out["drainer_s"] = (bench_drainer.throughput(tmp, mib, 3, shims=[("fork-served shim",
                                                                              bench_forkserver.forked(fs))])
                                if mib else {})
            form = bench_cli.InstalledForm(tmp)
            res = bench_cli.measure(form, ["installed"], rounds, True)
            out["cli"] = bench_cli.report(form, ["installed"], res)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["load"].append(os.getloadavg()[0])
    out["report"] = buf.getvalue()
    return out


def headline(b: dict) -> list[str]:
    """The lines bench/README.md takes from one boot's figures."""
    lat = b["forkserver_latency"]["median_ms"]
    base = lat["posix_spawn"]
    fs_key = next(k for k in lat if k.startswith("installed: fork server"))
    interp = next(k for k in lat if k.startswith("interpreter per run"))
    rows = {r[0]: r for r in b["forkserver_overhead"]}
    per_run = next(r for k, r in rows.items() if k.endswith("fork-served shim"))
    idle = next(r for k, r in rows.items() if "the fork server itself" in k)
    cli = b["cli"]

    def cmd(label: str) -> str:
        f = cli[label]["installed"]
        return (f"{label} {f['ms'][0]:.0f} ms, {f['x_pass'][0]:.2f}× pass, overhead "
                f"{f['overhead'][0]:.2f} / {f['overhead'][1]:.2f}×")

    lines = [f"guest load {b['load'][0]:.1f} → {b['load'][1]:.1f}; python {b['python']}; qlagent "
             f"{b['qlagent']['version']} from {b['qlagent']['file']}; n = {b['rounds']} (CLI, serve), "
             f"{b['fs_rounds']} (fork server)",
             f"dispatch → task exec: fork server {lat[fs_key]:.1f} ms = {lat[fs_key] / base:.1f}× a bare posix_spawn "
             f"({base:.1f} ms); interpreter per run {lat[interp]:.1f} ms = {lat[interp] / base:.1f}×",
             f"fork server idle USS {idle[2] / MiB:.2f} MiB; per run {per_run[1]} extra PID(s), "
             f"USS {per_run[2] / MiB:.2f} MiB",
             f"python3 -I -S -c pass {cli['pass_ms'][0]:.0f} / {cli['pass_ms'][1]:.0f} ms (median / least)"]
    lines += [cmd(label) for label in cli if label.startswith(("--version", "--help", "run ls", "task ls"))
              and "argparse" not in label]
    s = cli["serve → READY"]["installed"]
    lines.append(f"serve → READY (edge, 50 cron Tasks) {s['ms'][0]:.0f} / {s['ms'][1]:.0f} ms = "
                 f"{s['x_pass'][0]:.2f} / {s['x_pass'][1]:.2f}× pass, VmRSS at READY {s['rss_kib']} KiB")
    d = b["drainer_s"]
    if d:
        cat = d["cat through a FIFO to a file (baseline)"]
        for k, v in d.items():
            if k.endswith("drain only"):
                lines.append(f"drainer {k}: {cat / v:.2f}× cat's throughput ({b['mib'] / v:.0f} MiB/s, "
                             f"cat {b['mib'] / cat:.0f})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the CLI and serve arms (TCG: ~1 s each)")
    ap.add_argument("--fs-rounds", type=int, default=15, help="dispatch → exec samples per path")
    ap.add_argument("--mib", type=int, default=16, help="MiB through the drainer (0: skip)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds the boot may take")
    ap.add_argument("--out", help="write the boot record and the guest's result here (JSON)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(REPO, "tests", "device"))
    import vmkit
    image, took = vmkit.build_image()
    host_load = [os.getloadavg()[0]]
    print(f"image {image} ({took:.0f} s); host load {host_load[0]:.1f}", file=sys.stderr, flush=True)
    vm = vmkit.Vm(image)
    try:
        files = {name: open(os.path.join(REPO, name), "rb").read() for name in CTL_FILES}
        files["bench-args.json"] = json.dumps({"rounds": a.rounds, "fs_rounds": a.fs_rounds, "mib": a.mib}).encode()
        vm.make_ctl(["bench"], files)
        t = time.monotonic()
        rec = vm.boot(timeout=a.timeout)
        host_load.append(os.getloadavg()[0])
        res = vm.result("bench")
        b = (res or {}).get("figures", {}).get("bench")
        if not b:
            print(f"the guest wrote no bench figures; checks: {json.dumps((res or {}).get('checks'))[:3000]}\n"
                  f"console tail:\n{vm.console_tail()}", file=sys.stderr)
            return 1
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host_load": host_load,
               "boot": rec, "wall_s": round(time.monotonic() - t, 1), "guest": res.get("guest"), "bench": b}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1, default=str)
        print(b["report"])
        g = res.get("guest") or {}
        print(f"\n## {out['date']}, host load {host_load[0]:.1f} → {host_load[1]:.1f}, boot {rec['boot_s']} s, "
              f"whole {rec['total_s']} s; guest {g.get('machine')} {g.get('uname')}, {g.get('cgroup')}, "
              f"MemTotal {g.get('memtotal_kib')} KiB, {g.get('nproc')} CPUs")
        settled = res["figures"].get("bench.settled", {})
        print(f"- the guest settled for {settled.get('waited_s')} s first (idle {settled.get('idle_share')}, "
              f"load {settled.get('load')})")
        for line in headline(b):
            print(f"- {line}")
        return 0
    finally:
        vm.cleanup()


if __name__ == "__main__":
    sys.exit(main())
