"""`python -m real_py bench`: time real_py's reallocation between layouts on this cluster.

    python -m real_py bench                    # built-in 58M model, three pairs on 4 gloo ranks
    python -m real_py bench --model llama2-7b --src dp2,tp4 --dst tp8 --device cuda --out r.json
    torchrun --nnodes 2 --nproc-per-node 8 ... -m real_py bench --model cfg.json --src tp8,pp2 ...

Without RANK in the environment (not under torchrun) the command checks its arguments and re-invokes
itself under torchrun --standalone (launch.torchrun.launch_torchrun) with as many local processes as
the layouts need (--nproc to change it); under torchrun every rank runs the pairs. Backend: gloo for
--device cpu, NCCL for cuda. Per (src, dst) pair, after one untimed run that also verifies the
result (chunk checksums on the wire, Reallocator(verify=True), and every destination tensor
compared bit for bit with the values the source pattern implies):

  seconds     median over --repeats of the slowest rank's time for one reallocation
  GB/s/rank   network bytes / participating ranks / seconds (and the busiest receiver's rate)
  bytes       network bytes sent against the minimum (what destinations need and do not hold)
  % peak      the plan's messages alone, one batch_isend_irecv between preallocated buffers
              timed in the same run (measured link peak for these bytes), over the seconds
              above; and, with --link-gbps G, the busiest receiver's bytes at G GB/s over them.

The machine is described from what the run detects (cpu count and model, GPU name, hosts, world
size, backend). --out writes JSON; an existing file is kept unless --overwrite, and paths
under the repository's bench/results/ (the project's own recorded results) are refused.

One file past 400 lines: the checks before the torchrun re-launch and the ranks' timing loop read
the same parsed model and pairs, and the command reads as one piece like the other cli/ modules.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from ..benchmark import PlanMessages, cpu_model, environment, pattern, timed_slowest
from ..launch.torchrun import launch_torchrun
from ..rlhf.observe import open_nofollow
from .common import ranks

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16", "float64")
_REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    num_hidden_layers=8,
)
"""`bench` without --model: a 58M-parameter LLaMA shape, small enough for a laptop CPU."""
DEFAULT_PAIRS = (("dp2,tp2", "dp4"), ("dp1,tp2,pp2", "dp2,tp2"), ("dp4,dim0", "dp1,tp2,pp2"))
"""`bench` without --src/--dst: a TP -> DP move, a PP change, and an FSDP2-style dp-sharded
source."""
MAX_LOCAL_PROCS = 64
"""Local processes the command launches at most (several nodes: run it under torchrun)."""


def add_parser(sub) -> None:
    from ..realloc.plan import MODES
    from ..spec import PRESETS

    p = sub.add_parser("bench", help="time reallocations between layouts on this machine/cluster")
    p.add_argument(
        "--model",
        help=f"preset ({', '.join(PRESETS)}) or a path to an HF config.json / checkpoint dir "
        "(default: a built-in 58M-parameter LLaMA shape)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="parameter dtype")
    p.add_argument(
        "--src",
        action="append",
        help="source layout, e.g. dp2,tp4,pp1 (dp-sharded: dp4,tp2,dim0 or ...,flat); "
        "repeat for several pairs (default: "
        + "; ".join(f"{s} -> {d}" for s, d in DEFAULT_PAIRS)
        + ")",
    )
    p.add_argument("--dst", action="append", help="destination layout, one per --src")
    p.add_argument(
        "--src-ranks",
        action="append",
        help="comma-separated global ranks of the source (one for all pairs or one per pair)",
    )
    p.add_argument("--dst-ranks", action="append", help="the same for the destination")
    p.add_argument("--mode", choices=MODES, default="p2p")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per pair (median reported)")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="reallocator staging bucket, MiB")
    p.add_argument("--link-gbps", type=float, help="stated link peak, GB/s per rank and direction")
    p.add_argument("--out", help="write the results as JSON to this path")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument(
        "--nproc",
        type=int,
        help="local processes when not under torchrun (default: ranks the layouts use)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds any transfer or collective may wait before failing",
    )
    p.add_argument(
        "--simulate",
        metavar="CLUSTER",
        choices=("dgx-h100", "dgx-h200"),
        help="no transfers: replay each pair's schedule on a modelled cluster of this "
        "kind (real_py/realloc/simulate.py) against its lower bound and a "
        "broadcast-per-node strategy",
    )
    p.add_argument("--nodes", type=int, help="--simulate: nodes (default: enough for the layouts)")


def _per_pair(values, n: int, flag: str) -> list:
    if not values:
        return [None] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(
            f"{flag} given {len(values)} times for {n} pairs; give it once or once per pair"
        )
    return values


def _model(args):
    from ..spec import PRESETS, ModelConfig, model_spec, preset

    if args.model is None:
        return model_spec(ModelConfig(**DEFAULT_MODEL, dtype=args.dtype), "bench-58m")
    if args.model in PRESETS:
        return model_spec(preset(args.model, dtype=args.dtype), args.model)
    if not os.path.exists(args.model):
        raise ValueError(
            f"--model {args.model!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
            "nor an existing HF config.json / checkpoint directory"
        )
    return model_spec(ModelConfig.from_hf(args.model, dtype=args.dtype), Path(args.model).stem)


def _pairs(args, model):
    from ..layout import Layout, check_fits

    if args.src is None and args.dst is None:
        args.src, args.dst = [s for s, _ in DEFAULT_PAIRS], [d for _, d in DEFAULT_PAIRS]
    if args.src is None or args.dst is None:
        raise ValueError(
            "give --src and --dst together (one --dst per --src), or neither for the default pairs"
        )
    if len(args.src) != len(args.dst):
        raise ValueError(
            f"{len(args.src)} --src but {len(args.dst)} --dst; give one --dst per --src"
        )
    n = len(args.src)
    pairs = []
    for i, (s, d, sr, dr) in enumerate(
        zip(
            args.src,
            args.dst,
            _per_pair(args.src_ranks, n, "--src-ranks"),
            _per_pair(args.dst_ranks, n, "--dst-ranks"),
        )
    ):
        src = Layout.parse(s, ranks=ranks(sr, "--src-ranks"))
        dst = Layout.parse(d, ranks=ranks(dr, "--dst-ranks"))
        for flag, layout in (("--src", src), ("--dst", dst)):
            try:
                check_fits(model, layout)
            except ValueError as e:
                raise ValueError(f"pair {i} {flag} {layout}: {e}") from None
        pairs.append((src, dst))
    return pairs


def _check_out(args) -> None:
    if not args.out:
        return
    if Path(args.out).is_symlink():
        raise ValueError(
            f"--out {args.out} is a symbolic link; bench writes its result file itself, "
            "never through a link: remove the link or choose another path"
        )
    out = Path(args.out).resolve()
    results = (_REPO / "bench" / "results").resolve()
    if out == results or results in out.parents:
        raise ValueError(
            f"--out {args.out} is under {results}, the project's recorded results; "
            "write somewhere else (e.g. --out bench_result.json)"
        )
    if out.exists() and not args.overwrite:
        raise ValueError(f"--out {args.out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        raise ValueError(f"--out {args.out}: directory {out.parent} does not exist")


def _check(args):
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb={args.bucket_mb} must be > 0")
    if args.link_gbps is not None and args.link_gbps <= 0:
        raise ValueError(f"--link-gbps={args.link_gbps} must be > 0")
    if args.timeout <= 0:
        raise ValueError(f"--timeout={args.timeout} must be > 0")
    _check_out(args)
    model = _model(args)
    pairs = _pairs(args, model)
    need = 1 + max(max(max(s.ranks), max(d.ranks)) for s, d in pairs)
    return model, pairs, need


def run(args) -> int:
    model, pairs, need = _check(args)
    if args.simulate:
        return _simulate(args, model, pairs, need)
    if "RANK" not in os.environ:
        nproc = args.nproc or need
        if nproc < need:
            raise ValueError(f"--nproc={nproc}, but the layouts use global ranks up to {need - 1}")
        if nproc > MAX_LOCAL_PROCS:
            raise ValueError(
                f"the layouts use global ranks up to {need - 1}: {nproc} local processes, "
                f"more than the {MAX_LOCAL_PROCS} this command starts on one machine; "
                "for more ranks run it under torchrun on several nodes"
            )
        if args.device == "cpu":
            _check_memory(model, pairs, nproc, args.bucket_mb)
        if args.device == "cuda":
            import torch

            if torch.cuda.device_count() < nproc:
                raise ValueError(
                    f"--device cuda with {nproc} processes, but this machine has "
                    f"{torch.cuda.device_count()} GPUs"
                )
            _check_gpu_memory(model, pairs, args.bucket_mb)
        return _launch(args, nproc)
    return _spmd(args, model, pairs, need)


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(model, pairs, nproc: int, bucket_mb: float) -> None:
    """Refuse before launching when the shards of the biggest pair (source + destination on every
    local rank, plus staging) would not fit in this machine's available memory."""
    from ..realloc.plan import _shard_data_numel

    avail = _available_bytes()
    if avail is None:
        return
    need = 0
    for src, dst in pairs:
        numel = sum(
            _shard_data_numel(model, layout, r) for layout in (src, dst) for r in layout.ranks
        )
        need = max(need, numel * model.element_size + nproc * int(bucket_mb * (1 << 20)))
    if need > 0.9 * avail:
        raise ValueError(
            f"--model {model.name} ({model.numel / 1e9:.2f}B params, {model.dtype}): the "
            f"shards of one pair on {nproc} local CPU ranks need about {need / 2**30:.1f} GiB, "
            f"but {avail / 2**30:.1f} GiB is available; pick a smaller model or run on GPUs"
        )


