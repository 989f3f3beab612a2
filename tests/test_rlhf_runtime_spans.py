"""Checks how the runtime turns every rank's call and reallocation intervals into the step's
per-call and per-model seconds (observe.step_summary): a call runs from its last rank's start to its
last rank's end, summed over its runs; a rank that arrives late from earlier work opens the span;
a call whose ranks never wait for each other (dp-only rollout calls, synchronous mode) counts its
longest rank's own run;
a rank's marker of a run it had no rows for (a dynamic-sampling refill round) does not; runs are
matched across ranks by their order. A failure points to real_py/rlhf/observe.py (step_summary,
sync_free_calls), real_py/rlhf/runtime.py (_call) or real_py/rlhf/calls.py (run_call's return
value).
"""

from types import SimpleNamespace

import pytest

from real_py.layout import Layout
from real_py.rlhf.observe import StepRecord, step_summary, sync_free_calls

ORDER = ["actor_gen", "ref_inf", "rew_inf", "actor_train"]
TP2 = Layout(tp=2, ranks=(0, 1))


def summary(per_rank, layouts=None, asynchronous=False):
    """per_rank: list of (events, reallocs); the rest of each rank's record empty. Every call on
    tp=2 (its ranks wait for each other) unless `layouts` says otherwise. As the runtime does,
    no call is sync-free in async mode."""
    graph = SimpleNamespace(
        order=ORDER, calls={n: SimpleNamespace(trains=n.endswith("train")) for n in ORDER}
    )
    plan = SimpleNamespace(calls={n: (layouts or {}).get(n, TP2) for n in ORDER})
    free = set() if asynchronous else sync_free_calls(graph, plan)
    return step_summary([StepRecord(events=ev, reallocs=rl) for ev, rl in per_rank], ORDER, free)


def test_span_from_last_start_to_last_end():
    # rank 1 arrives 5 s late at actor_gen (rank 0 waited for it): the call took 2 s, not 7.
    out = summary([([(0, "actor_gen", 0.0, 7.0)], []), ([(1, "actor_gen", 5.0, 7.0)], [])])
    assert out["calls"] == {"actor_gen": pytest.approx(2.0)}


def test_a_call_without_waits_counts_its_longest_rank():
    # dp-only generation: rank 1 entered 5 s late (its earlier work), each rank ran its own rows
    # for 7 s and 2 s; no rank waited for the other, so the call took 7 s (its span from the last
    # start: 2 s). Training on the same dp-only layout reduces gradients (waits): its span.
    dp2 = Layout(dp=2, ranks=(0, 1))
    lay = {"actor_gen": dp2, "ref_inf": dp2, "actor_train": dp2}
    r0 = [(0, "actor_gen", 0.0, 7.0), (0, "ref_inf", 7.0, 8.0), (0, "actor_train", 8.0, 12.0)]
    r1 = [(1, "actor_gen", 5.0, 7.0), (1, "ref_inf", 7.0, 7.5), (1, "actor_train", 10.0, 12.0)]
    calls = summary([(r0, []), (r1, [])], lay)["calls"]
    assert calls == {
        "actor_gen": pytest.approx(7.0),
        "ref_inf": pytest.approx(1.0),  # (ref_inf: both 1 s)
        "actor_train": pytest.approx(2.0),
    }
    # runs are summed per run, each its longest rank's
    two = (
        [(0, "ref_inf", 0.0, 1.0), (0, "ref_inf", 10.0, 10.2)],
        [(1, "ref_inf", 0.5, 1.0), (1, "ref_inf", 10.0, 10.5)],
    )
    assert summary([(two[0], []), (two[1], [])], lay)["calls"]["ref_inf"] == pytest.approx(
        1.0 + 0.5
    )
    # async mode (a generation may wait inside the call for the next weights' receive thread): spans
    assert summary([(r0, []), (r1, [])], lay, asynchronous=True)["calls"][
        "actor_gen"
    ] == pytest.approx(2.0)
    # a pp or tp layout, or an expert group across the replicas (ep, etp), has waits inside the call
    for other in (
        Layout(dp=1, pp=2, ranks=(0, 1)),
        TP2,
        Layout(dp=2, ep=2, ranks=(0, 1)),
        Layout(dp=2, etp=2, ranks=(0, 1)),
    ):
        assert summary([(r0, []), (r1, [])], {"actor_gen": other})["calls"][
            "actor_gen"
        ] == pytest.approx(2.0)


def test_runs_are_summed_and_matched_by_order():
    # Two runs of ref_inf (a refill round runs it again) on both ranks.
    r0 = [(0, "ref_inf", 0.0, 1.0), (0, "ref_inf", 10.0, 10.5)]
    r1 = [(1, "ref_inf", 0.2, 1.1), (1, "ref_inf", 10.1, 10.4)]
    assert summary([(r0, []), (r1, [])])["calls"]["ref_inf"] == pytest.approx(0.9 + 0.4)


def test_a_rank_without_rows_does_not_open_the_span():
    # The reviewer's case: rank 0 does ref_inf 10-20 s, then has no rew_inf rows (marker at 20);
    # rank 1 has no ref_inf rows (marker at 10) and does rew_inf 11-15 s.
    r0 = [(0, "ref_inf", 10.0, 20.0), (0, "rew_inf", 20.0, 20.0)]
    r1 = [(1, "ref_inf", 10.0, 10.0), (1, "rew_inf", 11.0, 15.0)]
    calls = summary([(r0, []), (r1, [])])["calls"]
    assert calls == {"ref_inf": pytest.approx(10.0), "rew_inf": pytest.approx(4.0)}
    assert list(calls) == ["ref_inf", "rew_inf"]  # graph order


def test_reallocations_are_spans_summed_per_model():
    # actor moved twice (for actor_gen, then for ref_inf), critic once; rank 1 only sends.
    r0 = [("actor", "actor_gen", 0.0, 1.0, 100), ("actor", "ref_inf", 5.0, 5.5, 10)]
    r1 = [("actor", "actor_gen", 0.4, 0.9, 50), ("critic", "critic_inf", 2.0, 3.0, 7)]
    out = summary([([], r0), ([], r1)])
    assert out["realloc_seconds"] == {
        "actor": pytest.approx(0.6 + 0.5),
        "critic": pytest.approx(1.0),
    }
    assert out["realloc_bytes"] == 167


def test_async_events_other_than_calls_are_not_calls():
    ev = [
        (0, "realloc:actor_gen", 0.0, 1.0),
        (0, "recv_thread:actor_gen", 0.0, 3.0),
        (0, "actor_gen", 1.0, 2.0),
    ]
    assert summary([(ev, [])])["calls"] == {"actor_gen": pytest.approx(1.0)}
