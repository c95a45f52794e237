#!/bin/bash
# Edge budget soak (not CI): `qlagent serve` inside a 128 MiB / 64 PID cgroup v1
# with 4 concurrent chatty runs, a gated task, 50 cron tasks and 4 HTTP clients.
# Prints peak memory and PIDs, OOM kills, fork failures (pids.events max),
# watchdog gaps, and the ratio of the loaded peak to the idle agent's peak
# measured first in the same run (the baseline).
#
# Usage: bench/soak_edge.sh            (root; cgroup v1 memory+pids mounted rw)
# Env:   SOAK_SECONDS (300)  IDLE_SECONDS (15)  PYTHON (python3)
#        SOAK_HTTP (1) 0 runs without the HTTP surface and its 4 clients
#        SOAK_HTTP_PATH (/api/v3/projects/default/runs?limit=4) the GET the HTTP clients repeat
set -euo pipefail

SOAK_SECONDS=${SOAK_SECONDS:-300}
IDLE_SECONDS=${IDLE_SECONDS:-15}
PYTHON=${PYTHON:-python3}
HTTP=${SOAK_HTTP:-1}
HTTP_PATH=${SOAK_HTTP_PATH:-/api/v3/projects/default/runs?limit=4}
REPO=$(cd "$(dirname "$0")/.." && pwd)
NAME=qlagent-soak-$$
MEM=/sys/fs/cgroup/memory/$NAME
PIDS=/sys/fs/cgroup/pids/$NAME
WORK=$(mktemp -d /var/tmp/qlagent-soak.XXXXXX)
AGENT=""
BG=()

[ "$(id -u)" = 0 ] || { echo "soak: needs root (cgroups)" >&2; exit 77; }
if [ ! -w /sys/fs/cgroup/memory ] || [ ! -w /sys/fs/cgroup/pids ]; then echo "soak: needs cgroup v1 memory and pids mounted rw" >&2; exit 77; fi

