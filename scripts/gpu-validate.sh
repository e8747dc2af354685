#!/usr/bin/env bash
# For the day a bare GPU machine is lent for minutes: run unattended every check of
# docs/gpu-validation.md that needs no cluster, and measure what calibrates the simulator.
#
# Usage: scripts/gpu-validate.sh OUTDIR      (from a checkout; root for the daemon and MPS steps)
#
# Writes exactly two files into OUTDIR: gpu-validate.log (everything, as it ran) and
# gpu-validate.json (each step's status, message and numbers, plus a "calibration" summary:
# ResNet-50 batch-1 inference p99 alone and next to a training loop under time-slicing, plain MPS,
# MPS with client priority and gpushare; training throughput in each; the launch gap; the in-flight
# bound's cost). Steps run in an order that puts the cheap checks first and stops starting new ones
# when the time budget (GPU_VALIDATE_BUDGET_S, default 480 s) would be exceeded: what did not run
# is recorded as skipped with the reason, never silently absent.
#
# What it installs (only PyPI and Debian are assumed reachable): a venv under the work directory
# with this checkout's wheel (its dependencies bring cuda-bindings 12 and NVRTC), then torch and
# torchvision from PyPI for the workloads. torch's CUDA wheels are some 3 GB with their nvidia-*
# dependencies (a minute or two on a datacenter link), so that install runs in the background
# while the torch-free checks use the GPU; the torch steps wait for it and are skipped, with pip's
# reason, if it fails. apt-get supplies python3-venv and a C compiler when missing.
#
# Environment:
#   GPU_VALIDATE_BUDGET_S   the whole run's time budget in seconds (480)
#   GPU_VALIDATE_WORK       scratch directory (venv, wheel, logs of each step; /tmp/gpushare-validate)
#   GPU_VALIDATE_SKIP_INSTALL=1  install nothing: use GPU_VALIDATE_PYTHON (default python3) as is.
#                           For the test that runs this script on a machine without a GPU
#                           (tests/test_gpu_validate.py): it must reach the first GPU call fast.
#   GPU_VALIDATE_RPS        the inference loop's request rate (25, as the simulator's scenarios)
#
# Exit status: 0 when every step that ran passed, 1 when one failed, 2 when there is no usable
# GPU (the first GPU call, `nvidia-smi`, failed; nothing GPU-related ran).
set -uo pipefail

