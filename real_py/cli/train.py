"""`python -m real_py train [--config cfg.yaml] [KEY=VALUE ...] [--resume [DIR] | --overwrite]`.

KEY=VALUE overrides use the config's dotted keys (`ppo.actor_lr=1e-5 plan.path=plan.json
steps=3`); values are read as YAML and typed like the file. An out_dir that already holds a
run (metrics, checkpoints) is refused unless --resume continues it or --overwrite clears it.

Without RANK in the environment, the command is the launcher of a one-node job (launch.job): it
locks out_dir (a second job or a resume on it is refused, naming the holder's pid), validates
the config once and starts <world_size> local ranks under torchrun's elastic agent, run in this
process (its store on 127.0.0.1 only): forks of itself on CPU (fresh interpreters on CUDA,
handed the config as resolved and validated here), each running the SPMD loop below; their
output goes to
<out_dir>/logs/rank<r>.log (rank 0's stdout is shown too), and a failure anywhere ends the job
with one line naming the rank, step, call and error. The ranks die with the launcher. Under an
outside torchrun (several nodes) every rank runs the SPMD loop and rank 0 holds the lock.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="run PPO / GRPO with per-call layouts and weight reallocation")
    p.add_argument("--config", help="YAML config (default: the embedded CPU demo)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted config overrides, e.g. ppo.actor_lr=1e-5 plan.path=plan.json steps=3",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        help="resume from a checkpoint directory (default: <out_dir>/latest)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="delete what a previous run left in out_dir (metrics, checkpoints, events) first",
    )
    p.add_argument("--steps", type=int, help="override the config's steps")
    p.add_argument("--out-dir", help="override the config's out_dir")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds any collective or transfer may wait before failing (default 300)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config(args):
    from ..rlhf import checkpoint, config

    if not args.timeout > 0:
        raise ValueError(f"--timeout={args.timeout} must be > 0 seconds")
    if args.resume and "=" in args.resume and not os.path.exists(args.resume):
        # `--resume ppo.clip=0.1`: argparse gave the override to --resume's optional DIR.
        args.overrides, args.resume = args.overrides + [args.resume], ""
    if args.resume is not None and args.overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    d = config.apply_overrides(config.read_yaml(args.config), args.overrides)
    if args.steps is not None:
        d["steps"] = args.steps
    if args.out_dir:
        d["out_dir"] = args.out_dir
    cfg = config.from_dict(d)
    from ..launch.lock import lock_out_dir

    # The launcher, or rank 0 under an outside torchrun (the ranks of a launched job never get
    # here: they run the launcher's config).
    if os.environ.get("RANK", "0") == "0":
        lock_out_dir(cfg.out_dir)  # before anything in out_dir changes (sweep, --overwrite)
    ckpt = None
    if args.resume is not None:
        if os.environ.get("RANK", "0") == "0":
            # A save killed mid-way left temporaries, or an .old step to put back (one process:
            # the launcher, or rank 0 under an outside torchrun).
            for line in checkpoint.sweep(cfg.out_dir):
                print(f"--resume: {line}", flush=True)
        ckpt = checkpoint.find(args.resume, cfg.out_dir)
        checkpoint.check(
            cfg, ckpt, verify_files="RANK" not in os.environ
        )  # ranks verify their own file
    if "RANK" not in os.environ:  # the launcher: what it can tell before any rank starts
        _before_launch(cfg)
    return cfg, ckpt


def _before_launch(cfg) -> None:
    """Refuse a local CUDA job with more ranks than GPUs; print the config's warnings
    (config.notes: ignored keys, more ranks than cores) and the legend of the step line's kl."""
    from ..rlhf import config

    world = cfg.execution_plan().world_size
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        n = torch.cuda.device_count()
        if world > n:
            raise ValueError(
                f"the execution plan has {world} ranks but this node has {n} GPU"
                f"{'s' if n != 1 else ''}: a local launch runs one rank per GPU; use a plan of at "
                f"most {n} ranks (python -m real_py search --gpus {n}), device: cpu, or several "
                "nodes under torchrun (docs/running.md)"
            )
    for line in config.notes(cfg, world):
        print(f"warning: {line}", flush=True)
    print(f"step lines: {config.KL_LEGEND}", flush=True)


