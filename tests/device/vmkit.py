"""Host side of the router VM gates (issue 22).

The image: packaging/vm/build-image (a cached base layer keyed by the builder's hash, and a
package layer per .deb hash, under $QLAGENT_VM_CACHE, default /var/cache/qlagent-vm).
A boot: qemu-system-aarch64 -M virt -cpu cortex-a53 (TCG), 256 MiB, 2 vCPUs, user networking with
restrict=on (nothing leaves the machine). Disks (virtio-blk-pci, in this order):
  vda  the root: a qcow2 overlay on the cached image (one per gate series, thrown away after)
  vdb  the control disk: an ext4 made here holding `run`, gate.py, the router task set and the
       modes; the guest's qlvm-boot.service runs it after qlagent.service and writes
       result-<mode>.json to it, then powers off
  vdc… extra disks a gate asks for (the full-flash gate's squashfs and small ext4)
The console (ttyAMA0) goes to console.log. A power cut is SIGKILL of qemu; the next boot
of the same root disk shows what survived. Results are read back with e2fsck (journal replay
after a cut) and debugfs, so no loop device is needed.

Command line (the long forms, results into bench/results/vm-gates.md):
  python3 tests/device/vmkit.py image                    build/refresh the image, print its dir
  python3 tests/device/vmkit.py powercut --cuts 30       the long power-cut series
  python3 tests/device/vmkit.py boot MODE…               one boot running the modes (seed, hog, pid1, flash)
The benches' figures in the guest (no gate): python3 bench/bench_guest.py, which boots the
`bench` mode with the bench modules on the control disk (`make_ctl`'s files may name subdirectories).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUEST = Path(__file__).resolve().parent / "guest"
CACHE = Path(os.environ.get("QLAGENT_VM_CACHE", "/var/cache/qlagent-vm"))
QEMU = "qemu-system-aarch64"

RUN_SCRIPT = """#!/bin/sh
# Written by tests/device/vmkit.py: the guest runs this from its control disk.
cd /mnt/ctl || exit 1
exec python3 /mnt/ctl/gate.py $(cat /mnt/ctl/modes) >> /mnt/ctl/gate.log 2>&1
"""


class VmError(RuntimeError):
    pass


def build_image(log=sys.stderr) -> tuple[Path, float]:
    """The image's directory (vmlinuz, initrd, root.ext4) and the seconds it took."""
    t = time.monotonic()
    deb = subprocess.run([str(REPO / "packaging" / "build-deb")], capture_output=True, text=True)
    if deb.returncode != 0:
        raise VmError(f"packaging/build-deb failed: {deb.stderr[-2000:]}")
    p = subprocess.run([str(REPO / "packaging" / "vm" / "build-image"), deb.stdout.strip()],
                       stdout=subprocess.PIPE, stderr=log, text=True)
    if p.returncode != 0:
        raise VmError("packaging/vm/build-image failed (its last lines are above)")
    return Path(p.stdout.strip().splitlines()[-1]), time.monotonic() - t


