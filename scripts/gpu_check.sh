#!/usr/bin/env bash
# GPU check for a machine with one NVIDIA GPU, a CUDA torch, nvcc and no internet. In order:
#   build     the CUDA extension in place (no build isolation: against the installed torch)
#   import    the CUDA kernels are registered and torch sees the GPU
#   tests     pytest -m cuda (engines, bf16 train step, CUDA-graph decode, NCCL PPO on 1 GPU, ops)
#   pack      strided copy GB/s per run-length class (>= 16 KiB goal 0.90, 2-16 KiB goal 0.85 of
#             a device copy_ of the same bytes), per-call ops and compiled CopyPlans
#   realloc   7B bf16 pairs and an MoE pair on the GPU, every rank a thread (one pass, compiled
#             once), against copy_ of the same bytes (goal 0.7) and gather-and-slice (goal 3x)
#   realloc_ipc  the same pairs with every rank a process on the GPU, CUDA IPC (goal 0.6)
#   ppo       PPO iterations of a 1.1B actor + critic (bf16, fp32 master) on the GPU: seconds and
#             peak memory per call against the previous report, and the estimator against them
#             (datasheet profile and calibrate_gpu)
#   generate  decode step time of the compiled CUDA-graph step against the weight-read roofline,
#             tokens/s against transformers' static-cache generate(), greedy tokens compared
#   trl       GRPO of a 0.36B Qwen2-style model: `python -m real_py train` beside TRL's
#             GRPOTrainer (TRL from $TRL_WHEELS, default bench/.cache/trl_wheels, if present;
#             skipped with a message when trl cannot be imported), TRL's side <= 130 s
#   profile   torch.profiler tables: pack calls vs copy_, and generate() per decode mode
# Random-init models only; nothing is downloaded. Every step runs under `timeout` with its own cap
# and all of them under one overall deadline (GPU_CHECK_BUDGET_S, default 540 s: one call of the
# device tool is at most 600 s); a failing or timed-out step is recorded and the next one runs, and
# the summary ends with the GPU_CHECK_STEPS line that runs the steps the deadline cut. Reports follow bench/README.md's
# rule (<theme>_<hardware>_<yyyymmdd>.{json,md}, one per theme and hardware, so a run replaces the
# reports of the same day); raw logs go to a git-ignored folder:
#
#   scripts/gpu_check.sh                    -> bench/results/{pack,realloc,ppo,generate,trl,profile}_<hw>_<yyyymmdd>.*
#                                              and bench/results/gpu_check_<hw>_<yyyymmdd>.md (steps,
#                                              versions, tests, the reports written); logs in
#                                              bench/results/.raw/gpu_check_<yyyymmdd_HHMMSS>/
#   REPORTS=/some/dir RAW=/other/dir scripts/gpu_check.sh
#   BUNDLE=$OUT/gpu_check.tar.gz scripts/gpu_check.sh
#                                           also packs the reports this run wrote (reports/) and its
#                                           raw logs (raw/) into one archive: a device call returns
#                                           at most 8 files (docs/gpu.md: the lent-machine recipe)
#   SMALL=1 DEVICE=cpu scripts/gpu_check.sh dry run of every bench on the CPU (tiny sizes; no
#                                           build, no tests): checks the script and the benches;
#                                           its *_small reports stay in the raw folder
#   GPU_CHECK_STEPS="build import tests pack profile" scripts/gpu_check.sh
#                                           only those steps (env always runs; default: all)
#   GPU_CHECK_STEPS="build import tests pack realloc realloc_ipc" scripts/gpu_check.sh
#                                           the reallocation figures alone (about 6 minutes)
# Environment: PYTHON (default python3), CUDA_HOME (default: found from nvcc), MAX_JOBS, TRL_WHEELS
# (a folder of wheels for `pip install --no-index trl`; the trl step installs from it).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CMDLINE="$(for v in DEVICE SMALL GPU_CHECK_STEPS GPU_CHECK_BUDGET_S PYTHON RAW REPORTS BUNDLE REAL_PY_GIT_COMMIT; do
  [ -n "${!v:-}" ] && printf '%s="%s" ' "$v" "${!v}"; done)scripts/gpu_check.sh"
RAW="${RAW:-$ROOT/bench/results/.raw/gpu_check_$(date -u +%Y%m%d_%H%M%S)}"
if [ "${SMALL:-0}" = 1 ]; then REPORTS="${REPORTS:-$RAW}"; else REPORTS="${REPORTS:-$ROOT/bench/results}"; fi
mkdir -p "$RAW" "$REPORTS"
touch "$RAW/.start"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
SMALL_FLAG=$([ "${SMALL:-0}" = 1 ] && echo --small || true)
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))

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

