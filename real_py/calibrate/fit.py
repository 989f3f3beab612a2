"""Fitting calibration timings to the fields of a HardwareProfile: per-layer and per-pass seconds
(`fit_single`: least-squares slopes over the layer counts after removing the roofline compute),
then the collective, contention and pipeline fields of phases A and B (measure.py's docstring),
and the `cpu` profile of recorded measurements (`profile_from_raw`). Pure: no processes, no
timing, so recorded calibrations can be refitted (bench_estimator.py --refit).
"""

from __future__ import annotations

import statistics
from dataclasses import fields

from ..search.costmodel import HEAD_COLLS, fwd_flops
from ..search.hardware import HardwareProfile
from ..search.realloc_cost import transfer_time
from ..spec import model_spec
from .setup import DEFAULT, LAYERS, PP_LAYERS, G, Setup, realloc_plan


def _fit_line(points: dict) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through {x: y}."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def _decode_slope(raw: dict, prefix: str) -> tuple[float, float]:
    """(per layer, per step) of a decode step: generate(n) = prefill + (n - 1) decode steps;
    the decode FLOPs are negligible here."""
    lo, hi = G
    step = {
        L: (raw[f"{prefix}gen{hi}_{L}"] - raw[f"{prefix}gen{lo}_{L}"]) / (hi - lo) for L in LAYERS
    }
    per_layer = max(_fit_line(step)[0], 0.0)
    return per_layer, max(statistics.mean(step[L] - L * per_layer for L in LAYERS), 0.0)


def fit_single(raw: dict, flops: float, cal: Setup = DEFAULT) -> dict:
    """The one-rank fields (per-layer and per-pass seconds of inference, train steps and decode
    steps) from the engine timings (slope over LAYERS), after removing the calibration model's
    roofline compute (FLOPs at `flops` per second)."""

    def net(key: str, L: int, passes: int, head: str = "lm") -> float:
        """The timing minus the roofline FLOPs of its passes (of the model with that head). The
        optimizer's modelled memory traffic is not subtracted: on these small layers the update
        costs dispatch, not bandwidth, and subtracting it makes the estimates of the default
        job's train calls 15-35% too fast (bench_estimator)."""
        rows = cal.train_rows if passes == 3 else cal.rows
        return max(
            raw[key]
            - passes
            * fwd_flops(model_spec(cal.config(L, head)), rows * cal.seq, cal.seq / 2)
            / flops,
            0.0,
        )

    def line(prefix: str, passes: int) -> tuple[float, float, float]:
        """(per layer, per pass of the lm head, per pass of the value head). The layers are the
        same under both heads: one slope, averaged over them; each head's fixed part is what is
        left of its timings at both layer counts (the lm head's log-probs and entropy over the
        vocabulary cost more than a value head's one output per token)."""
        t = {
            (h, L): net(f"{h}_{prefix}_{L}", L, passes, h) for h in ("lm", "value") for L in LAYERS
        }
        per_layer = max(
            statistics.mean(_fit_line({L: t[h, L] for L in LAYERS})[0] for h in ("lm", "value")),
            0.0,
        )
        fixed = [
            max(statistics.mean(t[h, L] - L * per_layer for L in LAYERS), 0.0)
            for h in ("lm", "value")
        ]
        return per_layer, fixed[0], fixed[1]

    layer, head, value_head = line("inf", 1)
    train_layer, train, value_train = line("train", 3)
    decode_layer, decode = _decode_slope(raw, "")
    return {
        "layer_lat": layer,
        "head_lat": head,
        "value_head_lat": value_head,
        "train_layer_lat": train_layer,
        "train_lat": train,
        "value_train_lat": value_train,
        "decode_layer_lat": decode_layer,
        "decode_lat": decode,
    }


def _pipe_wait(raw: dict) -> float:
    """Phase B's pp=2 engines on every pair at once (one working stage per pair, as many as cores)
    against phase A's pairs (half as many): the extra seconds of an inference pass and of a
    decode step, each with two hand-overs between the stages (the activation hop and the last
    stage's broadcast), per hand-over; their mean, in [0, one uncontended pp=2 inference pass]
    (a longer wait per message would be a disturbed calibration). The decode step is left out
    when a difference of generation timings drowns in noise (<= 0). 0 for recorded calibrations
    without these timings.

    A wait per hand-over rather than a stretch of the whole pass (busy / alone - 1): a woken stage
    waits for a core once per hand-over, however much work its stage then does, and a stretch
    measured on these short passes over-charges the longer train steps of a dp2 x pp2 plan
    (bench/results/estimator_rescore_cpu2_20261205.md)."""
    Lp, (lo, hi) = PP_LAYERS, G
    if f"pp2busy_inf_{Lp}" not in raw:
        return 0.0
    extra = [raw[f"pp2busy_inf_{Lp}"] - raw[f"pp2_inf_{Lp}"]]
    step, busy_step = (
        (raw[f"{k}_gen{hi}_{Lp}"] - raw[f"{k}_gen{lo}_{Lp}"]) / (hi - lo)
        for k in ("pp2", "pp2busy")
    )
    if step > 0 and busy_step > 0:
        extra.append(busy_step - step)
    return min(max(statistics.mean(extra) / 2, 0.0), raw[f"pp2_inf_{Lp}"])


