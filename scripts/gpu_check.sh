#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU, a CUDA torch, nvcc and no internet. In order:
#   build     the CUDA extension in place (no build isolation: against the installed torch)
#   import    the CUDA kernels are registered and torch sees the GPU
#   tests     pytest -m cuda (engines, bf16 train step, CUDA-graph decode, NCCL PPO on 1 GPU, ops)
#   pack      pack/unpack GB/s against a device-to-device copy_ of the same bytes
#   realloc   in-process reallocation of a 7B-shaped bf16 model between layouts on the GPU
#   ppo       PPO iterations of a 1.1B actor + critic (bf16, fp32 master) on the GPU, and the
#             estimator against them (datasheet profile and calibrate_gpu)
#   generate  generation tokens/s: dynamic cache, static cache, CUDA graph
#   profile   torch.profiler tables: pack calls vs copy_, and generate() per decode mode
# Random-init models only; nothing is downloaded. Every step runs under `timeout` with its own cap
# and all of them under one overall deadline (GPU_CHECK_BUDGET_S, default 470 s: under 8 minutes);
# a failing or timed-out step is recorded and the next one runs. Logs, results and summary.md go
# to one folder:
#
#   scripts/gpu_check.sh                    -> bench/results/gpu_<yyyymmdd>/
#   OUT=/some/dir scripts/gpu_check.sh
#   SMALL=1 DEVICE=cpu scripts/gpu_check.sh dry run of every bench on the CPU (tiny sizes; no
#                                           build, no tests): checks the script and the benches
#   GPU_CHECK_STEPS="build import tests pack profile" scripts/gpu_check.sh
#                                           only those steps (env always runs; default: all)
# Environment: PYTHON (default python3), CUDA_HOME (default: found from nvcc), MAX_JOBS.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/bench/results/gpu_$(date -u +%Y%m%d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
SMALL_FLAG=$([ "${SMALL:-0}" = 1 ] && echo --small || true)
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-470}))

# torch finds CUDA through CUDA_HOME or `which nvcc`; a wrapper script on PATH (e.g.
# /usr/local/bin/nvcc) would point it at the wrong prefix, so pick a prefix that has the headers.
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda "$(dirname "$(dirname "$(command -v nvcc || echo /nonexistent/bin/nvcc)")")"; do
    if [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime_api.h" ]; then export CUDA_HOME="$d"; break; fi
  done
fi
export PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
# The H200 image sets CC/CXX to a relocated gcc (/opt/gcc/bin) that finds only libstdc++.a: _C.so
# then carries its own libstdc++ and crashes on its first error message (setup.py refuses such a
# build). The system compiler links the shared libstdc++ that torch uses.
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi

STEPS_KNOWN="build import tests pack realloc ppo generate profile"
for s in ${GPU_CHECK_STEPS:-}; do
  [[ " $STEPS_KNOWN " == *" $s "* ]] || { echo "gpu_check: GPU_CHECK_STEPS names '$s'; known: $STEPS_KNOWN" >&2; exit 2; }
done
if [ "$DEVICE" = cuda ] && [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" build "* ]]; then
  echo "gpu_check: GPU_CHECK_STEPS without build: the later steps use whatever _C.so is in place" >&2
fi
SUMMARY="$OUT/summary.md"
printf '# gpu_check %s\n\n| step | exit | seconds |\n|---|---|---|\n' "$(date -u '+%Y-%m-%d %H:%M UTC')" > "$SUMMARY"
status=0
last_rc=0
step() {  # step NAME CAP_S CMD...: timeout min(CAP_S, time left), log to $OUT/NAME.log, never exits
  local name="$1" cap="$2"
  shift 2
  if [ "$name" != env ] && [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" $name "* ]]; then
    echo "| $name | not selected | 0 |" >> "$SUMMARY"
    last_rc=0
    return 0
  fi
  local left=$((DEADLINE - SECONDS))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 10 ]; then
    echo "=== $name: skipped, overall budget spent" | tee "$OUT/$name.log"
    echo "| $name | skipped (budget) | 0 |" >> "$SUMMARY"
    status=1
    return 0
  fi
  echo "=== $name (timeout ${limit}s): $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  echo "| $name | $rc$([ "$rc" -eq 124 ] && echo ' (timeout)') | $((SECONDS - t0)) |" >> "$SUMMARY"
  [ "$rc" -eq 0 ] || status=1
  last_rc=$rc
  return 0
}

step env 30 "$PY" -c "
import os, shutil, subprocess, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())
print('CUDA_HOME', os.environ.get('CUDA_HOME', 'unset'), 'nvcc', shutil.which('nvcc'))
from importlib.metadata import version, PackageNotFoundError
for p in ('transformers', 'cupy-cuda13x', 'numpy'):
    try: print(p, version(p))
    except PackageNotFoundError: print(p, 'not installed')
if shutil.which('nvidia-smi'):
    subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv'])"

if [ "$DEVICE" = cuda ]; then
  step build 180 env REAL_PY_CUDA=1 "$PY" setup.py build_ext --inplace
  if [ "$last_rc" -ne 0 ]; then  # without the CUDA build every later step would test a stale .so
    echo "| (all later steps) | skipped: build failed | 0 |" >> "$SUMMARY"
    echo "Result: FAILED (build) in $SECONDS s; logs: build.log" >> "$SUMMARY"
    cat "$SUMMARY"
    exit 1
  fi
  step import 30 "$PY" -c "
import torch, real_py.ops
for op in ('pack', 'unpack'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key('real_py::' + op, 'CUDA'), op + ': no CUDA kernel'
assert torch.cuda.is_available(), 'torch sees no GPU'
print('CUDA kernels registered; GPU:', torch.cuda.get_device_name())"
  step tests 110 "$PY" -m pytest -m cuda -q -ra -p no:cacheprovider --continue-on-collection-errors tests
fi

step pack 50 "$PY" bench/bench_pack.py --device "$DEVICE" --repeats 5 $SMALL_FLAG --out-dir "$OUT"
step realloc 60 "$PY" bench/bench_gpu_realloc.py --device "$DEVICE" $SMALL_FLAG --out-dir "$OUT"
step ppo 110 "$PY" bench/bench_gpu_ppo.py --device "$DEVICE" --iters 3 $SMALL_FLAG --out-dir "$OUT"
step generate 60 "$PY" bench/bench_generate.py --device "$DEVICE" --repeats 2 $SMALL_FLAG --out-dir "$OUT"
step profile 120 "$PY" bench/profile_gpu.py --device "$DEVICE" $SMALL_FLAG --out-dir "$OUT"

{
  echo
  echo "Result: $([ $status -eq 0 ] && echo OK || echo FAILED) in $SECONDS s; logs: <step>.log"
  for f in "$OUT"/*.md; do
    [ "$f" = "$SUMMARY" ] && continue
    echo
    sed -e 's/^# /## /' "$f"
  done
} >> "$SUMMARY"
echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED) in $SECONDS s (summary: $SUMMARY)"
exit $status
