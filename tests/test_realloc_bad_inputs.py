# Checks that bad inputs to the library API (Layout, plan_realloc, check_fits, ModelShard,
# Reallocator, reallocate_params/flat, shard_from_params, load_hf_shard, ParallelGroups) raise one
# clear TypeError/ValueError naming the argument or file, and leave their inputs untouched.
# A failure points to the argument checks in real_py/layout/ (grid.py, fits.py), plan.py, shard.py,
# reallocator.py, embed.py, hf.py or parallel.py.
"""Table-driven: each case is (id, call, exception type, regex of the message, inputs to compare
before/after). Everything runs in-process; no case reaches a collective (the meta-tensor case
used to hang in the transfer until its timeout)."""

import os

import pytest
import torch
from support import models_oracle as O
from support.oracle import random_full, tiny_spec

from real_py import Layout, ModelConfig, ModelShard, check_fits, plan_realloc
from real_py.interop.embed import reallocate_flat, reallocate_params, shard_from_params
from real_py.interop.hf import load_hf_shard
from real_py.parallel import ParallelGroups
from real_py.realloc.reallocator import Reallocator, run_in_process
from real_py.realloc.transports import InProcessHub

SPEC = tiny_spec()
SAME_NAME = tiny_spec(bias=True, name=SPEC.name)  # another model that carries the same name
CFG = ModelConfig(**O.TINY)
SRC, DST = Layout(), Layout(tp=2)
FULL = random_full(SPEC, 0)


def _realloc():
    return Reallocator(plan_realloc(SPEC, SRC, DST), InProcessHub(timeout=5).transport(0))


def _src_params():
    return {k: v.clone() for k, v in ModelShard.from_full(SPEC, SRC, 0, FULL).params().items()}


def _replaced(dtype, extra=0, shard=None):
    """A shard whose `flat` was swapped after construction for a buffer of another dtype or size
    (the constructor's checks never saw it)."""
    shard = shard or ModelShard.from_full(SPEC, SRC, 0, FULL)
    n = shard.flat.numel() + extra
    shard.flat = torch.cat([shard.flat, shard.flat])[:n].to(dtype)
    return shard


