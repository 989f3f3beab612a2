"""Make a venv's Python see this checkout as the installed `real_py` distribution: a .pth file
with the checkout and a dist-info holding pyproject.toml's entry points (vLLM finds the
`real_py` weight-transfer backend through group vllm.general_plugins). What an editable install
writes, without rebuilding the extension that `make build` keeps in place.

    python scripts/vllm_plugin.py       # run by the venv's own interpreter (make vllm-venv)
"""

import os
import site
import sys
import tomllib

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(root, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
target = site.getsitepackages()[0]
info = os.path.join(target, f"{project['name']}-{project['version']}.dist-info")
os.makedirs(info, exist_ok=True)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
with open(os.path.join(info, "entry_points.txt"), "w") as f:
    for group, entries in project.get("entry-points", {}).items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
with open(os.path.join(target, "real_py.pth"), "w") as f:
    f.write(root + "\n")
print(f"{sys.executable}: real_py from {root}, entry points in {info}")