def _launch(args, world: int) -> int:
    """Run the job as `world` local ranks under torchrun's elastic agent (launch.job.launch), each
    running the SPMD loop with what was resolved and validated here (config, checkpoint, plan,
    graph, models): forks of this process, or (CUDA) fresh interpreters that get it pickled,
    never reading the config file or sweeping the checkpoints again."""
    import functools

    from ..launch import job

    cfg, ckpt, validated = args.prepared
    if job.can_fork(cfg.device):
        _preimport()
        return job.launch(world, cfg.out_dir, lambda: _spmd(args, cfg, ckpt, validated))
    plain = argparse.Namespace(
        **{k: v for k, v in vars(args).items() if k not in ("prepared", "func")}
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return job.launch(
        world,
        cfg.out_dir,
        functools.partial(_spmd, plain, cfg, ckpt, validated),
        fork=False,
        what={"cuda": "NCCL processes", "cpu": "gloo processes"}.get(cfg.device, "processes"),
    )


def _preimport() -> None:
    """What every rank imports, imported once in the launcher before it forks them."""
    import torch.distributed  # noqa: F401
    import tqdm  # noqa: F401

    from ..rlhf import checkpoint, observe, runtime  # noqa: F401
    from . import export  # noqa: F401


def run(args) -> int:
    from ..launch.lock import unlock
    from ..launch.rank import run_rank
    from ..rlhf import config
    from ..rlhf.observe import check_no_links

    if "RANK" in os.environ:  # a rank under an outside torchrun
        return run_rank(lambda: _rank(args), int(os.environ["RANK"]))
    try:
        cfg, ckpt = _config(args)
        plan = cfg.execution_plan()
        validated = config.validate(cfg, plan.world_size)
        _protect_run_dir(cfg.out_dir, args)
        check_no_links(cfg.out_dir)
        args.prepared = (cfg, ckpt, validated)
        code = _launch(args, plan.world_size)
    finally:
        unlock()
    if (
        getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
        == "real_py.__main__"
    ):
        # `python -m real_py train`: the job is over and its files are closed; skip the
        # interpreter's teardown of torch (about a second).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _rank(args) -> int:
    """A rank under an outside torchrun: it reads and validates the config itself."""
    from .. import liveness

    cfg, ckpt = _config(args)
    liveness.set_job_logs(os.path.join(cfg.out_dir, "logs"), int(os.environ["RANK"]))
    return _spmd(args, cfg, ckpt)


def _protect_run_dir(out_dir: str, args) -> None:
    """Refuse to mix a new run into out_dir's old one; --overwrite deletes the old run's entries
    (only those a run writes), --resume continues it. Runs in the launcher, before any rank."""
    import shutil

    from ..rlhf.observe import run_entries

    old = run_entries(out_dir)
    if not old or args.resume is not None:
        return
    if not args.overwrite:
        shown = ", ".join(old[:6]) + (", ..." if len(old) > 6 else "")
        raise ValueError(
            f"out_dir {out_dir} already holds a run ({shown}); pass --resume to continue "
            "it, --overwrite to replace it, or --out-dir / out_dir=... for a new run"
        )
    for n in old:
        path = os.path.join(out_dir, n)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    print(f"--overwrite: removed {len(old)} entries of the previous run in {out_dir}", flush=True)


def _line(step: int, out: dict) -> str:
    m = out["metrics"]
    keys = (
        "reward",
        "kl",
        "policy_loss",
        "value_loss",
        "clip_frac",
        "entropy",
        "response_length",
        "kl_coef",
        "dropped_groups",
        "gen_rounds",
        "rollout_logp_diff",
        "rollout_kl",
        "tis_capped_frac",
    )
    parts = [f"{k} {m[k]:.4g}" for k in keys if k in m]
    calls = " ".join(f"{n} {s:.2f}s" for n, s in out["calls"].items())
    re = " ".join(f"{k} {v:.3f}s" for k, v in out["realloc_seconds"].items())
    line = (
        f"step {step} | {' '.join(parts)} | {calls} | realloc {re or '-'} "
        f"{out['realloc_bytes'] / 2**20:.2f} MiB"
    )
    if out.get("offload_seconds"):
        # Milliseconds: a frozen model's copy out and back is well under a realloc's time.
        off = " ".join(f"{k} {v * 1e3:.2f}ms" for k, v in out["offload_seconds"].items())
        line += f" | offload {off} {out['offload_bytes'] / 2**20:.2f} MiB"
    if "async" in out:  # async mode: staleness, queue, overlap of generation with training
        a = out["async"]
        line += (
            f" | async staleness {m.get('staleness', 0):.2g} batch_v {m['batch_version']:.0f} "
            f"queued {m['rows_queued']:.0f} dropped {m['rows_dropped']:.0f} "
            f"gen||train {a['overlap_seconds']:.2f}s "
            f"realloc hidden {a['realloc_hidden_seconds']:.2f}s"
        )
    if out.get("peak_mem_mib"):  # CUDA only: peak GPU memory of each call, max over ranks
        line += " | peak " + " ".join(f"{k} {v:.0f}MiB" for k, v in out["peak_mem_mib"].items())
    return line


def _spmd(args, cfg, ckpt, validated=None) -> int:
    """This rank's part of the job. `validated`: (plan, graph, models) of the launcher's
    config.validate (every rank the launcher started, forked or spawned); under an outside
    torchrun every rank validates."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from .. import liveness
    from ..launch.rank import managed
    from ..rlhf import checkpoint, config
    from ..rlhf.observe import RunLog, format_summary
    from ..rlhf.runtime import Runtime
    from .export import export_live

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from ..device import backend_for, resolve_device

    liveness.set_activity("starting: process group")
    # cuda:{LOCAL_RANK} and NCCL when cfg.device resolves to CUDA, else gloo.
    dist.init_process_group(
        backend_for(resolve_device(cfg.device)), timeout=datetime.timedelta(seconds=args.timeout)
    )
    ok, rt = False, None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        liveness.start_heartbeat()
        liveness.set_activity("starting: models")
        plan, graph, models = validated or config.validate(cfg, world)
        rt = Runtime(cfg, plan, graph, models, timeout_s=args.timeout)
        rt.samples_path = os.path.join(cfg.out_dir, "samples.jsonl")
        # Every rank loads its file; only when all have does rank 0 drop the old records of the
        # steps that run again (a refused file leaves the run directory as it was).
        start = checkpoint.resume(rt, ckpt, cfg.out_dir) if ckpt else 0
        log = None
        if rank == 0:
            log = RunLog(cfg.out_dir, wandb=cfg.wandb, config=config.to_dict(cfg))
            print(
                f"world {world}; calls in order:\n{graph.describe()}\nplan: "
                + ", ".join(
                    f"{n} {plan.calls[n]} ranks {list(plan.calls[n].ranks)}" for n in graph.order
                ),
                flush=True,
            )
        bar = tqdm(
            range(start, cfg.steps),
            initial=start,
            total=cfg.steps,
            desc="train",
            disable=rank != 0 or args.no_progress,
            file=sys.stdout if managed() else None,
        )
        t_all = time.perf_counter()
        for step in bar:
            liveness.set_activity(f"step {step}")
            t0 = time.perf_counter()
            out = rt.iteration(step)
            if rank == 0:
                rec = {
                    "step": step + 1,
                    "seconds": time.perf_counter() - t0,
                    "metrics": out["metrics"],
                    "calls": out["calls"],
                    "realloc_seconds": out["realloc_seconds"],
                    "realloc_bytes": out["realloc_bytes"],
                    "offload_seconds": out["offload_seconds"],
                    "offload_bytes": out["offload_bytes"],
                    "data_bytes": out["data_bytes"],
                    "peak_mem_mib": out.get("peak_mem_mib", {}),
                }
                if "async" in out:
                    rec["async"] = out["async"]
                log.log(rec)
                tqdm.write(_line(step + 1, out))
            if cfg.save_every and ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps):
                liveness.set_activity(f"step {step}, saving checkpoint step_{step + 1}")
                path = checkpoint.save(rt, cfg.out_dir, step + 1)
                if rank == 0:
                    tqdm.write(f"saved {path}")
        liveness.set_activity("finishing")
        if cfg.export == "hf":
            written = export_live(rt, os.path.join(cfg.out_dir, "hf"))
            if rank == 0:
                print(f"exported {', '.join(written)}", flush=True)
        if rank == 0:
            print(
                f"done: {cfg.steps - start} steps in {time.perf_counter() - t_all:.1f} s; "
                "metrics in "
                f"{os.path.join(cfg.out_dir, 'metrics.jsonl')}",
                flush=True,
            )
            summary = log.close()
            print(
                format_summary(summary) + f"; {os.path.join(cfg.out_dir, 'summary.json')}",
                flush=True,
            )
        ok = True
    finally:
        # A rank of a launched job that failed keeps beating until it exits (os._exit in
        # launch.rank.run_rank): a heartbeat ended "done" would read as a finished run to its peers.
        # Launched ranks skip destroy_process_group too: os._exit follows, and the launcher ends
        # the job as one.
        if ok or not managed():
            liveness.stop_threads()  # before the group goes (liveness.stop_threads says why)
        if not managed():
            if rt is not None:
                try:  # vLLM's teardown, while the groups live; it ends the default one
                    rt.close()
                except Exception as e:  # never in place of the error that ended the run
                    print(f"rank {dist.get_rank()}: vLLM teardown failed: {e}", flush=True)
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0
