# Checks the package's architecture contracts (.importlinter, run by import-linter): the tree keeps
# them, and an upward import or an import circle breaks them with a message naming both modules.
# A failure on the real tree points to the import that crossed a layer; see docs/architecture.md.
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parent.parent
LINT = [
    sys.executable,
    "-c",
    "import sys; from importlinter.cli import lint_imports_command; "
    "sys.exit(lint_imports_command())",
    "--no-cache",
]


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run(LINT, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(
        REPO / "real_py", tmp_path / "real_py", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def test_tree_keeps_the_contracts():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 kept, 0 broken" in r.stdout


def test_upward_import_is_refused_naming_both_modules(tmp_path):
    root = _copy(tmp_path)
    _append(root / "real_py/realloc/shard.py", "from ..rlhf import ppo  # noqa: E402,F401")
    r = _lint(root)
    assert r.returncode != 0
    assert "real_py.realloc is not allowed to import real_py.rlhf" in r.stdout
    assert "real_py.realloc.shard -> real_py.rlhf.ppo" in r.stdout


def test_package_code_importing_testing_is_refused(tmp_path):
    """cli may import calibrate or launch (the layers allow it), never the test helpers."""
    root = _copy(tmp_path)
    _append(root / "real_py/cli/plot.py", "from .. import testing  # noqa: E402,F401")
    r = _lint(root)
    assert r.returncode != 0
    assert "package code never imports real_py.testing" in r.stdout
    assert "real_py.cli.plot -> real_py.testing" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "importer,line,names",
    [
        (
            "real_py/rlhf/observe.py",
            "from . import calls  # noqa: E402,F401",
            ("No cycles are allowed in real_py.rlhf.", ".observe -> .calls"),
        ),
        (
            "real_py/realloc/transports/base.py",
            "from ..reallocator import Reallocator  # noqa: E402,F401",
            ("No cycles are allowed in real_py.realloc.", ".transports -> .reallocator"),
        ),
    ],
)
def test_import_circle_is_refused(tmp_path, importer, line, names):
    root = _copy(tmp_path)
    _append(root / importer, line)
    r = _lint(root)
    assert r.returncode != 0
    assert "no import circles" in r.stdout and "BROKEN" in r.stdout
    for n in names:
        assert n in r.stdout, r.stdout