def _check_gpu_memory(model, pairs, bucket_mb: float) -> None:
    """Refuse before launching when one rank's source + destination shards of a pair, plus its
    staging, would not fit in the free memory of its GPU (local rank r uses cuda:r)."""
    import torch

    from ..realloc.plan import _shard_data_numel

    staging = 2 * int(bucket_mb * (1 << 20))
    for src, dst in pairs:
        for r in sorted(set(src.ranks) | set(dst.ranks)):
            numel = sum(
                _shard_data_numel(model, layout, r) for layout in (src, dst) if r in layout.ranks
            )
            need = numel * model.element_size + staging
            free, total = torch.cuda.mem_get_info(r)
            if need > 0.9 * free:
                raise ValueError(
                    f"--model {model.name} ({model.numel / 1e9:.2f}B params, {model.dtype}): "
                    f"rank {r}'s shards of {src} -> {dst} need about {need / 2**30:.1f} GiB, "
                    f"but cuda:{r} has {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; "
                    "use more GPUs or a smaller model"
                )


def _simulate(args, model, pairs, need: int) -> int:
    """--simulate: per pair, the schedule the Reallocator would run (same bucket) replayed on
    the modelled cluster, and the broadcast-per-node baseline on the same topology."""
    from ..realloc.plan import plan_realloc
    from ..realloc.simulate import CLUSTERS, broadcast_per_node, schedule_transfers, simulate

    kind = CLUSTERS[args.simulate]
    if args.nodes is not None and args.nodes * kind.gpus_per_node < need:
        raise ValueError(
            f"--nodes={args.nodes} x {kind.gpus_per_node} GPUs, but the layouts use "
            f"global ranks up to {need - 1}"
        )
    cluster = kind.sized(nodes=args.nodes) if args.nodes else kind.sized(gpus=need)
    es = model.element_size
    round_elems = max(2, int(args.bucket_mb * (1 << 20)) // es // 2)
    rows = []
    for src, dst in pairs:
        plan = plan_realloc(model, src, dst, mode=args.mode, ranks_per_node=cluster.gpus_per_node)
        ours = simulate(schedule_transfers(plan, round_elems), cluster)
        base = simulate(broadcast_per_node(plan, cluster), cluster)
        rows.append(
            {
                "src": str(src),
                "dst": str(dst),
                "cluster": cluster.name,
                "nodes": cluster.nodes,
                "real_py": ours.as_dict(),
                "broadcast_per_node": base.as_dict(),
            }
        )
        print(
            f"{src} -> {dst} on {cluster.nodes} x {cluster.name}: real_py {ours.seconds:.3f} s "
            f"(lower bound {ours.lower_bound:.3f} s, x{ours.ratio:.2f}, bottleneck "
            f"{ours.bottleneck}); broadcast per node {base.seconds:.3f} s",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"model": model.name, "dtype": model.dtype, "simulated": rows}, indent=1)
            + "\n"
        )
    return 0