STEPS_KNOWN="build import tests pack realloc realloc_ipc ppo generate trl profile"
for s in ${GPU_CHECK_STEPS:-}; do
  [[ " $STEPS_KNOWN " == *" $s "* ]] || { echo "gpu_check: GPU_CHECK_STEPS names '$s'; known: $STEPS_KNOWN" >&2; exit 2; }
done
if [ "$DEVICE" = cuda ] && [ -n "${GPU_CHECK_STEPS:-}" ] && [[ " $GPU_CHECK_STEPS " != *" build "* ]]; then
  echo "gpu_check: GPU_CHECK_STEPS without build: the later steps use whatever _C.so is in place" >&2
fi
SUMMARY="$RAW/summary.md"
printf '# gpu_check %s\n\nCommand: `%s`\n\n| step | exit | seconds |\n|---|---|---|\n' \
  "$(date -u '+%Y-%m-%d %H:%M UTC')" "$CMDLINE" > "$SUMMARY"
status=0
last_rc=0
CUT=""  # steps the deadline cut, for the rerun line
step() {  # step NAME CAP_S CMD...: timeout min(CAP_S, time left), log to $RAW/NAME.log, never exits
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
    echo "=== $name: skipped, overall budget spent" | tee "$RAW/$name.log"
    echo "| $name | skipped (budget) | 0 |" >> "$SUMMARY"
    CUT="$CUT $name"
    status=1
    return 0
  fi
  echo "=== $name (timeout ${limit}s): $*" | tee "$RAW/$name.log"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$RAW/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$RAW/$name.log"
  # timed out: 124 from timeout, or 137 once its grace ran out, after the whole limit (a 137 sooner
  # is an OOM kill or another SIGKILL); cut by the deadline when the limit was less than the cap
  local timed=0
  if { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ $((SECONDS - t0)) -ge "$limit" ]; then timed=1; fi
  echo "| $name | $rc$([ "$timed" = 1 ] && echo ' (timeout)') | $((SECONDS - t0)) |" >> "$SUMMARY"
  if [ "$timed" = 1 ] && [ "$limit" -lt "$cap" ]; then CUT="$CUT $name"; fi
  [ "$rc" -eq 0 ] || status=1
  last_rc=$rc
  return 0
}

bundle() {  # BUNDLE: one archive of reports/ (the reports this run wrote) and raw/ (its logs)
  [ -n "${BUNDLE:-}" ] || return 0
  local stage
  stage="$(mktemp -d)"
  mkdir -p "$stage/reports" "$(dirname "$BUNDLE")"
  find "$REPORTS" -maxdepth 1 -type f \( -name '*.md' -o -name '*.json' -o -name '*.png' \) -newer "$RAW/.start" \
    ! -name summary.md -exec cp {} "$stage/reports/" \;
  cp -r "$RAW" "$stage/raw"
  tar -czf "$BUNDLE" -C "$stage" reports raw || echo "gpu_check: could not write $BUNDLE" >&2
  rm -rf "$stage"
}

ENV_PY="
import os, platform, shutil, subprocess, torch
mem = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30
print('machine', platform.machine(), os.cpu_count(), 'cores', round(mem), 'GiB; python', platform.python_version())
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())
print('CUDA_HOME', os.environ.get('CUDA_HOME', 'unset'), 'nvcc', shutil.which('nvcc'))
from importlib.metadata import version, PackageNotFoundError
for p in ('transformers', 'trl', 'triton', 'cupy-cuda13x', 'numpy'):
    try: print(p, version(p))
    except PackageNotFoundError: print(p, 'not installed')
if shutil.which('nvidia-smi'):
    subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv'])"
step env 30 "$PY" -c "$ENV_PY"

if [ "$DEVICE" = cuda ]; then
  step build 180 env REAL_PY_CUDA=1 "$PY" setup.py build_ext --inplace
  if [ "$last_rc" -ne 0 ]; then  # without the CUDA build every later step would test a stale .so
    echo "| (all later steps) | skipped: build failed | 0 |" >> "$SUMMARY"
    echo "Result: FAILED (build) in $SECONDS s; logs: $RAW/build.log" >> "$SUMMARY"
    bundle
    cat "$SUMMARY"
    exit 1
  fi
  step import 30 "$PY" -c "