if [[ $# -ne 1 || $1 == -* ]]; then
    echo "usage: scripts/gpu-validate.sh OUTDIR" >&2
    exit 64
fi
OUT=$1
REPO=$(cd "$(dirname "$0")/.." && pwd)
BUDGET_S=${GPU_VALIDATE_BUDGET_S:-480}
WORK=${GPU_VALIDATE_WORK:-/tmp/gpushare-validate}
RPS=${GPU_VALIDATE_RPS:-25}
START_S=$(date +%s)
mkdir -p "$OUT" "$WORK" || { echo "gpu-validate: cannot create $OUT or $WORK" >&2; exit 64; }
LOG=$OUT/gpu-validate.log
JSON=$OUT/gpu-validate.json
STEPS=$WORK/steps.jsonl
: > "$LOG"
: > "$STEPS"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
STOPPED_AT=""
FAILED=0
PIDS=()

say() { printf 'gpu-validate: %s\n' "$*"; }
left_s() { echo $((BUDGET_S - ($(date +%s) - START_S))); }

# record NAME STATUS MESSAGE [RESULT_FILE]: one line of steps.jsonl (the result file's JSON, or
# the tail of its text).
record() {
    python3 - "$@" >> "$STEPS" <<'PY'
import json, pathlib, sys
name, status, message = sys.argv[1:4]
result = None
if len(sys.argv) > 4 and pathlib.Path(sys.argv[4]).is_file():
    text = pathlib.Path(sys.argv[4]).read_text(errors="replace")
    try:
        result = json.loads(text)
    except ValueError:
        result = text[-4000:]
print(json.dumps({"step": name, "status": status, "message": message, "result": result}))
PY
    [[ $2 == fail ]] && FAILED=1
    say "$1: $2${3:+: $3}"
}

# step NAME TIMEOUT_S CMD...: run CMD with a timeout when the budget allows, record pass/fail;
# its output goes to the log and WORK/NAME.out; a WORK/NAME.json it wrote becomes the result.
step() {
    local name=$1 limit=$2
    shift 2
    if (($(left_s) < limit)); then
        record "$name" skipped "out of time: needs up to ${limit}s, $(left_s)s of the budget left"
        return 1
    fi
    say "== $name"
    rm -f "$WORK/$name.json"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$WORK/$name.out"
    local rc=${PIPESTATUS[0]}
    local result=$WORK/$name.json
    [[ -s $result ]] || result=$WORK/$name.out
    if ((rc == 0)); then
        record "$name" pass "" "$result"
    elif ((rc == 124 || rc == 137)); then
        record "$name" fail "timed out after ${limit}s" "$result"
    else
        record "$name" fail "exit status $rc" "$result"
    fi
    return "$rc"
}

finish() {
    local rc=$?
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    [[ -n ${MPS_PIPE:-} ]] && CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE nvidia-cuda-mps-control <<< quit >/dev/null 2>&1
    python3 - "$STEPS" "$JSON" "$STOPPED_AT" "$START_S" "$BUDGET_S" <<'PY'
import json, pathlib, sys, time
steps_file, out, stopped_at, start_s, budget_s = sys.argv[1:6]
steps = [json.loads(l) for l in pathlib.Path(steps_file).read_text().splitlines() if l.strip()]
by = {s["step"]: s.get("result") for s in steps}

def num(step, key):
    r = by.get(step)
    return r.get(key) if isinstance(r, dict) else None

def beside(mode):
    """The trainer's rate while the inference loop ran beside it (from its samples)."""
    train, infer = by.get(f"calib_train_{mode}"), by.get(f"calib_infer_{mode}")
    if not (isinstance(train, dict) and isinstance(infer, dict)) or "start_unix_s" not in infer:
        return None
    pts = [p for p in train.get("samples", []) if infer["start_unix_s"] <= p[0] <= infer["end_unix_s"]]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return round((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), 3)

calibration = {
    "inference_p99_ms": {m: num(f"calib_infer_{m}", "p99_ms")
                         for m in ("alone", "timeslice", "mps", "mps_priority", "gpushare")},
    "inference_p50_ms": {m: num(f"calib_infer_{m}", "p50_ms")
                         for m in ("alone", "timeslice", "mps", "mps_priority", "gpushare")},
    "training_iters_per_s": {m: num(f"calib_train_{m}", "iters_per_s")
                             for m in ("alone", "timeslice", "mps", "mps_priority", "gpushare")},
    "training_iters_per_s_beside_inference": {
        m: beside(m) for m in ("timeslice", "mps", "mps_priority", "gpushare")},
    "step_ms_per_iter": {m: num(f"calib_step_{m}", "ms_per_iter")
                         for m in ("async", "bounded_k4", "bounded_k1", "blocking")},
}
kernels = None
stats = by.get("calib_step_bounded_k4_stats")
if isinstance(stats, dict) and stats.get("launches"):
    kernels = stats["launches"] / ((num("calib_step_bounded_k4", "iters") or 30) + 10)
calibration["kernels_per_iter"] = kernels
t = calibration["step_ms_per_iter"]
if kernels and t["async"] is not None:
    if t["blocking"] is not None:
        calibration["launch_gap_plus_host_us"] = round((t["blocking"] - t["async"]) * 1e3 / kernels, 2)
    if t["bounded_k1"] is not None:
        calibration["wake_per_kernel_us"] = round((t["bounded_k1"] - t["async"]) * 1e3 / kernels, 2)
    if t["bounded_k4"] is not None:
        calibration["bound_k4_cost_ratio"] = round(t["bounded_k4"] / t["async"] - 1, 4)
calibration["inflight_check"] = by.get("q1_inflight_50us")
result = {
    "script": "scripts/gpu-validate.sh",
    "started_unix_s": int(start_s),
    "elapsed_s": round(time.time() - int(start_s), 1),
    "budget_s": int(budget_s),
    "stopped_at": stopped_at or None,
    "passed": sum(s["status"] == "pass" for s in steps),
    "failed": [s["step"] for s in steps if s["status"] == "fail"],
    "skipped": [s["step"] for s in steps if s["status"] == "skipped"],
    "calibration": calibration,
    "steps": steps,
}
pathlib.Path(out).write_text(json.dumps(result, indent=2) + "\n")
PY
    say "wrote $JSON and $LOG ($(($(date +%s) - START_S)) s)"
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
    exit "$rc"
}
trap finish EXIT

# ------------------------------------------------------------------------------ install
install_base() {
    if [[ ${GPU_VALIDATE_SKIP_INSTALL:-0} == 1 ]]; then
        PY=${GPU_VALIDATE_PYTHON:-python3}
        record install skipped "GPU_VALIDATE_SKIP_INSTALL=1: using $PY as it is"
        return 0
    fi
    command -v python3 >/dev/null || apt_get python3
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_get python3-venv
    command -v cc >/dev/null || apt_get gcc libc6-dev
    local venv=$WORK/venv
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv" || { STOPPED_AT=install; say "cannot create a venv"; exit 1; }
    PY=$venv/bin/python
    rm -rf "$WORK/wheel"
    step install_gpushare 240 bash -c "'$PY' -m pip install -q --upgrade pip &&
        '$PY' -m pip wheel -q --no-deps -w '$WORK/wheel' '$REPO' &&
        '$PY' -m pip install -q '$WORK'/wheel/gpushare-*.whl" || { STOPPED_AT=install; exit 1; }
    # The in-flight bound, as `gpushare install` builds it, and the checkout's copy Q1 uses.
    step build_native 60 "$PY" -m gpushare.native.build --strict
    step build_native_checkout 60 env PYTHON="$PY" "$REPO/scripts/build-native.sh"
}

# torch in the background (see the header): the torch-free checks use the GPU meanwhile.
install_torch() {
    [[ ${GPU_VALIDATE_SKIP_INSTALL:-0} == 1 ]] && return 0
    (timeout 420 "$PY" -m pip install -q torch torchvision > "$WORK/torch-install.out" 2>&1
     echo $? > "$WORK/torch-install.rc") &
    TORCH_PID=$!
    PIDS+=("$TORCH_PID")
}

apt_get() {
    say "apt-get install $*"
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        say "cannot install $* (not root, or no apt-get)"
        return 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" \
        || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"; }
}

have_torch() {
    if [[ -n ${TORCH_PID:-} ]]; then
        say "waiting for the torch install ($(left_s)s of the budget left)"
        wait "$TORCH_PID" 2>/dev/null
        TORCH_PID=""
        if [[ $(cat "$WORK/torch-install.rc" 2>/dev/null) != 0 ]]; then
            record install_torch fail "pip install torch torchvision failed" "$WORK/torch-install.out"
        else
            record install_torch pass ""
        fi
    fi
    "$PY" -c 'import torch, torchvision; assert torch.cuda.is_available()' 2>/dev/null
}

install_base
say "python: $PY; budget ${BUDGET_S}s; work directory $WORK"
LOADS=$REPO/scripts/gpu-validate-loads.py
GS=("$PY" -m gpushare)
LIB=$("$PY" -c 'from gpushare import native; print(native.library_path())')

# Before any GPU call: what the host has (driver, CUDA bindings, NVRTC, MPS binary, cgroups).
step doctor 60 "${GS[@]}" doctor --json

# ------------------------------------------------------------------------------ the first GPU call
gpu_line=$(nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total --format=csv,noheader -i 0 2>&1)
if [[ $? -ne 0 || -z $gpu_line ]]; then
    STOPPED_AT=gpu
    why=${gpu_line:-no output}
    command -v nvidia-smi >/dev/null || why="nvidia-smi not found"
    record gpu fail "no usable NVIDIA GPU: $why. This script runs on a GPU host (docs/gpu-validation.md); nothing GPU-related ran."
    exit 2
fi
record gpu pass "$gpu_line"
U=$(cut -d, -f2 <<< "$gpu_line" | tr -d ' ')

install_torch

# ------------------------------------------------------------------------------ sensing (S1-S6)
PROBE=("$PY" -m gpushare.node.probe --gpu "$U")
step s1_probe_alone 60 bash -o pipefail -c "$(printf '%q ' "${PROBE[@]}") --count 200 --period-s 0.01 | sed -n '1,2p;\$p'"
busy() { "${PROBE[@]}" --blocks 8192 --cycles 20000000 --period-s 0 > /dev/null 2>&1 & BUSY=$!; PIDS+=("$BUSY"); sleep 3; }
busy
step s2_probe_busy_timesliced 60 bash -o pipefail -c "$(printf '%q ' "${PROBE[@]}") --count 100 --period-s 0.01 | tail -n 1"
kill "$BUSY" 2>/dev/null; wait "$BUSY" 2>/dev/null

MPS_OK=0
if command -v nvidia-cuda-mps-control >/dev/null; then
    MPS_PIPE=$WORK/mps-pipe; MPS_LOG=$WORK/mps-log
    mkdir -p "$MPS_PIPE" "$MPS_LOG"
    if CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$MPS_LOG CUDA_VISIBLE_DEVICES=$U nvidia-cuda-mps-control -d; then
        MPS_OK=1
    fi
fi
if ((MPS_OK)); then
    export CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$MPS_LOG
    busy
    step s2_probe_busy_mps 60 bash -o pipefail -c "$(printf '%q ' "${PROBE[@]}") --count 100 --period-s 0.01 | sed -n '2p;\$p'"
    kill "$BUSY" 2>/dev/null; wait "$BUSY" 2>/dev/null
    "${PROBE[@]}" --period-s 0.1 > /dev/null 2>&1 & P1=$!
    "${PROBE[@]}" --period-s 0.1 > /dev/null 2>&1 & P2=$!
    PIDS+=("$P1" "$P2"); sleep 3
    step s3_nvml_mps_memory 30 bash -c "echo workers $P1 $P2; '$PY' -m gpushare.node.nvml_diag; nvidia-smi"
    kill "$P1" "$P2" 2>/dev/null; wait "$P1" "$P2" 2>/dev/null
    step s4_gpm_idle 30 "$PY" -m gpushare.node.nvml_diag --count 3 --interval-s 0.5
    busy
    step s4_gpm_busy 30 "$PY" -m gpushare.node.nvml_diag --count 3 --interval-s 0.5
    kill "$BUSY" 2>/dev/null; wait "$BUSY" 2>/dev/null
    echo quit | nvidia-cuda-mps-control; sleep 1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY MPS_PIPE
else
    record s2_probe_busy_mps skipped "nvidia-cuda-mps-control not found or did not start"
fi
step s6_probe_manager 40 "$PY" -c "
import os, time
from gpushare.config import ProbeConfig
from gpushare.node.probe_manager import ProbeManager
m = ProbeManager(ProbeConfig(window_s=5.0)); m.start('$U', dict(os.environ)); m.set_offline_running('$U', False)
time.sleep(8); r = m.reading('$U'); print(r); print(m.status('$U')); m.close()
assert r.latency_ms is not None and r.ratio is not None, 'no probe reading'"
step nvml_compute_mode_plain 20 "$PY" -m gpushare.node.nvml_diag --count 1

# ------------------------------------------------------------------------------ MPS scripts
if command -v nvidia-cuda-mps-control >/dev/null; then
    step mps_connect 60 "$PY" "$REPO/scripts/gpu-check-mps.py" connect --gpu "$U"
    step mps_limits 60 "$PY" "$REPO/scripts/gpu-check-mps.py" limits --gpu "$U"
    step mps_fault 90 "$PY" "$REPO/scripts/gpu-check-mps.py" fault --gpu "$U"
    # A count, 0 on R535 (no -multiuser-server) and >= 1 from R555: information, not a verdict.
    step mps_multiuser_flag 10 bash -c 'grep -c -- -multiuser-server "$(command -v nvidia-cuda-mps-control)" || true'
else
    record mps_checks skipped "nvidia-cuda-mps-control not found (it ships with the driver)"
fi

# ------------------------------------------------------------------------------ Q1 in-flight bound
step q1_inflight_50us 90 python3 "$REPO/scripts/gpu-check-inflight.py" --n 5000 --kernel-us 50 --host-us 20 --out "$WORK/q1_inflight_50us.json"
step q1_inflight_20us 90 python3 "$REPO/scripts/gpu-check-inflight.py" --n 5000 --kernel-us 20 --host-us 20 --out "$WORK/q1_inflight_20us.json"
step inflight_overhead_cpu 60 bash -c "cd '$REPO' && '$PY' bench/inflight_overhead.py && cp bench/results/inflight_overhead.json '$WORK/inflight_overhead_cpu.json'"

# ------------------------------------------------------------------------------ calibration (torch)
load() { echo "$PY" "$LOADS" "$@"; }
# contended MODE [ENV for the trainer] [ENV for the inference]: a training loop, then the
# inference loop beside it once the trainer is warm; both numbers recorded.
contended() {
    local mode=$1 train_env=$2 infer_env=$3
    rm -f "$WORK/calib_train_$mode.json"
    env $train_env $(load train --seconds 60 --out "$WORK/calib_train_$mode.json") > "$WORK/train_$mode.out" 2>&1 &
    local trainer=$!
    PIDS+=("$trainer")
    sleep 6
    step "calib_infer_$mode" 60 env $infer_env $(load infer --seconds 10 --rps "$RPS" --out "$WORK/calib_infer_$mode.json")
    kill -TERM "$trainer" 2>/dev/null; wait "$trainer" 2>/dev/null
    record_train "$mode" "$WORK/train_$mode.out"
}

record_train() {
    if [[ -s $WORK/calib_train_$1.json ]]; then
        record "calib_train_$1" pass "" "$WORK/calib_train_$1.json"
    else
        record "calib_train_$1" fail "the training loop wrote no result" "$2"
    fi
}

# The training step four ways (docs/gpu-validation.md, "What settles the simulator's 1.5x"), and
# Q1's PyTorch loop of small kernels three ways.
step_timings() {
    step calib_step_async 60 $(load step --out "$WORK/calib_step_async.json")
    step calib_step_bounded_k4 60 env LD_PRELOAD="$LIB" GPUSHARE_MAX_INFLIGHT=4 GPUSHARE_INFLIGHT_STATS="$WORK/calib_step_bounded_k4_stats.json" $(load step --out "$WORK/calib_step_bounded_k4.json")
    record calib_step_bounded_k4_stats pass "the interposer's stats (launches: kernels of warm-up and timed steps)" "$WORK/calib_step_bounded_k4_stats.json"
    step calib_step_bounded_k1 90 env LD_PRELOAD="$LIB" GPUSHARE_MAX_INFLIGHT=1 $(load step --out "$WORK/calib_step_bounded_k1.json")
    step calib_step_blocking 90 env CUDA_LAUNCH_BLOCKING=1 $(load step --out "$WORK/calib_step_blocking.json")
    TORCH_LOOP='import torch,time; x=torch.ones(1<<20,device="cuda"); [x.mul_(1.0) for _ in range(200)]; torch.cuda.synchronize(); t=time.perf_counter(); [x.mul_(1.0) for _ in range(20000)]; torch.cuda.synchronize(); print(round(time.perf_counter()-t,3))'
    step q1_torch_unbounded 40 "$PY" -c "$TORCH_LOOP"
    step q1_torch_blocking 60 env CUDA_LAUNCH_BLOCKING=1 "$PY" -c "$TORCH_LOOP"
    step q1_torch_k2 40 bash -c "LD_PRELOAD='$LIB' GPUSHARE_MAX_INFLIGHT=2 GPUSHARE_INFLIGHT_STATS='$WORK/q1.json' '$PY' -c '$TORCH_LOOP' && cat '$WORK/q1.json'"
}

if have_torch; then
    step calib_infer_alone 60 $(load infer --seconds 10 --rps "$RPS" --out "$WORK/calib_infer_alone.json")
    step calib_train_alone 60 $(load train --seconds 10 --out "$WORK/calib_train_alone.json")
    contended timeslice "" ""
    if command -v nvidia-cuda-mps-control >/dev/null; then
        MPS_PIPE=$WORK/mps-pipe2; mkdir -p "$MPS_PIPE" "$WORK/mps-log2"
        MPS_ENV="CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$WORK/mps-log2"
        env $MPS_ENV CUDA_VISIBLE_DEVICES="$U" nvidia-cuda-mps-control -d
        contended mps "$MPS_ENV" "$MPS_ENV"
        # CUDA_MPS_CLIENT_PRIORITY (R550+): 0 normal, 1 below normal for the trainer.
        contended mps_priority "$MPS_ENV CUDA_MPS_CLIENT_PRIORITY=1" "$MPS_ENV CUDA_MPS_CLIENT_PRIORITY=0"
        CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE nvidia-cuda-mps-control <<< quit; sleep 1; unset MPS_PIPE
    fi
else
    record calibration skipped "torch and torchvision with CUDA are not importable by $PY: $(tail -n 3 "$WORK/torch-install.out" 2>/dev/null | tr '\n' ' ')"
fi

# ------------------------------------------------------------------------------ the daemon
daemon_checks() {
    local base=$WORK/daemon
    rm -rf "$base"; mkdir -p "$base"
    cat > "$base/gpushare.toml" <<EOF
version = 1
[paths]
runtime_dir = "$base/run"
state_dir = "$base/state"
[daemon]
admin_group = ""
[metrics]
listen = "127.0.0.1:19402"
EOF
    export GPUSHARE_SOCKET=$base/run/gpushare.sock
    "${GS[@]}" daemon --config "$base/gpushare.toml" > "$WORK/daemon.log" 2>&1 &
    DAEMON=$!
    PIDS+=("$DAEMON")
    local i
    for i in $(seq 100); do [[ -S $GPUSHARE_SOCKET ]] && break; sleep 0.2; done
    if [[ ! -S $GPUSHARE_SOCKET ]]; then
        record daemon_start fail "no socket after 20 s" "$WORK/daemon.log"
        return 1
    fi
    sleep 3
    step daemon_status 20 "${GS[@]}" status --json
    step daemon_healthz 10 bash -c 'curl -sf 127.0.0.1:19402/healthz || python3 -c "import urllib.request as u; print(u.urlopen(\"http://127.0.0.1:19402/healthz\").read().decode())"'
    step daemon_submit_limits 60 "${GS[@]}" submit --offline --gpu 0 --sm 30 --mem 2G -- "$PY" -c "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).multi_processor_count)"
    step daemon_mem_cap 60 bash -c "! $(printf '%q ' "${GS[@]}") submit --offline --gpu 0 --mem 1G -- '$PY' -c \"import torch; torch.empty(2<<30, dtype=torch.uint8, device='cuda')\""
    step daemon_env 60 bash -c "eval \"\$($(printf '%q ' "${GS[@]}") env --offline --gpu 0 --sm 30 --mem 2G)\" && ! '$PY' -c \"import torch; print(torch.cuda.device_count()); torch.empty(3<<30, dtype=torch.uint8, device='cuda')\""
    step nvml_compute_mode_daemon 20 "$PY" -m gpushare.node.nvml_diag --count 1
    # gpushare's own numbers for the calibration: the trainer offline, the inference online with
    # an SLO of 1.5x its p99 alone (the frontier's point, docs/benchmarks.md).
    local alone slo
    alone=$(python3 -c "import json;print(json.load(open('$WORK/calib_infer_alone.json'))['p99_ms'])" 2>/dev/null || echo 20)
    slo=$(python3 -c "print(max(1, round(1.5 * $alone)))")
    rm -f "$WORK/calib_train_gpushare.json" "$WORK/calib_infer_gpushare.json"
    "${GS[@]}" submit --offline --detach --restartable --name train -- $(load train --seconds 60 --out "$WORK/calib_train_gpushare.json")
    sleep 10
    step calib_infer_gpushare 60 bash -c "$(printf '%q ' "${GS[@]}") submit --online --detach --name infer --slo-p99 ${slo}ms -- $(load infer --seconds 10 --rps "$RPS" --out "$WORK/calib_infer_gpushare.json") &&
        for i in \$(seq 100); do [[ -s '$WORK/calib_infer_gpushare.json' ]] && break; sleep 0.5; done; cat '$WORK/calib_infer_gpushare.json'"
    step daemon_status_online 20 "${GS[@]}" status --json
    local train_id
    train_id=$("${GS[@]}" list --json | python3 -c "import json,sys; print(next((c['id'] for c in json.load(sys.stdin)['clients'] if c.get('name') == 'train'), ''))")
    if [[ -n $train_id ]]; then
        step daemon_pause_drains 30 bash -c "$(printf '%q ' "${GS[@]}") pause $train_id && sleep 2 && nvidia-smi dmon -s u -c 5; $(printf '%q ' "${GS[@]}") resume $train_id"
        "${GS[@]}" cancel "$train_id" > /dev/null 2>&1
    fi
    record calib_slo pass "the online client's SLO: ${slo}ms (1.5x its p99 alone)"
    record_train gpushare "$WORK/daemon.log"
    step daemon_events 20 "${GS[@]}" events
    kill -TERM "$DAEMON"; wait "$DAEMON" 2>/dev/null
    record daemon_log pass "" "$WORK/daemon.log"
    unset GPUSHARE_SOCKET
}

if [[ $(id -u) -ne 0 ]]; then
    record daemon skipped "not root: the daemon supervises MPS and cgroups as root"
elif ! command -v nvidia-cuda-mps-control >/dev/null; then
    record daemon skipped "nvidia-cuda-mps-control not found"
elif ! have_torch; then
    record daemon skipped "torch not usable: the daemon steps run torch clients"
elif (($(left_s) < 150)); then
    record daemon skipped "out of time: needs about 150s, $(left_s)s left"
else
    daemon_checks
fi

if have_torch; then
    step_timings
fi

# ------------------------------------------------------------------------------ a 2-GPU DDP job (issue 35)
# A torchrun job of two ranks, each through its own GPU's MPS daemon (docs/design.md §7, option A),
# then without MPS (option C's control); each stops rank 1 for 2 s to see rank 0 stall. Needs two GPUs.
if have_torch && [[ $(id -u) -eq 0 ]] && (($(nvidia-smi -L 2>/dev/null | wc -l) >= 2)); then
    step ddp2_mps 150 "$PY" "$REPO/scripts/gpu-check-ddp.py" --mode mps --out "$WORK/ddp2_mps.json"
    step ddp2_plain 150 "$PY" "$REPO/scripts/gpu-check-ddp.py" --mode plain --out "$WORK/ddp2_plain.json"
else
    record ddp2 skipped "needs root, torch and two GPUs ($(nvidia-smi -L 2>/dev/null | wc -l) here)"
fi

# ------------------------------------------------------------------------------ last: faults
if have_torch && [[ $(id -u) -eq 0 ]]; then
    step freeze_gpu_lag 90 bash -c "cd '$REPO' && '$PY' bench/freeze_gpu_lag.py --gpu 0 --cycles 3 --warmup-s 6 -- $(load train --seconds 80 --out "$WORK/freeze_train.json") && cp bench/results/freeze_gpu_lag.json '$WORK/freeze_gpu_lag.json'"
fi
# The worker must report the sticky 700 and exit 3; the NVML watcher must see the XID.
step s5_xid 40 bash -c "'$PY' -m gpushare.node.nvml_diag --count 1 --events-s 15 | grep '\"xid\"' & W=\$!; sleep 3
    $(printf '%q ' "${PROBE[@]}") --count 5 --inject-fault > '$WORK/s5.lines'; rc=\$?; tail -n 1 '$WORK/s5.lines'
    wait \$W; dmesg 2>/dev/null | grep -i xid | tail -n 2; echo worker_rc=\$rc; [ \$rc -eq 3 ] && grep -q '\"code\": 700' '$WORK/s5.lines'"

((FAILED)) && exit 1
exit 0