def _launch(args, nproc: int) -> int:
    argv = (
        ["bench"]
        + (["--model", args.model] if args.model else [])
        + [
            "--dtype",
            args.dtype,
            "--mode",
            args.mode,
            "--device",
            args.device,
            "--repeats",
            str(args.repeats),
            "--bucket-mb",
            str(args.bucket_mb),
            "--timeout",
            str(args.timeout),
        ]
    )
    for flag in ("src", "dst", "src_ranks", "dst_ranks"):
        for v in getattr(args, flag) or []:
            argv += ["--" + flag.replace("_", "-"), v]
    if args.link_gbps is not None:
        argv += ["--link-gbps", str(args.link_gbps)]
    if args.out:
        # Absolute, but the name itself unresolved: a link planted there later is still refused.
        argv += ["--out", os.path.abspath(args.out)]
    if args.overwrite:
        argv.append("--overwrite")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    return launch_torchrun(nproc, argv, env, "processes")


# ---------------------------------------------------------------- workers (under torchrun)


def _pattern(model, shard) -> dict:
    """name -> the values `shard` must hold: benchmark.pattern of each parameter, cut like the
    shard (tp_slice, then the dp-sharded piece)."""
    from ..realloc.shard import tp_slice

    out = {}
    index = {p.name: j for j, p in enumerate(model.params)}
    for name, view in shard.params().items():
        p = model.param(name)
        v = tp_slice(p, pattern(index[name], p, dtype=view.dtype), shard.layout.tp, shard.tp_rank)
        if shard.dp_layout is not None:
            piece = shard.dp_layout.piece(name)
            v = v.reshape(-1)[piece.lo : piece.hi].view(piece.shape)
        out[name] = v.to(view.device)
    return out