def _cases(tmp):
    """(id, fn, exc, phrase, inputs): `inputs` are tensors/files the call must leave unchanged."""
    flat = ModelShard.from_full(SPEC, SRC, 0, FULL).flat
    long_flat = torch.cat([flat, torch.zeros(1)])
    strided = torch.stack([flat, flat], 1).reshape(-1)[::2]
    params = _src_params()
    meta = {k: torch.empty(v.shape, device="meta") for k, v in params.items()}
    other = ModelShard.from_full(SAME_NAME, SRC, 0, random_full(SAME_NAME, 1))
    freed = ModelShard.from_full(SPEC, SRC, 0, FULL)
    freed.flat.untyped_storage().resize_(0)  # what free_source=True / HostOffload leave behind
    truncated = tmp / "truncated"
    O.make_checkpoint(str(truncated))
    st = truncated / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    garbage = tmp / "garbage"
    O.make_checkpoint(str(garbage))
    (garbage / "model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}..."
    )
    cfg_hf = ModelConfig.from_hf(str(truncated))
    M = r"model must be a real_py.ModelSpec \(build one with real_py.model_spec\(config\)\), got "
    return [
        # Layout
        (
            "layout rank None",
            lambda: Layout(dp=2, ranks=(0, None)),
            ValueError,
            r"Layout.ranks\[1\]=None \(NoneType\); every rank must be an int",
            [],
        ),
        (
            "layout rank float",
            lambda: Layout(dp=2, ranks=(0, 1.5)),
            ValueError,
            r"Layout.ranks\[1\]=1.5",
            [],
        ),
        (
            "layout rank str",
            lambda: Layout(dp=2, ranks=("0", 1)),
            ValueError,
            r"Layout.ranks\[0\]='0' \(str\)",
            [],
        ),
        (
            "layout rank bool",
            lambda: Layout(dp=2, ranks=(0, True)),
            ValueError,
            r"Layout.ranks\[1\]=True",
            [],
        ),
        (
            "layout rank 2**40",
            lambda: Layout(dp=2, ranks=(0, 2**40)),
            ValueError,
            r"Layout.ranks\[1\]=1099511627776 is outside \[0, 1048576\)",
            [],
        ),
        (
            "layout rank negative",
            lambda: Layout(dp=2, ranks=(0, -1)),
            ValueError,
            r"Layout.ranks\[1\]=-1 is outside",
            [],
        ),
        (
            "layout ranks scalar",
            lambda: Layout(ranks=5),
            TypeError,
            "Layout.ranks must be a sequence",
            [],
        ),
        (
            "layout ranks string",
            lambda: Layout(dp=2, ranks="01"),
            TypeError,
            "Layout.ranks must be a sequence",
            [],
        ),
        (
            "layout parse repeated axis",
            lambda: Layout.parse("dp2,dp4"),
            ValueError,
            r"cannot parse layout 'dp2,dp4': axis dp given more than once",
            [],
        ),
        (
            "layout parse repeated axes",
            lambda: Layout.parse("tp2 pp2 tp=4 pp1"),
            ValueError,
            "axis pp, tp given more",
            [],
        ),
        ("layout order int", lambda: Layout(order=3), ValueError, "Layout.order=3; allowed", []),
        (
            "layout dp bool",
            lambda: Layout(dp=True),
            ValueError,
            "Layout.dp=True must be a positive int",
            [],
        ),
        (
            "config pad_token_id outside vocab",
            lambda: ModelConfig(**O.TINY, pad_token_id=97),
            ValueError,
            r"ModelConfig.pad_token_id=97 is outside the vocabulary \(vocab_size=97",
            [],
        ),
        # ModelSpec / Layout arguments
        (
            "plan_realloc config",
            lambda: plan_realloc(CFG, SRC, DST),
            TypeError,
            M + "ModelConfig",
            [],
        ),
        (
            "plan_realloc name",
            lambda: plan_realloc("llama-7b", SRC, DST),
            TypeError,
            M + "str 'llama-7b'",
            [],
        ),
        (
            "plan_realloc src str",
            lambda: plan_realloc(SPEC, "dp1", DST),
            TypeError,
            r"src must be a real_py.Layout \(parse a string with real_py.Layout.parse\), "
            r"got str 'dp1'",
            [],
        ),
        (
            "plan_realloc dst str",
            lambda: plan_realloc(SPEC, SRC, "tp2"),
            TypeError,
            "dst must be a real_py.Layout",
            [],
        ),
        (
            "plan_realloc dst_model config",
            lambda: plan_realloc(SPEC, SRC, DST, dst_model=CFG),
            TypeError,
            "dst_model must be a real_py.ModelSpec",
            [],
        ),
        (
            "plan_realloc rank 2**40",
            lambda: plan_realloc(SPEC, SRC, Layout(dp=2, ranks=(0, 2**40))),
            ValueError,
            "outside",
            [],
        ),
        ("check_fits config", lambda: check_fits(CFG, SRC), TypeError, M + "ModelConfig", []),
        (
            "check_fits layout str",
            lambda: check_fits(SPEC, "tp2"),
            TypeError,
            "layout must be a real_py.Layout",
            [],
        ),
        ("ModelShard.empty config", lambda: ModelShard.empty(CFG, SRC, 0), TypeError, M, []),
        (
            "ModelShard.empty layout str",
            lambda: ModelShard.empty(SPEC, "tp2", 0),
            TypeError,
            "layout must be",
            [],
        ),
        (
            "ModelShard.from_full config",
            lambda: ModelShard.from_full(CFG, SRC, 0, FULL),
            TypeError,
            M,
            [],
        ),
        (
            "ModelShard rank 2**40",
            lambda: ModelShard.empty(SPEC, SRC, 2**40),
            ValueError,
            "rank 1099511627776 is not in layout dp1tp1pp1",
            [],
        ),
        (
            "ModelShard flat list",
            lambda: ModelShard(SPEC, SRC, 0, [0.0] * 4),
            TypeError,
            "flat must be a 1-D torch.Tensor",
            [],
        ),
        (
            "ModelShard flat wrong size",
            lambda: ModelShard(SPEC, SRC, 0, long_flat),
            ValueError,
            rf"must be 1-D torch.float32 of {flat.numel()} elements, got \({flat.numel() + 1},\)",
            [long_flat],
        ),
        (
            "ModelShard flat strided",
            lambda: ModelShard(SPEC, SRC, 0, strided),
            ValueError,
            r"must be contiguous, got stride \(2,\)",
            [strided],
        ),
        (
            "Reallocator config",
            lambda: Reallocator(CFG, InProcessHub().transport(0)),
            TypeError,
            "plan must be a ReallocPlan",
            [],
        ),
        (
            "Reallocator transport str",
            lambda: Reallocator(plan_realloc(SPEC, SRC, DST), "gloo"),
            TypeError,
            "transport must be a real_py Transport",
            [],
        ),
        (
            "run shard of same-name model",
            lambda: _realloc().run(other, ModelShard.empty(SPEC, DST, 0)),
            ValueError,
            rf"source shard's model {SPEC.name} is not the plan's source model of the same name: "
            r".*disagree",
            [other.flat],
        ),
        (
            "run non-shard",
            lambda: _realloc().run(flat, None),
            TypeError,
            "source shard must be a ModelShard or None",
            [flat],
        ),
        (
            "run freed source",
            lambda: _realloc().run(freed, ModelShard.empty(SPEC, DST, 0)),
            ValueError,
            r"source shard of rank 0 .* has 0 bytes of storage behind a \d+-byte buffer: "
            r"it was freed",
            [],
        ),
        (
            "run float64 source",
            lambda: _realloc().run(_replaced(torch.float64), ModelShard.empty(SPEC, DST, 0)),
            ValueError,
            rf"source shard of rank 0 \({SPEC.name}, dp1tp1pp1\): "
            rf"its flat buffer is \({flat.numel()},\) torch.float64; "
            rf"the plan needs a 1-D contiguous torch.float32 buffer of {flat.numel()} elements "
            rf"\({flat.numel() * 4} bytes\)",
            [],
        ),
        (
            "run short source",
            lambda: _realloc().run(_replaced(torch.float32, -1), ModelShard.empty(SPEC, DST, 0)),
            ValueError,
            rf"source shard of rank 0 .* is \({flat.numel() - 1},\) torch.float32; "
            rf".* of {flat.numel()} elements",
            [],
        ),
        (
            "run float16 destination",
            lambda: _realloc().run(
                ModelShard.from_full(SPEC, SRC, 0, FULL),
                _replaced(torch.float16, shard=ModelShard.empty(SPEC, DST, 0)),
            ),
            ValueError,
            r"destination shard of rank 0 \(.*, dp1tp2pp1\): "
            r"its flat buffer is \(\d+,\) torch.float16; "
            r"the plan needs a 1-D contiguous torch.float32 buffer of \d+ elements",
            [],
        ),
        # Trainer-facing embed API
        (
            "reallocate_flat wrong size",
            lambda: reallocate_flat(_realloc(), long_flat),
            ValueError,
            rf"src_flat: .* of {flat.numel()} elements, got \({flat.numel() + 1},\)",
            [long_flat],
        ),
        (
            "reallocate_flat strided",
            lambda: reallocate_flat(_realloc(), strided),
            ValueError,
            "src_flat: .*must be contiguous",
            [strided],
        ),
        (
            "reallocate_flat config",
            lambda: reallocate_flat(CFG, flat),
            TypeError,
            "realloc must be a Reallocator",
            [flat],
        ),
        (
            "reallocate_params list",
            lambda: reallocate_params(_realloc(), list(params.values())),
            TypeError,
            r"params must be a mapping name -> local tensor or None, got list",
            list(params.values()),
        ),
        (
            "reallocate_params meta",
            lambda: reallocate_params(_realloc(), meta),
            ValueError,
            r"params\['embed_tokens.weight'\] is a meta tensor \(no data\)",
            [],
        ),
        (
            "reallocate_params config",
            lambda: reallocate_params(CFG, params),
            TypeError,
            "realloc must be a Reallocator",
            list(params.values()),
        ),
        (
            "reallocate_params non-tensor",
            lambda: reallocate_params(_realloc(), params | {"norm.weight": [1.0]}),
            TypeError,
            r"params\['norm.weight'\] must be a torch.Tensor, got list",
            list(params.values()),
        ),
        (
            "shard_from_params config",
            lambda: shard_from_params(CFG, SRC, 0, params),
            TypeError,
            M,
            [],
        ),
        # HF checkpoints
        (
            "load_hf_shard truncated",
            lambda: load_hf_shard(str(truncated), cfg_hf, SRC, 0),
            ValueError,
            rf"{truncated}/model.safetensors is not a readable safetensors file "
            r"\(truncated or corrupt",
            [st],
        ),
        (
            "load_hf_shard garbage header",
            lambda: load_hf_shard(str(garbage), cfg_hf, SRC, 0),
            ValueError,
            rf"{garbage}/model.safetensors is not a readable safetensors file",
            [garbage / "model.safetensors"],
        ),
        (
            "load_hf_shard layout str",
            lambda: load_hf_shard(str(truncated), cfg_hf, "tp2", 0),
            TypeError,
            "layout must be a real_py.Layout",
            [st],
        ),
        # Process groups (the type check comes before any collective or world lookup)
        (
            "ParallelGroups layout str",
            lambda: ParallelGroups("dp2"),
            TypeError,
            "layout must be a real_py.Layout",
            [],
        ),
    ]


