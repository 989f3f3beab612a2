# Quick start: `make run` (main job) and `make test` (C++ + Python tests).
# Both create or reuse .venv, install the pinned requirements, and build the extension.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.requirements-stamp
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export MAX_JOBS ?= 2
ARGS ?= train --overwrite

.PHONY: venv build run test lint test-cpp test-py bench bench-realloc clean

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

# Architecture contracts (.importlinter): layers and no import circles; names both modules on a break.
lint: $(STAMP)
	$(VENV)/bin/lint-imports --no-cache

test: lint test-cpp test-py

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

clean:
	rm -rf build real_py/_C*.so
