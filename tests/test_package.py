# Checks that `import real_py` alone registers torch.ops.real_py.pack/unpack (fresh interpreter),
# that the ops carry docstrings, and that the pack/unpack example in real_py/ops.py (the README
# example) runs as written. A failure points to real_py/__init__.py or real_py/ops.py.
import doctest
import os
import subprocess
import sys

import pytest

import real_py
import real_py.ops


@pytest.mark.dist
def test_import_registers_ops_in_a_fresh_interpreter():
    code = (
        "import torch, real_py; torch.ops.real_py.pack; torch.ops.real_py.unpack; "
        "assert 'descs' in torch.ops.real_py.pack.__doc__; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_ops_documented():
    for f in (real_py.pack, real_py.unpack):
        assert "[k, 6] int64" in f.__doc__, f.__name__


def test_readme_example_runs():
    result = doctest.testmod(real_py.ops, raise_on_error=False, verbose=False)
    assert result.attempted >= 8 and result.failed == 0, result


@pytest.mark.dist
def test_venv_python_imports_real_py_from_any_directory(tmp_path):
    # `make build` puts the checkout on the venv's path (real_py.pth): the README's set-up
    # command is enough for `python -m real_py ...` outside the repository root.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "real_py", "plan", "--src", "tp2", "--dst", "dp2", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"network_bytes"' in out.stdout or "network" in out.stdout
