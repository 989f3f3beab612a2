"""Shared benchmark helpers: timing (warmup + repeats, median) and result files.

    time_fn(fn, device="cpu"|"cuda", warmup=2, repeats=7) -> Timing (seconds)
    time_interleaved({name: fn}, ...) -> {name: Timing}, variants timed round-robin
    environment() -> dict of versions, machine and date
    write_results(theme, hardware, rows, columns=..., title=..., notes=..., extra=...) ->
        bench/results/<theme>_<hardware>_<yyyymmdd>.{json,md}

CPU timing uses perf_counter around each call; CUDA timing uses CUDA events on the current
stream (synchronized before the first and after the last event), so launch gaps count.
Benchmarks never assert: they report.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, slots=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int

    def gbps(self, nbytes: int) -> float:
        """nbytes / median time, in GB/s (1e9 bytes)."""
        return nbytes / self.median_s / 1e9 if self.median_s > 0 else float("inf")


def time_fn(fn, *, device: str = "cpu", warmup: int = 2, repeats: int = 7) -> Timing:
    """Median wall time of fn() over `repeats` calls after `warmup` untimed calls."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; allowed: 'cpu', 'cuda'")
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), max(times), repeats)


def time_interleaved(fns: dict, *, device: str = "cpu", warmup: int = 1, repeats: int = 7) -> dict:
    """name -> Timing for several functions timed round-robin (one call of each per round), so
    that load from other processes on a shared machine hits every variant alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_fn(fn, device=device, warmup=0, repeats=1).median_s)
    return {name: Timing(statistics.median(t), min(t), max(t), repeats) for name, t in samples.items()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str:
    """HEAD's short hash, with "+dirty" when tracked files differ from it (the run did not
    measure that commit's code alone)."""
    try:
        run = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                        cwd=Path(__file__).parent, timeout=10).stdout.strip()
        head = run("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment() -> dict:
    """Versions, machine and date (UTC) for a results file."""
    import numpy
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
        "cuda": torch.version.cuda, "git_commit": _git_commit(),
        "machine": f"{platform.machine()}, {_cpu_model()}, {os.cpu_count()} cores, {mem:.0f} GiB",
        "torch_threads": torch.get_num_threads(),
        "load_avg_1_5_15min": [round(x, 1) for x in os.getloadavg()],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    return env


def hardware_tag(device: str) -> str:
    """Results-file tag: "cpu<cores>" on CPU, the GPU's model ("h200") on CUDA."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name().lower().replace("nvidia", "").split()[0]
    return f"cpu{os.cpu_count()}"


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """rows as a markdown table of `columns` (floats to 3 significant digits)."""
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows])


def write_results(theme: str, hardware: str, rows: list[dict], *, columns: list[str], title: str,
                  notes: str = "", extra: dict | None = None,
                  out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write rows (dicts) to <theme>_<hardware>_<yyyymmdd>.json and .md; returns both paths.
    `extra` goes into the JSON only (raw figures a table would not show)."""
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv)
    stem = f"{theme}_{hardware}_{env['date_utc'][:10].replace('-', '')}"
    jpath, mpath = out / f"{stem}.json", out / f"{stem}.md"
    jpath.write_text(json.dumps({"title": title, "command": command, "environment": env,
                                 "notes": notes, "rows": rows} | ({"extra": extra} if extra else {}),
                                indent=1) + "\n")

    lines = [f"# {title}", "", f"Command: `{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", markdown_table(rows, columns)]
    if notes:
        lines += ["", notes]
    mpath.write_text("\n".join(lines) + "\n")
    return jpath, mpath


__all__ = ["Timing", "time_fn", "time_interleaved", "environment", "hardware_tag", "markdown_table", "write_results",
           "RESULTS"]
