#!/usr/bin/env bash
# GPU check for the pack/unpack ops, for a machine with an NVIDIA GPU, a CUDA torch, nvcc and no
# internet: builds the CUDA extension in place (no build isolation: against the installed torch),
# runs the CUDA tests and the CUDA pack benchmark, and tees every log.
#
#   scripts/gpu_check.sh            logs + results in bench/results/
#   OUT=/some/dir scripts/gpu_check.sh
# Environment: PYTHON (default python3), CUDA_HOME (default: found from nvcc), MAX_JOBS.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/bench/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# torch finds CUDA through CUDA_HOME or `which nvcc`; a wrapper script on PATH (e.g.
# /usr/local/bin/nvcc) would point it at the wrong prefix, so pick a prefix that has the headers.
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda "$(dirname "$(dirname "$(command -v nvcc || echo /nonexistent/bin/nvcc)")")"; do
    if [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime_api.h" ]; then export CUDA_HOME="$d"; break; fi
  done
fi
export PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"

status=0
step() {  # step NAME TIMEOUT_S CMD...: run with a timeout, tee to $OUT/gpu_check_NAME.log
  local name="$1" limit="$2"
  shift 2
  echo "=== $name: $*" | tee "$OUT/gpu_check_$name.log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/gpu_check_$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/gpu_check_$name.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

step env 60 "$PY" -c "
import os, shutil, subprocess, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())
print('CUDA_HOME', os.environ.get('CUDA_HOME', 'unset'), 'nvcc', shutil.which('nvcc'))
if shutil.which('nvidia-smi'):
    subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv'])"

# The build must succeed for anything else to mean something.
step build 1200 env REAL_PY_CUDA=1 "$PY" setup.py build_ext --inplace || { echo "build failed"; exit 1; }

step import 120 "$PY" -c "
import torch, real_py.ops
for op in ('pack', 'unpack'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key('real_py::' + op, 'CUDA'), op + ': no CUDA kernel'
assert torch.cuda.is_available(), 'torch sees no GPU'
print('CUDA kernels registered; GPU:', torch.cuda.get_device_name())"

step tests 900 "$PY" -m pytest -m cuda -q -ra -p no:cacheprovider --continue-on-collection-errors tests

step bench 900 "$PY" bench/bench_pack.py --device cuda --out-dir "$OUT"

echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED) (logs and results in $OUT)"
exit $status