def _machine(backend: str, world: int, device) -> dict:
    import torch
    import torch.distributed as dist

    cpu = cpu_model()
    hosts = [None] * world
    dist.all_gather_object(hosts, platform.node())
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    nodes = len(set(hosts))
    what = gpu or f"{os.cpu_count()}-cpu {cpu}"
    return {
        "label": f"{nodes} node(s), {world} {backend} ranks, {what}",
        "nodes": nodes,
        "world_size": world,
        "backend": backend,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "gpu": gpu,
        "ranks_per_node": world // nodes if world % nodes == 0 else None,
    }


def _bench_pair(model, src, dst, args, transport, device) -> dict:
    import torch
    import torch.distributed as dist

    from ..realloc.plan import _shard_data_numel, plan_realloc
    from ..realloc.reallocator import Reallocator
    from ..realloc.shard import ModelShard

    rank = dist.get_rank()
    plan = plan_realloc(model, src, dst, mode=args.mode)
    s = plan.summary()
    src_shard = dst_shard = None
    if rank in src.ranks:
        src_shard = ModelShard.empty(model, src, rank, device=device)
        for name, v in _pattern(model, src_shard).items():
            src_shard.view(name).copy_(v)
    if rank in dst.ranks:
        dst_shard = ModelShard.empty(model, dst, rank, device=device)
    bucket = int(args.bucket_mb * (1 << 20))
    # Untimed first run, verified: checksums on every chunk, then every tensor against the pattern.
    Reallocator(plan, transport, bucket_bytes=bucket, verify=True).run(src_shard, dst_shard)
    bad = []
    if dst_shard is not None:
        bad = [
            n
            for n, v in _pattern(model, dst_shard).items()
            if not torch.equal(dst_shard.view(n), v)
        ]
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bad)
    wrong = {r: b for r, b in enumerate(flags) if b}
    if wrong:
        raise RuntimeError(
            f"{src} -> {dst}: destination differs from the source pattern on ranks "
            f"{ {r: b[:3] for r, b in wrong.items()} }"
        )
    realloc = Reallocator(plan, transport, bucket_bytes=bucket)
    realloc.run(src_shard, dst_shard)  # warm: staging allocated, descriptors cached
    floor = PlanMessages(
        plan,
        rank,
        src_shard.flat.dtype
        if src_shard is not None
        else dst_shard.flat.dtype
        if dst_shard is not None
        else torch.float32,
        device,
    ).run
    timed_slowest(floor, device)
    times, floors = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        times.append(timed_slowest(functools.partial(realloc.run, src_shard, dst_shard), device))
        floors.append(timed_slowest(floor, device))
    sec, floor_sec = statistics.median(times), statistics.median(floors)
    es = model.element_size
    busiest = max(
        (_shard_data_numel(model, dst, r) * es - s["per_rank"][r]["local"] for r in dst.ranks),
        default=0,
    )
    ranks = len(plan.ranks())
    row = {
        "src": str(src),
        "dst": str(dst),
        "src_ranks": list(src.ranks),
        "dst_ranks": list(dst.ranks),
        "mode": args.mode,
        "seconds": sec,
        "seconds_all": times,
        "floor_seconds": floor_sec,
        "network_bytes": s["network_bytes"],
        "min_network_bytes": s["min_network_bytes"],
        "local_bytes": s["local_bytes"],
        "max_ingress_bytes": s["max_ingress_bytes"],
        "ranks": ranks,
        "num_messages": s["num_messages"],
        "gbps_per_rank": s["network_bytes"] / ranks / sec / 1e9 if sec > 0 else None,
        "busiest_receiver_gbps": busiest / sec / 1e9 if sec > 0 else None,
        "pct_of_measured_peak": 100.0 * floor_sec / sec if sec > 0 else None,
        "pct_of_stated_peak": (
            100.0 * busiest / (args.link_gbps * 1e9) / sec if args.link_gbps and sec > 0 else None
        ),
        "verified": True,
    }
    del src_shard, dst_shard, realloc
    return row


