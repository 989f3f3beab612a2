"""What a training run leaves behind besides checkpoints: metrics.jsonl, TensorBoard events, an
optional W&B run, summary.json.

    <out_dir>/metrics.jsonl                one JSON record per step (rank 0)
    <out_dir>/events.out.tfevents.*        the same scalars for TensorBoard
                                           (`tensorboard --logdir <out_dir>`)
    <out_dir>/summary.json                 end-of-run summary (`summarize`), also printed

W&B is used only when the config has `wandb: {project: ..., ...}` (passed to `wandb.init`); the
package is imported only then. All of this runs on rank 0 only.

Every rank records each step as it runs: `MetricSums` (what the calls report, summed over the
world) and a `StepRecord` (call, reallocation and offload intervals, bytes, memory peaks),
gathered at the step's end and turned into the step's timings by `step_summary`.

One file past 400 lines: a step's numbers go from every rank's MetricSums (over METRICS) and
StepRecord, through step_summary, to the metrics.jsonl record that RunLog, scalars, read_metrics and
summarize write and read back, so the record's keys are defined and consumed in one place.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

RUN_FILES = ("metrics.jsonl", "summary.json", "samples.jsonl", "latest", "curves.png", "hf", "logs")
"""Names a run writes into out_dir, besides step_* directories and events.out.tfevents.* files
(logs: the ranks' logs and failure records of the last job, real_py/launch/job.py)."""

METRICS = (
    "reward",
    "kl",
    "response_length",
    "policy_loss",
    "value_loss",
    "clip_frac",
    "value_clip_frac",
    "entropy",
    # async mode (async.max_staleness >= 1): token-mean staleness (train version minus the
    # version that generated the token), rows dropped over the bound (a sum, see runtime),
    # and with async.check_versions the mean |behaviour log-prob - recomputation| with the
    # recorded version's weights / with the newest weights.
    "staleness",
    "rows_dropped_step",
    "interrupted",
    "version_err",
    "version_err_newest",
    # MoE models: the load-balancing aux loss of each train step (transformers' formula, in
    # the actor's / critic's loss with the config's router_aux_loss_coef)
    "moe_aux_loss",
    # vLLM generation: the token mean of |old_logp - rollout_logp| (the trainer's recompute
    # against vLLM's log-prob of each sampled token), the k3 estimate of KL(pi_vllm ||
    # pi_train) per token, and with ppo.tis_cap the share of tokens whose weight was capped
    "rollout_logp_diff",
    "rollout_kl",
    "tis_capped_frac",
)
"""Per-step metrics every call may add to (sum, count) rows of the step's MetricSums, in this order.
Per iteration: reward, kl (sum over response tokens of log pi_old - log pi_ref) and
response_length are means over sequences; policy_loss / value_loss means over optimizer steps
(each the token mean of its mini-batch); clip fractions and entropy means over response tokens
of every mini-batch pass."""


@dataclass(slots=True)
class MetricSums:
    """A step's (sum, count) of every METRICS entry, in that order, plus one row past them: the
    sum of squared raw scores (reward.normalize). Calls add to it on their reporter ranks; the
    runtime sums `t` over the world at the step's end."""

    t: torch.Tensor = field(
        default_factory=lambda: torch.zeros(len(METRICS) + 1, 2, dtype=torch.float64)
    )

    def add(self, name: str, value: float, count: float) -> None:
        self.t[METRICS.index(name), 0] += value
        self.t[METRICS.index(name), 1] += count

    def add_squared_scores(self, value: float, count: float) -> None:
        self.t[len(METRICS), 0] += value
        self.t[len(METRICS), 1] += count

    def total(self, name: str) -> float:
        return float(self.t[METRICS.index(name), 0])

    def means(self) -> dict[str, float]:
        """Mean of every metric with a count."""
        return {
            m: (s / c if c else float("nan")) for m, (s, c) in zip(METRICS, self.t.tolist()) if c
        }

    def reward_moments(self) -> torch.Tensor:
        """[sum, sum of squares, count] of the step's raw scores."""
        r = METRICS.index("reward")
        return torch.tensor(
            [self.t[r, 0], self.t[len(METRICS), 0], self.t[r, 1]], dtype=torch.float64
        )


class Event(NamedTuple):
    """An interval on one rank: a call's run (name: the call), a reallocation for a call
    ("realloc:<call>", async mode) or a weight receive thread ("recv_thread:<call>")."""

    rank: int
    name: str
    start: float
    end: float


class Realloc(NamedTuple):
    """One rank's part of a reallocation of `model` into the layout of `call`."""

    model: str
    call: str
    start: float
    end: float
    sent_bytes: int


class Offload(NamedTuple):
    """A frozen model's reload before its call and offload after it, on one rank."""

    model: str
    seconds: float
    nbytes: int


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """What one rank recorded of a step; the runtime gathers every rank's at the step's end."""

    events: list[Event] = field(default_factory=list)
    reallocs: list[Realloc] = field(default_factory=list)
    offloads: list[Offload] = field(default_factory=list)
    peak_mem_mib: dict[str, float] = field(default_factory=dict)  # per call (CUDA only)
    data_bytes: int = 0  # row pushes sent


def step_summary(records: list[StepRecord], order: list[str], sync_free: set[str]) -> dict:
    """The step's timings and volumes from every rank's record: "calls" (per call, in `order`),
    "realloc_seconds" (per model), "realloc_bytes", "offload_seconds" (per frozen model),
    "offload_bytes", "data_bytes", "peak_mem_mib" (per call) and "events" (every rank's).

    A call's (a reallocation's) seconds run from the moment its last rank enters it to the
    moment its last rank leaves, summed over its runs: a rank that arrives late from earlier
    work (rank 0 writing the previous step's logs) is not charged to the call its peers wait in.
    Wall clocks of the ranks are compared, as for the async overlap figures. A call in
    `sync_free` (its ranks never wait for each other, see sync_free_calls) has no such wait to
    leave out: its seconds are its longest rank's own run, since the spread of the ranks' start
    times is not part of its work."""
    events, spans, r_spans, own = [], {}, {}, {}
    r_bytes, o_sec, o_bytes, d_bytes, peak = 0, {}, 0, 0, {}
    for rec in records:
        events += rec.events
        for name, mib in rec.peak_mem_mib.items():
            peak[name] = max(peak.get(name, 0.0), mib)
        # The k-th run of a call on this rank (a refill round runs it again), and the k-th
        # reallocation of a model for a call: the same run on every rank that takes part.
        seen = Counter()
        for _, name, a, b in rec.events:
            if b > a:  # not a rank's marker of a run it had no rows for
                _span(spans, (name, seen[name]), a, b)
                own[name, seen[name]] = max(own.get((name, seen[name]), 0.0), b - a)
            seen[name] += 1
        for model, call, a, b, nbytes in rec.reallocs:
            _span(r_spans, (model, call, seen[model, call]), a, b)
            seen[model, call] += 1
            r_bytes += nbytes
        for model, sec, nbytes in rec.offloads:
            o_sec[model] = max(o_sec.get(model, 0.0), sec)
            o_bytes += nbytes
        d_bytes += rec.data_bytes
    calls, r_sec = {}, {}
    for (name, k), (a, b) in spans.items():
        calls[name] = calls.get(name, 0.0) + (
            own[name, k] if name in sync_free else max(b - a, 0.0)
        )
    for (model, _, _), (a, b) in r_spans.items():
        r_sec[model] = r_sec.get(model, 0.0) + max(b - a, 0.0)
    return {
        "calls": {n: calls[n] for n in order if n in calls},
        "realloc_seconds": r_sec,
        "realloc_bytes": r_bytes,
        "offload_seconds": o_sec,
        "offload_bytes": o_bytes,
        "data_bytes": d_bytes,
        "peak_mem_mib": {n: peak[n] for n in order if n in peak},
        "events": events,
    }


def sync_free_calls(graph, plan) -> set[str]:
    """Calls whose ranks never wait for each other while they run: rollout calls (generation,
    inference) on dp replicas alone (tp = pp = 1 and no expert group across replicas, ep = etp =
    1: no collective inside the call; each rank runs its own rows). Synchronous mode only: in
    async mode a generation's rank may wait for the next weights' receive thread (the trainer
    ranks) inside the call."""
    out = set()
    for n in graph.order:
        lay = plan.calls[n]
        if not graph.calls[n].trains and lay.tp == lay.pp == lay.ep == lay.etp == 1:
            out.add(n)
    return out


def _span(spans: dict, key, start: float, end: float) -> None:
    """Widen spans[key] to (latest start, latest end) over the ranks."""
    a, b = spans.get(key, (start, end))
    spans[key] = (max(a, start), max(b, end))


def open_nofollow(path: str, append: bool = False):
    """`path` opened for writing text ("a" or "w") without following a symbolic link: a link
    planted at a run file's name (metrics.jsonl, samples.jsonl, summary.json, bench --out) is
    refused with ValueError naming it instead of writing into whatever it points to."""
    import errno

    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(
                f"{path} is a symbolic link; real_py writes its output files itself, "
                "never through a link: remove the link or choose another path"
            ) from None
        raise
    return os.fdopen(fd, "a" if append else "w")


def check_no_links(out_dir: str) -> None:
    """ValueError naming the first entry a run writes in out_dir (RUN_FILES, step_*) that is a
    symbolic link; run by the launcher before any rank starts."""
    if not os.path.isdir(out_dir):
        return
    for n in run_entries(out_dir):
        p = os.path.join(out_dir, n)
        if os.path.islink(p) and n not in ("hf", "curves.png"):
            raise ValueError(
                f"{p} is a symbolic link; a run writes its files and step directories "
                "itself, never through a link: remove the link or choose another out_dir"
            )


def run_entries(out_dir: str) -> list[str]:
    """The entries of out_dir that a previous run wrote (empty if out_dir does not exist)."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(
        n
        for n in os.listdir(out_dir)
        if n in RUN_FILES or n.startswith(("step_", "events.out.tfevents."))
    )


def scalars(rec: dict) -> dict[str, float]:
    """The per-step scalars of a metrics.jsonl record, by TensorBoard / W&B tag."""
    out = {f"train/{k}": v for k, v in rec["metrics"].items()}
    out["time/step_seconds"] = rec["seconds"]
    out.update({f"time/call/{k}": v for k, v in rec["calls"].items()})
    out.update({f"time/realloc/{k}": v for k, v in rec["realloc_seconds"].items()})
    out["bytes/realloc"] = rec["realloc_bytes"]
    out["bytes/data"] = rec["data_bytes"]
    return out


def wandb_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


class RunLog:
    """Rank 0's writer: `log(rec)` per step, `close()` at the end (returns the summary)."""

    def __init__(self, out_dir: str, *, wandb: dict | None = None, config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl")
        self.tb = SummaryWriter(log_dir=out_dir)
        self.wandb = None
        if wandb is not None:  # config validation checked that the package is installed
            import wandb as wb

            self.wandb = wb.init(**{"config": config, **wandb})

    def log(self, rec: dict) -> None:
        with open_nofollow(self.metrics_path, append=True) as f:
            f.write(json.dumps(rec) + "\n")
        vals = scalars(rec)
        for tag, v in vals.items():
            self.tb.add_scalar(tag, v, rec["step"])
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(vals, step=rec["step"])

    def close(self) -> dict:
        self.tb.close()
        summary = summarize(read_metrics(self.out_dir))
        with open_nofollow(os.path.join(self.out_dir, "summary.json")) as f:
            json.dump(summary, f, indent=1)
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
        return summary


def cut_after(path: str, step: int) -> int:
    """Keep only the records of a JSON-lines file (metrics.jsonl, samples.jsonl) with "step" <=
    `step`; returns how many were dropped. A resumed run re-runs the steps after its checkpoint,
    so their first records must go (else a step appears twice). A line that is not JSON (a run
    killed mid-write) is dropped too. The file is rewritten through a temporary file and
    os.replace, so a kill here leaves the old or the new file, never half of one."""
    import tempfile

    if not os.path.lexists(path):
        return 0
    if os.path.islink(path):
        raise ValueError(
            f"{path} is a symbolic link; a run never reads or writes its files through one"
        )
    keep, dropped = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line)
                ok = (
                    isinstance(rec, dict)
                    and isinstance(rec.get("step"), int)
                    and rec["step"] <= step
                )
            except ValueError:  # not JSON / not UTF-8
                ok = False
            if ok:
                keep.append(line if line.endswith(b"\n") else line + b"\n")
            elif line.strip():
                dropped += 1
    if dropped:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".cut.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.writelines(keep)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return dropped


def read_metrics(out_dir: str) -> list[dict]:
    """metrics.jsonl records by step; a step logged twice (a resumed run redoing it) keeps the
    later record."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{out_dir}: no metrics.jsonl (not a train run directory?)")
    by_step = {}
    with open(path) as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"{path} line {i + 1} is not JSON") from None
                by_step[rec["step"]] = rec
    if not by_step:
        raise ValueError(f"{path} has no records")
    return [by_step[k] for k in sorted(by_step)]


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(recs: list[dict]) -> dict:
    """Reward and KL over the first and last window (a quarter of the steps, 1 to 10 steps),
    seconds per step (mean, and mean without the first step, which includes warm-up), and the
    reallocation share: sum over models of the slowest rank's reallocation seconds, over the step
    seconds, averaged over steps."""
    n = len(recs)
    w = max(1, min(10, n // 4))
    first, last = recs[:w], recs[-w:]

    def metric(rs, k):
        return _mean(r["metrics"].get(k) for r in rs)

    secs = [r["seconds"] for r in recs]
    return {
        "steps": [recs[0]["step"], recs[-1]["step"]],
        "window": w,
        "reward_first": metric(first, "reward"),
        "reward_last": metric(last, "reward"),
        "kl_first": metric(first, "kl"),
        "kl_last": metric(last, "kl"),
        "entropy_last": metric(last, "entropy"),
        "seconds_per_step": _mean(secs),
        "seconds_per_step_after_first": _mean(secs[1:]) if n > 1 else secs[0],
        "realloc_share": _mean(sum(r["realloc_seconds"].values()) / r["seconds"] for r in recs),
        "realloc_bytes_per_step": _mean(r["realloc_bytes"] for r in recs),
    }


def format_summary(s: dict) -> str:
    return (
        f"summary (steps {s['steps'][0]}-{s['steps'][1]}, window {s['window']}): reward "
        f"{s['reward_first']:.4g} -> {s['reward_last']:.4g}, "
        f"kl {s['kl_first']:.4g} -> {s['kl_last']:.4g}, "
        f"{s['seconds_per_step']:.3f} s/step "
        f"({s['seconds_per_step_after_first']:.3f} after the first), "
        f"reallocation {100 * s['realloc_share']:.1f}% of the step"
    )


__all__ = [
    "METRICS",
    "MetricSums",
    "Event",
    "Realloc",
    "Offload",
    "StepRecord",
    "step_summary",
    "sync_free_calls",
    "RunLog",
    "read_metrics",
    "cut_after",
    "open_nofollow",
    "check_no_links",
    "summarize",
    "format_summary",
    "run_entries",
    "scalars",
    "RUN_FILES",
]