class Vm:
    """One gate series: a root overlay that persists across this object's boots."""

    def __init__(self, image: Path, workdir: Path | None = None, mem_mib: int = 256, cpus: int = 2):
        self.image = image
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="qlvm-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mem, self.cpus = mem_mib, cpus
        self.root = self.dir / "root.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b",
                        str(image / "root.ext4"), str(self.root)], check=True)
        self.ctl = self.dir / "ctl.ext4"
        self.boots: list[dict] = []

    # -- control disk
    def make_ctl(self, modes: list[str], files: dict[str, bytes] | None = None, size_mib: int = 64) -> None:
        d = self.dir / "ctl"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        (d / "run").write_text(RUN_SCRIPT)
        (d / "run").chmod(0o755)
        shutil.copy(GUEST / "gate.py", d / "gate.py")
        shutil.copy(REPO / "examples" / "router-tasks.toml", d / "router-tasks.toml")
        (d / "modes").write_text(" ".join(modes) + "\n")
        for name, data in (files or {}).items():
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)
        self.ctl.unlink(missing_ok=True)
        subprocess.run(["mke2fs", "-q", "-t", "ext4", "-L", "qlctl", "-d", str(d), str(self.ctl), f"{size_mib}M"],
                       check=True)

    def ctl_write(self, name: str, data: bytes) -> None:
        """Put one file on the existing control disk (between boots)."""
        self._fsck()
        src = self.dir / f".w-{name}"
        src.write_bytes(data)
        subprocess.run(["debugfs", "-w", "-R", f"rm /{name}", str(self.ctl)], capture_output=True)
        subprocess.run(["debugfs", "-w", "-R", f"write {src} /{name}", str(self.ctl)], capture_output=True, check=True)

    def _fsck(self) -> None:
        # After a cut the guest's ext4 journal may need replaying; -p replays and fixes safely.
        subprocess.run(["e2fsck", "-fy", str(self.ctl)], capture_output=True)

    def ctl_read(self, name: str) -> bytes | None:
        self._fsck()
        p = subprocess.run(["debugfs", "-R", f"cat /{name}", str(self.ctl)], capture_output=True)
        if p.returncode != 0 or b"File not found" in p.stderr:
            return None
        return p.stdout

    def result(self, mode: str) -> dict | None:
        raw = self.ctl_read(f"result-{mode}.json")
        return json.loads(raw) if raw else None

    # -- a boot
    def boot(self, *, extra_disks: list[tuple[Path, str]] = (), timeout: float = 1500,
             cut_after: str | None = None, cut_delay: tuple[float, float] = (1.0, 12.0),
             append: str = "") -> dict:
        """Boot until the guest powers off (or SIGKILL `cut_delay` seconds after the console
        shows `cut_after`). Returns {"boot_s", "total_s", "cut", "cut_at_s", "console"}."""
        console = self.dir / f"console-{len(self.boots)}.log"
        drives = [(self.root, "qcow2"), (self.ctl, "raw")] + [(Path(p), f) for p, f in extra_disks]
        cmd = [QEMU, "-M", "virt", "-cpu", "cortex-a53", "-smp", str(self.cpus), "-m", str(self.mem),
               "-accel", "tcg", "-display", "none", "-monitor", "none", "-no-reboot",
               "-serial", f"file:{console}",
               "-kernel", str(self.image / "vmlinuz"), "-initrd", str(self.image / "initrd"),
               "-append", f"console=ttyAMA0 root=/dev/vda rw panic=-1 systemd.show_status=0 {append}".strip(),
               "-netdev", "user,id=n0,restrict=on", "-device", "virtio-net-pci,netdev=n0,romfile="]
        for i, (path, fmt) in enumerate(drives):
            cmd += ["-drive", f"file={path},format={fmt},if=none,id=d{i},cache=none,aio=threads",
                    "-device", f"virtio-blk-pci,drive=d{i}"]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=open(self.dir / "qemu.err", "a"))
        boot_s = cut_at = None
        cut = False
        deadline = t0 + timeout
        try:
            while proc.poll() is None:
                text = console.read_text(errors="replace") if console.exists() else ""
                if boot_s is None and "qlvm: control disk mounted" in text:
                    boot_s = time.monotonic() - t0
                if cut_after and cut_at is None and cut_after in text:
                    cut_at = time.monotonic() + random.uniform(*cut_delay)
                if cut_at is not None and time.monotonic() >= cut_at:
                    proc.send_signal(signal.SIGKILL)  # the power cut
                    proc.wait()
                    cut = True
                    break
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise VmError(f"guest did not power off within {timeout:.0f} s; console tail:\n"
                                  + text[-3000:])
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rec = {"boot_s": None if boot_s is None else round(boot_s, 1), "total_s": round(time.monotonic() - t0, 1),
               "cut": cut, "rc": proc.returncode, "console": str(console),
               "cut_after_load_s": None if not cut else round(time.monotonic() - t0 - (boot_s or 0), 1)}
        self.boots.append(rec)
        return rec

    def console_tail(self, n: int = 4000) -> str:
        if not self.boots:
            return ""
        return Path(self.boots[-1]["console"]).read_text(errors="replace")[-n:]

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def flash_disks(workdir: Path) -> list[tuple[Path, str]]:
    """OpenWrt-like flash: a squashfs lower (read-only, a few files) and a 64 MiB ext4 upper."""
    lower = workdir / "lower"
    shutil.rmtree(lower, ignore_errors=True)
    lower.mkdir()
    (lower / "README").write_text("read-only lower layer (like OpenWrt's /rom)\n")
    sq = workdir / "rom.squashfs"
    sq.unlink(missing_ok=True)
    subprocess.run(["mksquashfs", str(lower), str(sq), "-quiet", "-noappend", "-all-root"], check=True,
                   capture_output=True)
    # squashfs images are not a multiple of 512: pad for the block device.
    with open(sq, "ab") as f:
        f.truncate(((sq.stat().st_size + 4095) // 4096) * 4096)
    up = workdir / "overlay.ext4"
    up.unlink(missing_ok=True)
    subprocess.run(["mke2fs", "-q", "-t", "ext4", "-L", "qloverlay", str(up), "64M"], check=True)
    return [(sq, "raw"), (up, "raw")]


def run_modes(image: Path, modes: list[str], timeout: float = 2400) -> tuple[dict, dict, Vm]:
    """One boot running `modes`; returns ({mode: result}, boot record, vm)."""
    vm = Vm(image)
    vm.make_ctl(modes)
    extra = flash_disks(vm.dir) if "flash" in modes else []
    rec = vm.boot(extra_disks=extra, timeout=timeout)
    results = {m: vm.result(m) for m in modes}
    return results, rec, vm


def powercut_series(image: Path, cuts: int, log=print) -> dict:
    """`cuts` power cuts during load, then a last boot that only checks."""
    vm = Vm(image)
    vm.make_ctl(["powercut"])
    boots, results = [], []
    error = None
    try:
        for i in range(cuts + 1):
            last = i == cuts
            if last:
                vm.ctl_write("powercut-last", b"1\n")
            rec = vm.boot(cut_after=None if last else "LOAD RUNNING", timeout=900)
            res = vm.result("powercut")
            boots.append(rec)
            results.append(res)
            failed = sorted(k for k, v in (res or {}).get("checks", {}).items() if not v["ok"])
            log(f"powercut boot {i}: boot {rec['boot_s']} s, total {rec['total_s']} s, cut={rec['cut']}, "
                f"failed={failed}")
            if res is None or (not rec["cut"] and not last):
                raise VmError(f"boot {i} gave no result or powered off by itself; console tail:\n"
                              + vm.console_tail())
    except VmError as e:
        error = str(e)[-3000:]
        log(f"powercut series stopped: {error}")
    return {"boots": boots, "results": results, "vm": vm, "error": error}


def summarize_powercut(series: dict) -> dict:
    res = [r for r in series["results"] if r]
    failed: dict[str, object] = {}
    for r in res:
        for k, v in r["checks"].items():
            if not v["ok"]:
                failed[f"{k}@boot{r.get('boot')}"] = v["detail"]
    per_boot = [b for r in res for b in r["figures"].get("powercut.boots", [])[-1:]]
    cuts = sum(1 for b in series["boots"] if b["cut"])
    return {"cuts": cuts, "survived": sum(1 for r in res[1:] if r["checks"].get("powercut.service_up_by_itself", {}).get("ok")),
            "acked": per_boot[-1]["acked"] if per_boot else 0,
            "lost_max": max((b["lost"] for b in per_boot), default=0),
            "double_max": max((b["double"] for b in per_boot), default=0),
            "failed": failed, "per_boot": per_boot, "error": series.get("error"),
            "boot_s": [b["boot_s"] for b in series["boots"]]}


def _mib(v) -> str:
    return "—" if v is None else f"{v / 1048576:.1f} MiB"


def render_md(meta: dict, boot: dict | None, results: dict | None, pc: dict | None) -> str:
    """bench/results/vm-gates.md from one `all` run."""
    out = ["# Router VM gates (issue 22) — figures from the arm64 guest", "",
           "Written by `tests/device/vmkit.py` (`all` runs every gate; `report` renders saved runs). Guest: "
           + meta.get("guest", "?") + ".", ""]
    for k, v in meta.items():
        if k != "guest":
            out.append(f"- {k}: {v}")
    if boot:
        out += ["", f"- boot (qemu start → gate driver running): {boot.get('boot_s')} s; whole boot with the "
                f"gates: {boot.get('total_s')} s"]
    if results:
        seed = (results.get("seed") or {}).get("figures", {})
        out += ["", "## Seed gate, per profile", "",
                "| profile | ready | memory.peak (service) | pids.peak | agent RSS idle | agent RSS peak (sampled) | VmHWM | stop |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for prof in ("edge", "standalone"):
            f = {k.split(".", 2)[2]: v for k, v in seed.items() if k.startswith(f"seed.{prof}.")}
            out.append(f"| {prof} | {f.get('ready_s')} s | {_mib(f.get('memory.peak'))} | {f.get('pids.peak')} | "
                       f"{_mib(f.get('rss_idle'))} | {_mib(f.get('rss_peak_sampled'))} | {_mib(f.get('vmhwm'))} | "
                       f"{f.get('stop_s')} s |")
        for mode, res in results.items():
            out += ["", f"## {mode}: checks", ""]
            if not res:
                out.append("no result (the guest wrote none)")
                continue
            for name, c in res["checks"].items():
                d = json.dumps(c["detail"], default=str)
                out.append(f"- {'PASS' if c['ok'] else 'FAIL'} `{name}` {d[:300]}")
            figs = {k: v for k, v in res["figures"].items() if not k.startswith("seed.")}
            if figs:
                out += ["", "figures: `" + json.dumps(figs, default=str)[:1500] + "`"]
    if pc:
        out += ["", "## Power cut", "",
                f"- cuts: {pc['cuts']}, service back by itself after {pc['survived']} of them",
                f"- acknowledged Task Starts (202s the client logged): {pc['acked']}; lost (most at any boot): {pc['lost_max']}",
                f"- Runs executed twice (the task's fsynced marks): {pc['double_max']}",
                f"- boot times: {pc['boot_s']}",
                f"- failed checks: `{json.dumps(pc['failed'], default=str)[:2000]}`"]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="vmkit")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("image")
    pc = sub.add_parser("powercut")
    pc.add_argument("--cuts", type=int, default=30)
    pc.add_argument("--out", default=str(REPO / "bench" / "results" / "vm-powercut-long.json"))
    al = sub.add_parser("all")
    al.add_argument("--cuts", type=int, default=30)
    al.add_argument("--md", default=str(REPO / "bench" / "results" / "vm-gates.md"))
    al.add_argument("--merged", default="", help="what the tree holds (e.g. 'main + w22cg@abc'), for the record")
    rp = sub.add_parser("report", help="vm-gates.md from a `boot --out` JSON and a `powercut --out` JSON")
    rp.add_argument("--router")
    rp.add_argument("--powercut")
    rp.add_argument("--md", default=str(REPO / "bench" / "results" / "vm-gates.md"))
    rp.add_argument("--merged", default="")
    bt = sub.add_parser("boot")
    bt.add_argument("modes", nargs="+")
    bt.add_argument("--out")
    a = ap.parse_args(argv)
    if a.cmd == "report":
        r = json.loads(Path(a.router).read_text()) if a.router else {}
        pc = json.loads(Path(a.powercut).read_text()) if a.powercut else None
        results = r.get("results")
        g = ((results or {}).get("seed") or {}).get("guest", {})
        meta = {"tree": a.merged or "?", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "guest": f"{g.get('machine')} {g.get('uname')}, {g.get('systemd')}, {g.get('cgroup')}, "
                         f"MemTotal {g.get('memtotal_kib')} KiB, {g.get('nproc')} CPUs"}
        Path(a.md).write_text(render_md(meta, r.get("boot"), results, pc))
        return 0
    image, took = build_image()
    print(f"image {image} ({took:.0f} s)", file=sys.stderr)
    if a.cmd == "image":
        print(image)
        return 0
    if a.cmd == "boot":
        results, rec, vm = run_modes(image, a.modes)
        out = {"boot": rec, "results": results}
        print(json.dumps(out, indent=1, default=str))
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1, default=str))
        ok = all(r and all(v["ok"] for v in r["checks"].values()) for r in results.values())
        vm.cleanup()
        return 0 if ok else 1
    if a.cmd == "all":
        meta = {"image (this run)": f"{took:.0f} s", "tree": a.merged or "?",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        results, rec, vm = run_modes(image, ["seed", "hog", "pid1", "flash"])
        vm.cleanup()
        g = (results.get("seed") or {}).get("guest", {})
        meta["guest"] = f"{g.get('machine')} {g.get('uname')}, {g.get('systemd')}, {g.get('cgroup')}, " \
                        f"MemTotal {g.get('memtotal_kib')} KiB, {g.get('nproc')} CPUs"
        Path(a.md).write_text(render_md(meta, rec, results, None))
        series = powercut_series(image, a.cuts, log=lambda s: print(s, file=sys.stderr, flush=True))
        pc = summarize_powercut(series)
        series["vm"].cleanup()
        Path(a.md).write_text(render_md(meta, rec, results, pc))
        print(Path(a.md).read_text())
        return 0
    series = powercut_series(image, a.cuts, log=lambda s: print(s, file=sys.stderr, flush=True))
    summary = summarize_powercut(series)
    series["vm"].cleanup()
    Path(a.out).write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_boot"}, indent=1, default=str))
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
