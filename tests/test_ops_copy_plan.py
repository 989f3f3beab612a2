"""Checks compiled copies (real_py.ops.CopyPlan, real_py::copy_planned) and the CUDA kernel's host
twin (_C.copy_twin: the kernel's lane code run on the CPU) against a plain slicing reference.

A failure in the twin points to csrc/ops/copy_kernel_impl.cuh (head / aligned / realigned / tail
paths, grid-stride warp loop) or csrc/ops/copy_items.cpp (work items); in the CPU op to
csrc/ops/copy_cpu.cpp; in the argument checks to csrc/ops/checks.h or csrc/ops/bind_ops.cpp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.oracle import oracle_flat, random_full, tiny_spec

from real_py import Layout, plan_realloc
from real_py.ops import CopyPlan, extension
from real_py.realloc.shard import ModelShard


def random_descs(rng, bufs: int, dst_sizes: list[int] | None = None, max_len=3000):
    """[k, 8] element descriptors over `bufs` buffers, disjoint per destination buffer."""
    rows, cursor, src_need = [], [0] * bufs, [1] * bufs
    for _ in range(int(rng.integers(1, 30))):
        ln, n = int(rng.integers(1, max_len)), int(rng.integers(1, 12))
        sb, db = int(rng.integers(bufs)), int(rng.integers(bufs))
        ss, ds = int(rng.integers(0, 2 * ln + 1)), ln + int(rng.integers(0, 9))
        so, do = int(rng.integers(0, 17)), cursor[db] + int(rng.integers(0, 9))
        rows.append((so, do, ln, n, ss, ds, sb, db))
        cursor[db] = do + (n - 1) * ds + ln
        src_need[sb] = max(src_need[sb], so + (n - 1) * ss + ln)
    return np.array(rows, np.int64), src_need, cursor


def reference(srcs, dsts, descs):
    for so, do, ln, n, ss, ds, sb, db in descs.tolist():
        for i in range(n):
            dsts[db][do + i * ds : do + i * ds + ln] = srcs[sb][so + i * ss : so + i * ss + ln]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_copy_plan_matches_reference(dtype):
    rng = np.random.default_rng(5)
    for trial in range(40):
        bufs = 1 + trial % 4
        descs, sn, dn = random_descs(rng, bufs)
        srcs = [torch.randint(0, 250, (n + int(rng.integers(0, 5)),)).to(dtype) for n in sn]
        dsts = [torch.randint(0, 250, (n + 3,)).to(dtype) for n in dn]
        want = [d.clone() for d in dsts]
        reference(srcs, want, descs)
        before = [s.clone() for s in srcs]
        plan = CopyPlan(
            descs, srcs[0].element_size(), item_bytes=int(rng.choice([0, 16, 100, 4096]))
        )
        assert plan.bytes == int((descs[:, 2] * descs[:, 3]).sum()) * srcs[0].element_size()
        plan.run(srcs, dsts)
        for j in range(bufs):
            assert torch.equal(dsts[j].view(torch.uint8), want[j].view(torch.uint8)), (trial, j)
            assert torch.equal(srcs[j], before[j])
        plan.run(srcs, dsts)  # replayed: same result
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dsts, want)
        )


def _twin(descs, srcs, dsts, es, item_bytes=0, warps=7):
    items, _, _ = extension().copy_plan(descs, es, item_bytes)
    extension().copy_twin(
        [s.view(torch.uint8).numpy() for s in srcs],
        [d.view(torch.uint8).numpy() for d in dsts],
        items,
        warps,
    )


def test_kernel_twin_on_random_descriptors_and_offsets():
    """The kernel's lane code over random descriptors, buffers at every offset mod 16 (views of a
    bigger buffer), so src and dst differ mod 16 in every way: the realigned paths run."""
    rng = np.random.default_rng(9)
    for trial in range(60):
        bufs = 1 + trial % 3
        descs, sn, dn = random_descs(rng, bufs, max_len=700)
        es = int(rng.choice([1, 2, 4]))
        base_s = [torch.randint(0, 250, (n * es + 32,), dtype=torch.uint8) for n in sn]
        base_d = [torch.randint(0, 250, (n * es + 32,), dtype=torch.uint8) for n in dn]
        so = [int(rng.integers(0, 16)) // es * es for _ in range(bufs)]
        do = [int(rng.integers(0, 16)) // es * es for _ in range(bufs)]
        srcs = [b[o : o + n * es] for b, o, n in zip(base_s, so, sn)]
        dsts = [b[o : o + n * es] for b, o, n in zip(base_d, do, dn)]
        want = [b.clone() for b in base_d]
        wviews = [w[o : o + n * es] for w, o, n in zip(want, do, dn)]
        byte_descs = descs.copy()
        byte_descs[:, :6] *= es
        byte_descs[:, 3] //= es
        reference(srcs, wviews, byte_descs)
        _twin(
            descs,
            srcs,
            dsts,
            es,
            item_bytes=int(rng.choice([16, 64, 2048, 16384])),
            warps=int(rng.integers(1, 50)),
        )
        assert all(torch.equal(a, b) for a, b in zip(base_d, want)), trial


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernel_twin_on_planner_descriptors(dtype):
    """Direct (sender shard -> receiver shard) descriptors of real plans through the twin, against
    the destination shard built from the full tensors."""
    model = tiny_spec(layers=2, vocab=97, dtype=dtype, bias=True)
    full = random_full(model, 4)
    for a, b in (("tp2", "tp3"), ("tp6", "dp2,tp1,pp2"), ("dp3,flat", "tp2")):
        src, dst = Layout.parse(a), Layout.parse(b)
        plan = plan_realloc(model, src, dst)
        srcs = {r: ModelShard.from_full(model, src, r, full) for r in src.ranks}
        for r in dst.ranks:
            got = ModelShard.empty(model, dst, r)
            rows, bufs = [], sorted(src.ranks)
            rp = plan.for_rank(r)
            for m in rp.recvs:
                rows += [[*d, bufs.index(m.peers[0]), 0] for d in m.descs.tolist()]
            rows += [[*d, bufs.index(r), 0] for d in rp.local.tolist()]
            _twin(
                np.array(rows, np.int64).reshape(-1, 8),
                [srcs[s].flat for s in bufs],
                [got.flat],
                model.element_size,
                warps=5,
            )
            assert torch.equal(got.flat, oracle_flat(model, dst, r, full)), (a, b, r)


def test_more_than_64_buffers_split_into_groups():
    rng = np.random.default_rng(1)
    srcs = [torch.arange(i, i + 50, dtype=torch.float32) for i in range(70)]
    dsts = [torch.zeros(50) for _ in range(70)]
    rows = [(int(rng.integers(0, 10)), 0, 40, 1, 40, 40, s, (s * 3) % 70) for s in range(70)]
    plan = CopyPlan(np.array(rows), 4)
    assert len(plan.groups) > 1
    plan.run(srcs, dsts)
    for so, _, ln, _, _, _, s, d in rows:
        assert torch.equal(dsts[d][:ln], srcs[s][so : so + ln])


def test_bad_plans_and_buffers_rejected_before_writing():
    with pytest.raises(ValueError, match=r"negative value"):
        CopyPlan(np.array([[0, 0, -1, 1, 1, 1, 0, 0]]), 4)
    with pytest.raises(ValueError, match=r"overlapping runs"):
        CopyPlan(np.array([[0, 0, 4, 2, 4, 2, 0, 0]]), 4)
    plan = CopyPlan(np.array([[0, 0, 4, 3, 4, 5, 0, 1]]), 4)
    src, dst = torch.arange(12.0), [torch.zeros(14), torch.full((14,), 7.0)]
    with pytest.raises(
        ValueError, match=r"destination buffer 1 holds 52 bytes, the plan reaches byte 56"
    ):
        plan.run([src], [dst[0], dst[1][:13]])
    with pytest.raises(ValueError, match=r"addresses destination buffer 1 but only 1 were passed"):
        plan.run([src], [dst[0]])
    with pytest.raises(ValueError, match=r"share memory"):
        plan.run([dst[1]], [dst[0], dst[1]])
    with pytest.raises(ValueError, match=r"1-D contiguous"):
        plan.run([src.view(3, 4)], dst)
    assert bool((dst[1] == 7).all()) and bool((dst[0] == 0).all())
    plan.run([src], dst)
    assert torch.equal(dst[1][:14].view(-1)[[0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]], src)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_copy_plan_cuda_matches_cpu(dtype):
    rng = np.random.default_rng(11)
    for trial in range(30):
        bufs = 1 + trial % 3
        descs, sn, dn = random_descs(rng, bufs, max_len=40000 if trial % 2 else 3000)
        srcs = [torch.randint(0, 250, (n + 7,)).to(dtype) for n in sn]
        dsts = [torch.randint(0, 250, (n + 3,)).to(dtype) for n in dn]
        want = [d.clone() for d in dsts]
        CopyPlan(descs, srcs[0].element_size()).run(srcs, want)
        plan = CopyPlan(descs, srcs[0].element_size(), device="cuda")
        got = [d.cuda() for d in dsts]
        # Views at an odd element offset: source and destination differ mod 16.
        off = [torch.cat([torch.zeros(1, dtype=dtype), s]).cuda()[1:] for s in srcs]
        plan.run(off, got)
        torch.cuda.synchronize()
        assert all(
            torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want)
        )


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_copy_plan_cuda_reads_a_source_on_another_gpu():
    """Destinations on cuda:0, a source on cuda:1 (as a CUDA IPC peer's buffer is): the kernel runs
    on the destinations' device and reads the peer over NVLink / PCIe, or refuses naming both
    devices."""
    rng = np.random.default_rng(5)
    descs, sn, dn = random_descs(rng, 2)
    srcs = [torch.randint(0, 250, (n,), dtype=torch.uint8) for n in sn]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in dn]
    want = [d.clone() for d in dsts]
    reference(srcs, want, descs)  # plain slicing
    got = [d.to("cuda:0") for d in dsts]
    plan = CopyPlan(descs, 1, device="cuda:0")
    peer = [srcs[0].to("cuda:0"), srcs[1].to("cuda:1")]
    if not torch.cuda.can_device_access_peer(0, 1):
        with pytest.raises(ValueError, match=r"cannot access cuda:1 as a peer"):
            plan.run(peer, got)
        return
    plan.run(peer, got)
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match=r"destination buffer 1 is on cuda:1, expected cuda:0"):
        plan.run(peer, [got[0], got[1].to("cuda:1")])
