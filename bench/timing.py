"""Shared benchmark helpers: timing and result files with command, versions, machine and date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def time_fn(fn, *, warmup: int = 1, repeats: int = 5, sync=None) -> dict:
    """Median/min/max seconds of fn() over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def hardware_tag() -> str:
    """'cpu<cores>' here, or the GPU name (e.g. 'h200') when CUDA is available."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name().split()[-1].lower()
    except Exception:
        pass
    return f"cpu{os.cpu_count()}"


def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
    except Exception:
        pass
    return env


def write_results(theme: str, rows: list[dict], columns: list[str], *, title: str, notes: str = "",
                  hardware: str | None = None, extra: dict | None = None) -> Path:
    """Write results/<theme>_<hardware>_<yyyymmdd>.{json,md}; returns the json path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = RESULTS / f"{theme}_{hardware or hardware_tag()}_{now:%Y%m%d}"
    meta = {"command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "date": now.isoformat(timespec="seconds"), "environment": environment()}
    with open(f"{stem}.json", "w") as f:
        json.dump({**meta, **(extra or {}), "rows": rows}, f, indent=1)

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = [f"# {title}", "", f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in meta["environment"].items()), ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return Path(f"{stem}.json")