def _fit(raw: dict, prof_kw: dict, cal: Setup = DEFAULT) -> dict:
    """fit_single's fields, and the collective, contention and pipeline fields of phases A and B."""
    single = fit_single(raw, prof_kw["peak_flops"] * prof_kw["flops_eff"], cal)
    decode_layer, decode = single["decode_layer_lat"], single["decode_lat"]
    lo, hi = G
    tp_decode_layer, tp_decode = _decode_slope(raw, "tp2_")
    busy_decode_layer, _ = _decode_slope(raw, "tp2busy_")
    slope, fixed = {}, {}
    for k in ("lm_inf", "tp2_inf", "lm_train", "tp2_train", "tp2busy_inf"):
        slope[k], fixed[k] = _fit_line({L: raw[f"{k}_{L}"] for L in LAYERS})
    # The tp=2 engine's extra seconds per layer over the same lm engine on one rank are its
    # collectives: 2 all-reduces per layer in inference and decode steps, 4 in a train step
    # (forward and backward). One latency, least squares over the three.
    extra = [
        (2, slope["tp2_inf"] - slope["lm_inf"]),
        (2, tp_decode_layer - decode_layer),
        (4, slope["tp2_train"] - slope["lm_train"]),
    ]
    coll = max(sum(n * e for n, e in extra) / sum(n * n for n, _ in extra), 1e-6)
    # Phase B: with c busy ranks per core the per-layer work takes c times as long; the rest of
    # the growth of the tp=2 slope is the collective latency's.
    c = prof_kw["shared_cores"] and max(1.0, raw["ranks"] / prof_kw["shared_cores"])  # phase B
    busy_coll = (
        statistics.mean(
            [slope["tp2busy_inf"] - c * slope["lm_inf"], busy_decode_layer - c * decode_layer]
        )
        / 2
    )
    lat_contention = max((busy_coll / coll - 1.0) / (c - 1.0), 0.0) if c > 1 else 0.0
    # The pp=2 engine (PP_LAYERS layers) over the same layers on one rank: per inference pass one
    # activation hop and one result broadcast, per decode step one hop and one token broadcast.
    Lp = PP_LAYERS
    pp_step = (raw[f"pp2_gen{hi}_{Lp}"] - raw[f"pp2_gen{lo}_{Lp}"]) / (hi - lo)
    pp_extra = statistics.mean(
        [
            raw[f"pp2_inf_{Lp}"] - (fixed["lm_inf"] + Lp * slope["lm_inf"]),
            pp_step - (decode + Lp * decode_layer),
        ]
    )
    # Both are point-to-point messages (a broadcast over two ranks is one send): half each.
    p2p_ratio = max(pp_extra / 2, 0.01 * coll) / coll
    # Phase B: a collective over all ranks against one over pairs, both with every rank busy.
    growth = max(
        (raw["allreduce_world_s"] / raw["allreduce_pair_s"] - 1.0) / (raw["ranks"] - 2), 0.0
    )
    # What tensor parallelism adds outside the layers beyond the collectives the cost model
    # counts (HEAD_COLLS per pass, one all-gather per decode step): gathers of Python objects,
    # masking and slicing of the vocab-parallel head.
    return single | {
        "intra_lat": coll,
        "lat_contention": lat_contention,
        "p2p_lat_ratio": p2p_ratio,
        "coll_lat_growth": growth,
        "pipe_wait_lat": _pipe_wait(raw) if c > 1 else 0.0,
        "tp_head_lat": max(fixed["tp2_inf"] - fixed["lm_inf"] - HEAD_COLLS * coll, 0.0),
        "tp_train_lat": max(fixed["tp2_train"] - fixed["lm_train"] - 2 * HEAD_COLLS * coll, 0.0),
        "tp_decode_lat": max(tp_decode - decode - coll, 0.0),
    }


def profile_from_raw(raws: list[dict], cal: Setup = DEFAULT) -> HardwareProfile:
    """The `cpu` profile of recorded calibrations (calibrate_cpu's raw["repeats"]): each fitted
    alone, every field the median; `bench_estimator.py --rescore --refit` fits a recorded run's
    calibrations with this code. (A fit of the engines' own FLOP rate from passes at 1x and 4x
    the rows measures worse on the same measurements than the matmul roofline used here:
    bench/results/calibration_rate_ab_cpu2_20261204.md.)"""
    profs = [_profile(raw, cal) for raw in raws]
    kw = {}
    for f in fields(HardwareProfile):
        vals = [getattr(p, f.name) for p in profs]
        kw[f.name] = statistics.median(vals) if isinstance(vals[0], float) else vals[0]
    return HardwareProfile(**kw)


def _profile(raw: dict, cal: Setup = DEFAULT) -> HardwareProfile:
    """The profile fitted from one calibration's raw measurements."""
    # Efficiency factors are 1: the measured numbers already are what the runtime achieves.
    # All ranks share one machine (one "node" of up to 64 ranks; intra == inter).
    kw = dict(
        name="cpu",
        peak_flops=raw["matmul_flops"],
        flops_eff=1.0,
        hbm_bw=raw["memcpy_bytes_per_s"],
        hbm_eff=1.0,
        intra_bw=raw["bw_bytes_per_s"],
        inter_bw=raw["bw_bytes_per_s"],
        mem_bytes=float(raw["mem_bytes"]),
        mem_usable=0.5,
        ranks_per_node=64,
        shared_cores=raw["cpus"],
    )
    kw |= _fit(raw, kw, cal)
    kw["inter_lat"] = kw["intra_lat"]
    # transfer_time scales (transfer + realloc_lat) by the contention of the plan's ranks.
    plan = realloc_plan(raw["ranks"], cal)
    kw["realloc_lat"] = max(
        raw["realloc_s"] / HardwareProfile(**kw).contention(raw["ranks"])
        - transfer_time(plan, HardwareProfile(**kw | {"shared_cores": 0})),
        0.0,
    )
    return HardwareProfile(**kw)