def _line(r: dict) -> str:
    stated = (
        f" {r['pct_of_stated_peak']:5.1f}%" if r["pct_of_stated_peak"] is not None else "     -"
    )
    return (
        f"{r['src']:>18} -> {r['dst']:<18} {r['seconds']:9.4f} {r['gbps_per_rank']:9.3f} "
        f"{r['network_bytes'] / 2**20:10.2f} {r['min_network_bytes'] / 2**20:10.2f} "
        f"{r['pct_of_measured_peak']:6.1f}%{stated}"
    )


def _spmd(args, model, pairs, need: int) -> int:
    import torch
    import torch.distributed as dist

    from ..realloc.transports.dist import DistTransport

    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world < need:
            raise ValueError(
                f"the layouts use global ranks up to {need - 1}, but the world has {world}"
            )
        machine = _machine(backend, world, device)
        transport = DistTransport(dist.group.WORLD, timeout=args.timeout)
        if rank == 0:
            print(
                f"{model.name} ({model.dtype}, "
                f"{sum(p.numel for p in model.params) / 1e6:.1f}M params) "
                f"on {machine['label']}, {args.mode}, median of {args.repeats}",
                flush=True,
            )
            print(
                f"{'src':>18}    {'dst':<18} {'seconds':>9} {'GB/s/rank':>9} {'sent MiB':>10} "
                f"{'min MiB':>10} {'%meas':>7} {'%stated':>6}",
                flush=True,
            )
        rows = []
        for src, dst in pairs:
            row = _bench_pair(model, src, dst, args, transport, device)
            rows.append(row)
            if rank == 0:
                print(_line(row), flush=True)
        if rank == 0 and args.out:
            env = environment()
            result = {
                "command": "python -m real_py " + " ".join(sys.argv[1:]),
                "date_utc": env["date_utc"],
                "model": model.name,
                "dtype": model.dtype,
                "num_params": sum(p.numel for p in model.params),
                "device": args.device,
                "repeats": args.repeats,
                "bucket_mb": args.bucket_mb,
                "link_gbps": args.link_gbps,
                "machine": machine,
                "versions": {k: env[k] for k in ("python", "torch", "cuda", "git_commit")},
                "pairs": rows,
            }
            out = Path(args.out)
            if out.exists() and not args.overwrite:  # appeared while running
                raise ValueError(f"--out {args.out} exists; pass --overwrite to replace it")
            with open_nofollow(str(out)) as f:
                f.write(json.dumps(result, indent=1) + "\n")
            print(f"wrote {out}", flush=True)
        dist.barrier()
    finally:
        from ..liveness import stop_threads

        stop_threads()  # before the group goes (liveness.stop_threads says why)
        dist.destroy_process_group()
    return 0