import torch, real_py.ops
for op in ('pack', 'unpack', 'copy_planned'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key('real_py::' + op, 'CUDA'), op + ': no CUDA kernel'
assert torch.cuda.is_available(), 'torch sees no GPU'
print('CUDA kernels registered; GPU:', torch.cuda.get_device_name())"
  # pytest-timeout, where installed (the lent machines have it): a hanging test fails alone instead of
  # taking the step's whole cap and its summary line with it; --durations says where the time went.
  PER_TEST=$("$PY" -c "import pytest_timeout" 2>/dev/null && echo "--timeout 90" || true)
  step tests 240 "$PY" -m pytest -m cuda -q -ra -p no:cacheprovider --continue-on-collection-errors \
    --durations 12 $PER_TEST tests
fi

step pack 60 "$PY" bench/bench_pack.py --device "$DEVICE" --repeats 5 $SMALL_FLAG --out-dir "$REPORTS"
step realloc 150 "$PY" bench/bench_gpu_realloc.py --device "$DEVICE" --repeats 3 $SMALL_FLAG --out-dir "$REPORTS"
if [ "$DEVICE" = cuda ]; then  # CUDA IPC: processes on one GPU (no CPU counterpart)
  step realloc_ipc 120 "$PY" bench/bench_gpu_realloc.py --device cuda --transport ipc --repeats 3 $SMALL_FLAG --out-dir "$REPORTS"
fi
step ppo 240 "$PY" bench/bench_gpu_ppo.py --device "$DEVICE" --iters 3 $SMALL_FLAG --out-dir "$REPORTS"
step generate 170 "$PY" bench/bench_generate.py --device "$DEVICE" --repeats 2 $SMALL_FLAG --out-dir "$REPORTS"
TRL_WHEELS="${TRL_WHEELS:-$ROOT/bench/.cache/trl_wheels}"
step trl 260 "$PY" bench/bench_trl.py --device "$DEVICE" $SMALL_FLAG --real-timeout 100 --trl-timeout 130 \
  $([ -d "$TRL_WHEELS" ] && echo "--wheels $TRL_WHEELS") --out-dir "$REPORTS"
step profile 120 "$PY" bench/profile_gpu.py --device "$DEVICE" $SMALL_FLAG --out-dir "$REPORTS"

# The summary as a report of its own, gpu_check_<hw>_<yyyymmdd>.md beside the benches' reports:
# steps, versions (env.log), the test summary line, and the reports this run wrote.
HW=$("$PY" -c "import sys; sys.path.insert(0, 'bench'); from timing import hardware_tag; print(hardware_tag(sys.argv[1], sys.argv[2] == '1'))" \
  "$DEVICE" "${SMALL:-0}" 2>/dev/null) || HW="$DEVICE"
REPORT="$REPORTS/gpu_check_${HW}_$(date -u +%Y%m%d).md"
{
  echo
  if [ -n "$CUT" ]; then
    echo
    echo "The deadline cut:$CUT. To run them (a warm machine keeps this run's build in place):"
    echo
    echo "    GPU_CHECK_STEPS=\"import$CUT\" scripts/gpu_check.sh"
    echo
  fi
  echo "Result: $([ $status -eq 0 ] && echo OK || echo FAILED) in $SECONDS s; git commit $("$PY" -c "from real_py.benchmark import git_commit; print(git_commit())" 2>/dev/null || echo unknown); raw logs (not committed): $RAW/<step>.log"
  echo
  echo "Versions and machine (env step):"
  echo
  grep -v '^===' "$RAW/env.log" | grep -vxF -f <(printf '%s\n' "$ENV_PY") | sed -e 's/^/    /'
  if [ -f "$RAW/tests.log" ]; then
    echo
    echo "pytest -m cuda: $(grep -E '(passed|failed|error)' "$RAW/tests.log" | tail -1)"
  fi
  echo
  echo "Reports written by this run:"
  echo
  find "$REPORTS" -maxdepth 1 -name '*.md' -newer "$RAW/.start" ! -name 'gpu_check_*' ! -name summary.md | sort |
    while read -r f; do echo "- $(basename "$f"): $(head -1 "$f" | sed -e 's/^# //')"; done
} >> "$SUMMARY"
cp "$SUMMARY" "$REPORT"
bundle
cat "$SUMMARY"
echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED) in $SECONDS s (report: $REPORT; logs: $RAW${BUNDLE:+; bundle: $BUNDLE})"
exit $status
