"""The fixed cost of a `python -m real_py train` call, phase by phase, for two trees side by side.

    .venv/bin/python bench/bench_startup.py --base <commit> [--after <commit>] [--runs 5] [--steps 2] [--limit 120]
                                            [--extension path/to/_C.cpython-*.so]
                                            [--base-extension path/to/_C.cpython-*.so]

Each side is a git worktree of its commit (--after defaults to HEAD) in a temporary folder, with
the compiled extension copied in (--extension, default this checkout's; built from the two
commits' csrc/, which must not differ; when they do, --base-extension gives the base side one
built from the base commit's csrc/: `python setup.py build_ext --inplace` in a worktree of it). One untimed run per side first (byte-compiles the fresh
worktree); then the runs alternate (before, after, before, ...) so that load from other jobs on
a shared machine hits both alike; each run is `python -m real_py train --steps N
--no-progress` of the default job into a fresh out_dir, from the worktree's root. A run that fails
or is still running after --limit seconds (then killed: a start-up hang) is counted per side, not
timed. Phases come
from the wall-clock arrival of the command's output lines:

    launcher   start -> "launching ..."            imports, config validation, run-dir checks
    ranks      "launching" -> "world N; calls"     rank processes, their imports, process group, models
    steps      "world" -> "done:"                  the N training steps
    finish     "done:" -> "summary"                summary.json, event file closed
    exit       "summary" -> the command's exit     ranks' and launcher's shutdown
    fixed      total - steps

The report (medians per phase and side, every run's figures in the JSON) goes to
bench/results/startup_<hardware>_<yyyymmdd>.{md,json}.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from timing import hardware_tag, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("launcher", "ranks", "steps", "finish", "exit", "fixed", "total")
MARKS = (("launching", "launching "), ("world", "world "), ("done", "done: "), ("summary", "summary "))


def _git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _worktree(commit: str, where: str, extension: list[str]) -> str:
    _git("worktree", "add", "--detach", where, commit)
    for so in extension:
        shutil.copy2(so, os.path.join(where, "real_py", os.path.basename(so)))
    return where


class RunFailed(RuntimeError):
    """A `train` call that failed or did not end within the run's limit."""


def one_run(tree: str, steps: int, out_dir: str, limit_s: float) -> dict:
    """Seconds per phase of one `train` call in `tree`; RunFailed when it fails or is still
    running after `limit_s` (its process group is then killed)."""
    import signal
    import threading

    cmd = [sys.executable, "-m", "real_py", "train", "--steps", str(steps), "--no-progress", "--out-dir", out_dir]
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    killer = threading.Timer(limit_s, lambda: os.killpg(p.pid, signal.SIGKILL))
    killer.start()
    seen, tail = {}, []
    try:
        for line in p.stdout:
            now = time.perf_counter() - t0
            tail = (tail + [line])[-20:]
            for name, prefix in MARKS:
                if name not in seen and line.startswith(prefix):
                    seen[name] = now
        code = p.wait()
    finally:
        killer.cancel()
    end = time.perf_counter() - t0
    if code != 0 or len(seen) != len(MARKS):
        what = f"no end within {limit_s:.0f} s" if code == -signal.SIGKILL else f"exit {code}"
        raise RunFailed(f"{what}, marks seen {sorted(seen)}: {tail[-1].strip() if tail else ''}")
    ph = {"launcher": seen["launching"], "ranks": seen["world"] - seen["launching"],
          "steps": seen["done"] - seen["world"], "finish": seen["summary"] - seen["done"],
          "exit": end - seen["summary"], "total": end}
    ph["fixed"] = end - ph["steps"]
    return ph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit before the change")
    ap.add_argument("--after", default="HEAD", help="the commit after it (default HEAD)")
    ap.add_argument("--runs", type=int, default=5, help="runs per side (default 5)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--extension", help="the compiled extension to copy into both worktrees "
                    "(default: real_py/_C*.so of this checkout)")
    ap.add_argument("--base-extension", help="the compiled extension for the base side, built from its own "
                    "csrc/ (when csrc/ differs between the commits)")
    ap.add_argument("--out", help="results folder (default bench/results)")
    ap.add_argument("--limit", type=float, default=120.0,
                    help="seconds a run may take before it counts as hung and is killed (default 120)")
    args = ap.parse_args()
    ext = [args.extension] if args.extension else glob.glob(os.path.join(ROOT, "real_py", "_C*.so"))
    if not ext:
        raise SystemExit("no compiled extension: run make build, or pass --extension")
    base, after = _git("rev-parse", "--short", args.base), _git("rev-parse", "--short", args.after)
    base_ext = [args.base_extension] if args.base_extension else ext
    if not args.base_extension and _git("diff", "--stat", base, after, "--", "csrc", "setup.py"):
        raise SystemExit(f"csrc/ differs between {base} and {after}: the copied extension would not match one of them "
                         "(pass --base-extension)")
    tmp = tempfile.mkdtemp(prefix="bench_startup_")
    trees = {}
    try:
        trees = {"before": _worktree(base, os.path.join(tmp, "before"), base_ext),
                 "after": _worktree(after, os.path.join(tmp, "after"), ext)}
        runs = {side: [] for side in trees}
        failed = {side: [] for side in trees}
        for i in range(-1, args.runs):  # -1: the untimed warm-up run
            for side, tree in trees.items():
                try:
                    ph = one_run(tree, args.steps, os.path.join(tmp, f"out_{side}_{i}"), args.limit)
                except RunFailed as e:
                    failed[side].append({"run": i + 1, "error": str(e)})
                    print(f"run {i + 1} {side:6s} FAILED: {e}", flush=True)
                    continue
                if i >= 0:
                    runs[side].append(ph)
                    print(f"run {i + 1} {side:6s} " + " ".join(f"{k} {ph[k]:.2f}" for k in PHASES), flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if not all(runs.values()):
        raise SystemExit(f"no successful run on a side: {failed}")
    med = {side: {k: statistics.median(r[k] for r in rs) for k in PHASES} for side, rs in runs.items()}
    rows = [{"phase": k, f"before {base} (s)": med["before"][k], f"after {after} (s)": med["after"][k],
             "after / before": med["after"][k] / med["before"][k] if med["before"][k] else float("nan")}
            for k in PHASES]
    spread = {side: {k: (min(r[k] for r in rs), max(r[k] for r in rs)) for k in PHASES} for side, rs in runs.items()}
    notes = (f"Medians of the successful runs of {args.runs} per side, interleaved, of `python -m real_py train "
             f"--steps {args.steps} --no-progress` (the default job: 4 gloo ranks), after one untimed warm-up run "
             "per side. Failed or hung runs (warm-up included, "
             f"killed after {args.limit:.0f} s): "
             + "; ".join(f"{side} {len(f)} of {args.runs + 1}" + (" (" + "; ".join(f"run {x['run']}: {x['error']}"
                                                                                 for x in f) + ")" if f else "")
                         for side, f in failed.items())
             + ". Ranges (min-max): "
             + "; ".join(f"{side}: " + ", ".join(f"{k} {lo:.2f}-{hi:.2f}" for k, (lo, hi) in sp.items())
                         for side, sp in spread.items()))
    j, m = write_results("startup", hardware_tag("cpu"), rows,
                         columns=["phase", f"before {base} (s)", f"after {after} (s)", "after / before"],
                         title=f"Start-up and exit of `train`: {base} against {after}", notes=notes,
                         extra={"runs": runs, "failed": failed, "base": base, "after": after,
                                "limit_s": args.limit}, out_dir=args.out)
    print(f"wrote {m} and {j}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