cleanup() {
    set +e
    for p in "${BG[@]}"; do kill "$p" 2>/dev/null; done
    [ -n "$AGENT" ] && kill -TERM "$AGENT" 2>/dev/null && wait "$AGENT" 2>/dev/null
    for g in "$MEM" "$PIDS"; do
        [ -f "$g/cgroup.procs" ] && while read -r p; do kill -9 "$p" 2>/dev/null; done < "$g/cgroup.procs"
    done
    sleep 0.2
    rmdir "$MEM" "$PIDS" 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export PYTHONPATH=$REPO QLAGENT_STATE_DIR=$WORK/state QLAGENT_CONFIG=$WORK/qlagent.toml
PORT=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$WORK/qlagent.toml" <<TOML
profile = "edge"
state_dir = "$WORK/state"
drain_grace_s = 5
TOML
[ "$HTTP" = 1 ] && printf '[http]\nlisten = "127.0.0.1:%s"\n' "$PORT" >> "$WORK/qlagent.toml"
ql() { "$PYTHON" -c 'import sys; from qlagent.cli.main import main; sys.exit(main())' "$@"; }

# Task set: 50 cron tasks spread over the minute, 4 chatty (fixture chatty.sh:
# ~9.7 MB stdout + stderr progress), one gated on an interface that never exists.
cp "$(dirname "$0")/../examples/router-tasks/chatty.sh" "$WORK/chatty.sh"
chmod 0755 "$WORK/chatty.sh"
{
    for i in $(seq 0 49); do
        printf '[[task]]\nname = "cron%02d"\nschedule = ["%d * * * * *"]\ncommand = ["/bin/sh", "-c", "echo cron %d; date"]\ntimeout_s = 30\n\n' "$i" "$(( (i * 7) % 60 ))" "$i"
    done
    for i in 1 2 3 4; do
        printf '[[task]]\nname = "chatty%d"\nschedule = "0 0 1 1 *"\ncommand = ["%s"]\nconcurrency = "parallel"\ntimeout_s = 120\n\n' "$i" "$WORK/chatty.sh"
    done
    printf '[[task]]\nname = "gated"\nschedule = "0 0 1 1 *"\nnetwork = "interface:qlsoak0"\ncommand = ["/bin/true"]\ntimeout_s = 30\n'
} > "$WORK/tasks.toml"
ql init >/dev/null
ql task add -f "$WORK/tasks.toml" >/dev/null
TOKEN=$(ql token create --subject soak --role viewer)

# The budget.
mkdir -p "$MEM" "$PIDS"
echo 134217728 > "$MEM/memory.limit_in_bytes"
echo 64 > "$PIDS/pids.max"

# Watchdog listener: the agent's sd_notify datagrams, with receive times.
NOTIFY=$WORK/notify.sock
"$PYTHON" - "$NOTIFY" > "$WORK/notify.log" <<'PY' &
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
while True:
    msg = s.recv(4096).decode(errors="replace")
    print(f"{time.monotonic():.3f} {msg.replace(chr(10), ' ')}", flush=True)
PY
BG+=($!)
for _ in $(seq 50); do [ -S "$NOTIFY" ] && break; sleep 0.1; done
WATCHDOG_USEC=10000000   # pings expected every 5 s; a gap above 10 s is a missed watchdog

(
    echo "$BASHPID" > "$MEM/cgroup.procs"; echo "$BASHPID" > "$PIDS/cgroup.procs"
    exec env NOTIFY_SOCKET="$NOTIFY" WATCHDOG_USEC=$WATCHDOG_USEC WATCHDOG_PID= \
        "$PYTHON" -c 'import sys; from qlagent.cli.main import main; sys.exit(main())' serve
) > "$WORK/agent.log" 2>&1 &
AGENT=$!
for _ in $(seq 100); do grep -q 'READY=1' "$WORK/notify.log" && break; sleep 0.1; done
grep -q 'READY=1' "$WORK/notify.log" || { echo "soak: agent never sent READY=1"; tail -20 "$WORK/agent.log"; exit 1; }

sleep "$IDLE_SECONDS"
IDLE_PEAK=$(cat "$MEM/memory.max_usage_in_bytes")
IDLE_PIDS=$(cat "$PIDS/pids.current")
echo 0 > "$MEM/memory.max_usage_in_bytes"   # reset the high-water mark for the loaded phase
echo "soak: idle agent peak $((IDLE_PEAK / 1048576)) MiB, $IDLE_PIDS PIDs; loading for $SOAK_SECONDS s"

END=$(( $(date +%s) + SOAK_SECONDS ))
for i in 1 2 3 4; do   # 4 chatty runs kept in flight
    ( while [ "$(date +%s)" -lt "$END" ]; do ql run start "chatty$i" --wait --timeout 150 >/dev/null 2>&1 || sleep 1; done ) &
    BG+=($!)
done
ql run start gated >/dev/null
[ "$HTTP" = 1 ] || echo "HTTP off (SOAK_HTTP=0)" > "$WORK/http.log"
[ "$HTTP" = 1 ] && "$PYTHON" - "$PORT" "$HTTP_PATH" "$TOKEN" "$END" > "$WORK/http.log" <<'PY' &
import http.client, sys, threading, time, collections
port, path, token, end = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
counts = collections.Counter()
def client():
    while time.time() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", path, headers={"Authorization": f"Bearer {token}"})
            counts[c.getresponse().status] += 1
            c.close()
        except OSError as e:
            counts[type(e).__name__] += 1
            time.sleep(0.2)
threads = [threading.Thread(target=client) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(dict(counts))
PY
BG+=($!)

PEAK_PIDS=0
while [ "$(date +%s)" -lt "$END" ]; do
    kill -0 "$AGENT" 2>/dev/null || { echo "soak: agent died"; break; }
    p=$(cat "$PIDS/pids.current"); [ "$p" -gt "$PEAK_PIDS" ] && PEAK_PIDS=$p
    sleep 0.5
done
wait "${BG[@]:1}" 2>/dev/null || true

PEAK_MEM=$(cat "$MEM/memory.max_usage_in_bytes")
OOM_KILLS=$(awk '$1=="oom_kill"{print $2}' "$MEM/memory.oom_control"); OOM_KILLS=${OOM_KILLS:-0}
FAILCNT=$(cat "$MEM/memory.failcnt")
FORK_FAIL=$(awk '$1=="max"{print $2}' "$PIDS/pids.events")
MAX_GAP=$(awk '/WATCHDOG=1/ { if (last) { g = $1 - last; if (g > m) m = g } last = $1 } END { printf "%.1f", m }' "$WORK/notify.log")
PINGS=$(grep -c 'WATCHDOG=1' "$WORK/notify.log" || true)
MISSED=0
awk -v g="$MAX_GAP" -v lim="$((WATCHDOG_USEC / 1000000))" 'BEGIN{ exit !(g > lim) }' && MISSED=1
# The newest 200 Runs (the CLI's page limit) by state.
RUNS=$(ql run ls --json --limit 200 | "$PYTHON" -c 'import json,sys,collections; print(dict(collections.Counter(r["state"] for r in json.load(sys.stdin)["items"])))' || echo "n/a")

echo "soak: ${SOAK_SECONDS}s edge budget (128 MiB / 64 PIDs)"
echo "  peak memory        $((PEAK_MEM / 1048576)) MiB ($PEAK_MEM bytes); idle baseline $((IDLE_PEAK / 1048576)) MiB; ratio $(awk -v a="$PEAK_MEM" -v b="$IDLE_PEAK" 'BEGIN{printf "%.2f", a/b}')"
echo "  peak PIDs          $PEAK_PIDS (idle $IDLE_PIDS)"
echo "  OOM kills          $OOM_KILLS (memory.failcnt $FAILCNT)"
echo "  fork failures      $FORK_FAIL (pids.events max)"
echo "  watchdog           $PINGS pings, max gap ${MAX_GAP}s (limit $((WATCHDOG_USEC / 1000000))s), missed: $MISSED"
echo "  HTTP responses     $(cat "$WORK/http.log")"
echo "  runs by state      $RUNS"
