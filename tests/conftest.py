"""Test markers and the fast path.

    cuda   needs a CUDA GPU: skipped here when torch sees none (scripts/gpu_check.sh runs them); a
           parametrization of many CUDA cases lives in a module of its own that skips as a whole
           (tests/test_ops_cuda.py), so a CPU run shows one skip line for it, not one per case
    dist   starts processes (gloo ranks, torchrun, the CLI in a subprocess): seconds to minutes each

`make test-fast` runs `-m "not dist and not cuda"`; `make test` runs everything. A test that starts
a Python process (multiprocessing, or a subprocess running python or torchrun) without the `dist`
marker fails with a message saying so, so the fast path cannot silently grow slow.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker cuda)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def _starts_python(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
    if not argv:
        return False
    head = os.path.basename(os.fsdecode(argv[0])).split()[0]
    return head.startswith("python") or head == "torchrun"


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request, monkeypatch):
    """Fail a test that starts processes without the `dist` marker, naming it."""
    if request.node.get_closest_marker("dist"):
        return
    nodeid = request.node.nodeid
    why = f"{nodeid} starts processes: mark it @pytest.mark.dist (tests/conftest.py)"
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *a, **kw):
        if _starts_python(args):
            raise RuntimeError(why)
        popen_init(self, args, *a, **kw)

    def guarded_start(self):
        raise RuntimeError(why)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
