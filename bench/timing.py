"""Shared benchmark helpers: timing (warmup + repeats, median) and result files.

    time_fn(fn, device="cpu"|"cuda", warmup=2, repeats=7) -> Timing (seconds)
    time_interleaved({name: fn}, ...) -> {name: Timing}, variants timed round-robin
    environment() -> dict of versions, machine and date (real_py.benchmark.environment)
    hardware_tag(device, small) -> "cpu2", "h200", "h200_small", ...: <hardware> of a file name
    sync(device)       wait for the device's queued work (CUDA; nothing on a CPU)
    bench_parser(doc)  the options of the device benches: --device, --small, --out-dir
    write_results(theme, hardware, rows, columns=..., title=..., notes=..., extra=...) ->
        bench/results/<theme>_<hardware>_<yyyymmdd>.{json,md}

CPU timing uses perf_counter around each call; CUDA timing uses CUDA events on the current
stream (synchronized before the first and after the last event), so launch gaps count.
Benchmarks never assert: they report.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from real_py.benchmark import environment

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
    return {
        name: Timing(statistics.median(t), min(t), max(t), repeats) for name, t in samples.items()
    }


def hardware_tag(device: str, small: bool = False) -> str:
    """Results-file tag: "cpu<cores>" on CPU, the GPU's model ("h200") on CUDA; with `small` (a
    benchmark's smoke-run sizes) "_small" after it, so a smoke run never replaces a report."""
    import torch

    if device == "cuda":
        tag = torch.cuda.get_device_name().lower().replace("nvidia", "").split()[0]
    else:
        tag = f"cpu{os.cpu_count()}"
    return tag + ("_small" if small else "")


def sync(device) -> None:
    """Wait for the work queued on `device` (a CUDA device); nothing on a CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def bench_parser(doc: str, *, device: str = "cuda") -> argparse.ArgumentParser:
    """A parser with the options every device bench takes (its docstring as the help):
    --device cpu|cuda, --small (smoke-run sizes, "_small" reports) and --out-dir."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default=device)
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke run)")
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    return ap


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """rows as a markdown table of `columns` (floats to 3 significant digits)."""

    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(
        lines + ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    )


def write_results(
    theme: str,
    hardware: str,
    rows: list[dict],
    *,
    columns: list[str],
    title: str,
    notes: str = "",
    extra: dict | None = None,
    out_dir: str | os.PathLike | None = None,
) -> tuple[Path, Path]:
    """Write rows (dicts) to <theme>_<hardware>_<yyyymmdd>.json and .md; returns both paths.
    `extra` goes into the JSON only (raw figures a table would not show)."""
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv)
    stem = f"{theme}_{hardware}_{env['date_utc'][:10].replace('-', '')}"
    jpath, mpath = out / f"{stem}.json", out / f"{stem}.md"
    jpath.write_text(
        json.dumps(
            {"title": title, "command": command, "environment": env, "notes": notes, "rows": rows}
            | ({"extra": extra} if extra else {}),
            indent=1,
        )
        + "\n"
    )

    lines = [f"# {title}", "", f"Command: `{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", markdown_table(rows, columns)]
    if notes:
        lines += ["", notes]
    mpath.write_text("\n".join(lines) + "\n")
    return jpath, mpath


__all__ = [
    "Timing",
    "time_fn",
    "time_interleaved",
    "environment",
    "hardware_tag",
    "sync",
    "bench_parser",
    "markdown_table",
    "write_results",
    "RESULTS",
]