def _state(x):
    return x.read_bytes() if isinstance(x, os.PathLike) else x.clone()


def _same(a, b):
    return a == b if isinstance(a, bytes) else torch.equal(a, b)


def test_bad_library_inputs(tmp_path):
    cases = _cases(tmp_path)
    assert len({c[0] for c in cases}) == len(cases)
    failures = []
    for name, fn, exc, phrase, inputs in cases:
        before = [_state(x) for x in inputs]
        try:
            fn()
            failures.append(f"{name}: no exception")
        except exc as e:
            import re

            if not re.search(phrase, str(e)):
                failures.append(f"{name}: message {str(e)!r} lacks {phrase!r}")
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__} instead of {exc.__name__}: {e}")
        for x, b in zip(inputs, before):
            if not _same(_state(x), b):
                failures.append(
                    f"{name}: input {x if isinstance(x, os.PathLike) else 'tensor'} changed"
                )
    assert not failures, "\n".join(failures)
    print(f"{len(cases)} bad-input cases")


@pytest.mark.parametrize("one_pass", [None, False], ids=["one-pass", "rounds"])
@pytest.mark.parametrize(
    "side,dtype,extra",
    [
        ("source", torch.float64, 0),
        ("destination", torch.float16, 0),
        ("source", torch.float32, 3),
        ("destination", torch.float32, -3),
    ],
    ids=["src-float64", "dst-float16", "src-long", "dst-short"],
)
def test_replaced_flat_named_on_every_path(one_pass, side, dtype, extra):
    """A shard whose flat buffer was replaced by one of another dtype or length fails before any
    copy with a ValueError naming the shard (side, rank, model, layout), both dtypes and the
    expected size, in one pass and in rounds (the copy would otherwise read float64 bytes as
    float32 values, or fail inside copy_planned naming only a buffer index)."""
    plan = plan_realloc(SPEC, Layout(), Layout(tp=2))
    srcs = {0: ModelShard.from_full(SPEC, Layout(), 0, FULL)}
    dsts = {r: ModelShard.empty(SPEC, Layout(tp=2), r) for r in (0, 1)}
    bad = srcs[0] if side == "source" else dsts[0]
    numel = bad.flat.numel()
    _replaced(dtype, extra, shard=bad)
    before = srcs[0].flat.clone() if side == "destination" else None
    with pytest.raises(
        ValueError,
        match=rf"{side} shard of rank 0 \({SPEC.name}, {bad.layout}\): its flat buffer "
        rf"is \({numel + extra},\) {dtype}; the plan needs a 1-D contiguous torch.float32 buffer "
        rf"of {numel} elements \({numel * 4} bytes\)",
    ):
        run_in_process(InProcessHub(timeout=10), plan, srcs, dsts, one_pass=one_pass)
    if before is not None:
        assert torch.equal(srcs[0].flat, before)


def test_good_inputs_still_work():
    """The checks accept what they should: numpy ints as ranks, a same-spec shard, a real move."""
    import numpy as np

    lay = Layout(dp=2, ranks=np.array([1, 0]))
    assert lay.ranks == (1, 0) and all(type(r) is int for r in lay.ranks)
    hub = InProcessHub(timeout=10)
    out = run_in_process(
        hub,
        plan_realloc(SPEC, Layout(), Layout(ranks=(1,))),
        {0: ModelShard.from_full(SPEC, Layout(), 0, FULL)},
        {1: ModelShard.empty(SPEC, Layout(ranks=(1,)), 1)},
    )
    assert set(out) == {0, 1}
