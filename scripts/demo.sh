#!/usr/bin/env bash
# make demo: the real daemon on one simulated GPU (no GPU, no root needed), driven by the real CLI.
# An online service and two training jobs are submitted; status is shown while an online burst
# arrives and the controller throttles, then releases, the offline jobs; the simulated service
# tells the daemon when each request starts and ends (as gpushare.client.request_started/ended
# would), so status shows the GPU's request gate (REQUESTS: open/closed/off) and the requests IN
# FLIGHT, and the jobs, launched with --queue auto, run shallow queues while gating is on;
# everything is stopped and
# the simulator's summary table for the same scenario (the shipped scenario `demo`, gpushare/scenarios/demo.toml) is printed,
# then the same at a tight SLO (`demo-tight`, 1.1x the service's p99 alone), where gpushare keeps
# the SLO and MPS with priority does not. The status snapshots show the throttling as it happens:
# OFFLINE (open, duty, closed), each job's THAWED share of the last minute and its state.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=demo-run
RUN=$(mktemp -d /tmp/gsdemo-XXXXXX)   # Unix socket paths must stay short
rm -rf "$OUT"; mkdir -p "$OUT"
export GPUSHARE_SOCKET="$RUN/gpushare.sock"
# The real MPS control daemon runs for the simulated GPU when the binary is installed or was
# fetched into .cache/mps (make demo tries); without it the daemon simulates MPS as well.
MPS_CONTROL=$(command -v nvidia-cuda-mps-control || true)
CACHED_MPS="$PWD/.cache/mps/root/usr/bin/nvidia-cuda-mps-control"
[[ -z "$MPS_CONTROL" && -x "$CACHED_MPS" ]] && MPS_CONTROL=$CACHED_MPS
cat > "$OUT/gpushare.toml" <<TOML
version = 1
[paths]
runtime_dir = "$RUN"
state_dir = "$PWD/$OUT/state"
[daemon]
admin_group = ""
cancel_grace = "2s"
[metrics]
enabled = false
[latency]
window = "5s"
[mps]
control_binary = "${MPS_CONTROL:-nvidia-cuda-mps-control}"
TOML

# As root on a host without systemd delegation the daemon puts client cgroups under
# <cgroup2 mount>/gpushare; remove what this demo created (rmdir only removes empty ones).
CG_MOUNT=$(awk '$3 == "cgroup2" {print $2; exit}' /proc/self/mounts)
CG_BASE=${CG_MOUNT:+$CG_MOUNT/gpushare}
CG_EXISTED=0; [[ -n "$CG_BASE" && -d "$CG_BASE" ]] && CG_EXISTED=1

DAEMON_PID=""
IDS=()
cleanup() {
    for id in "${IDS[@]}"; do "$BIN/gpushare" cancel "$id" >/dev/null 2>&1 || true; done
    if [[ -n "$DAEMON_PID" ]] && kill -0 "$DAEMON_PID" 2>/dev/null; then
        kill -TERM "$DAEMON_PID"
        for _ in $(seq 50); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 0.2; done
        if kill -0 "$DAEMON_PID" 2>/dev/null; then
            kill -KILL "$DAEMON_PID" 2>/dev/null || true
            # It could not stop its MPS control daemons itself: quit them here.
            for pipe in "$RUN"/mps/*/; do
                [[ -n "$MPS_CONTROL" && -S "$pipe/control" ]] || continue
                echo quit | CUDA_MPS_PIPE_DIRECTORY="$pipe" "$MPS_CONTROL" >/dev/null 2>&1 || true
            done
        fi
    fi
    rm -rf "$RUN"
    if [[ -n "$CG_BASE" && $CG_EXISTED == 0 && -d "$CG_BASE" ]]; then
        find "$CG_BASE" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    fi
}
trap cleanup EXIT

echo "== starting: gpushare daemon --simulate 1 (log: $OUT/daemon.log)"
"$BIN/gpushare" daemon --simulate 1 --config "$OUT/gpushare.toml" >"$OUT/daemon.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 100); do [[ -S "$GPUSHARE_SOCKET" ]] && break; sleep 0.1; done
[[ -S "$GPUSHARE_SOCKET" ]] || { echo "daemon did not start:"; tail -20 "$OUT/daemon.log"; exit 1; }
if grep -q '"mps": "real"' "$OUT/daemon.log"; then
    echo "== MPS: the real control daemon ($MPS_CONTROL), one per simulated GPU"
else
    echo "== MPS: simulated (no nvidia-cuda-mps-control; scripts/get-mps-control.sh fetches it)"
fi

submit() { "$BIN/gpushare" submit "$@" | tee -a "$OUT/submits.log"; }
echo "== submitting one online service (20 req/s, 3x burst at 20-35 s, SLO p99 60 ms) and two training jobs"
submit --online --detach --name web --slo-p99 60ms \
    --sim-profile resnet50-inference --rps 20 --sim-burst 20:15:3 -- sleep 600
# Gating turns on at the tick after the service's first request boundary: the jobs' --queue auto
# then launches them with shallow queues (CUDA_LAUNCH_BLOCKING=1).
sleep 1
submit --offline --restartable --queue auto --name train-a --sim-profile resnet50-train -- sleep 600
submit --offline --restartable --queue auto --name train-b --sim-profile mobilenetv2-train -- sleep 600
mapfile -t IDS < <(awk '{print $1}' "$OUT/submits.log")

START=$(date +%s)
for t in 5 15 25 30 40 50 60; do
    while (( $(date +%s) - START < t )); do sleep 0.5; done
    echo
    echo "== t=${t}s$( ((t >= 20 && t < 35)) && echo '  (online burst: 60 req/s)')"
    "$BIN/gpushare" status
done
echo
echo "== request gating in the daemon's log"
"$BIN/python" - "$OUT/daemon.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        e = json.loads(line)
    except ValueError:
        continue
    if e.get("event") in ("gating_set", "offline_queue"):
        print(f"  {e['event']} {e.get('client_id') or e.get('gpu')}: {e.get('reason')}")
PY

echo
echo "== stopping"
cleanup
trap - EXIT
echo
echo "== the same scenario in the simulator (gpushare sim demo): a loose SLO, 60 ms"
"$BIN/gpushare" sim demo --out "$OUT/sim" --no-progress \
    --policy gpushare --policy exclusive --policy mps --policy mps-priority --policy time-slicing
echo
echo "== a tight SLO (1.1x the service's p99 alone): where MPS priority alone is not enough"
"$BIN/gpushare" sim demo-tight --out "$OUT/sim" --no-progress \
    --policy gpushare --policy mps-priority | tee "$OUT/tight.txt"
"$BIN/python" - "$OUT/sim/demo-tight.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
slo = next(iter(doc["slo_ms"].values()))
rows = {r["policy"]: r for r in doc["rows"]}
for name in ("gpushare", "mps-priority"):
    r = rows[name]
    p99, offline = r["online_p99_ms"], r["offline_norm"]
    verdict = "keeps" if p99 <= slo else "misses"
    print(f"  {name:<13} p99 {p99:.1f} ms {verdict} the {slo:.1f} ms SLO "
          f"(offline work: {offline:.2f} of its speed alone)")
PY
