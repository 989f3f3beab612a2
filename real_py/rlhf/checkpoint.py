"""Checkpoints: per-rank shards of the trained models with their optimizer state, step, RNG.

    <out_dir>/step_<k>/meta.json      algo, model configs, execution plan, step (rank 0)
    <out_dir>/step_<k>/rank<r>.pt     {model: {"flat", "exp_avg", "exp_avg_sq", "num_steps", "master"}},
                                      step, torch RNG state (every rank that holds a trained shard)
    <out_dir>/latest                  name of the newest complete step directory

Frozen models (reference, reward) are rebuilt from the seed, which meta.json records. `latest`
is written after a barrier, so it never names a half-written checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist

from ..engines.train import Trainer


def _meta(cfg) -> dict:
    models = {m: dataclasses.asdict(c) for m, c in cfg.model_configs().items()}
    return {"algo": cfg.algo, "seed": cfg.seed, "models": models, "paths": cfg.model_paths(),
            "plan": cfg.execution_plan().to_json(), "reward": cfg.reward.kind}


def save(rt, out_dir: str, step: int) -> str:
    """Collective. Saves after `step` iterations completed; returns the directory."""
    path = os.path.join(out_dir, f"step_{step}")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    state = {"step": step, "rng": torch.get_rng_state(), "models": {}}
    for m, eng in rt.models.engines.items():
        if eng is None or eng.optim is None:
            continue
        tr = eng._trainer
        state["models"][m] = {"flat": eng.shard.flat.clone(), "layout": str(eng.layout),
                              "exp_avg": None if tr is None else tr.exp_avg,
                              "exp_avg_sq": None if tr is None else tr.exp_avg_sq,
                              "num_steps": 0 if tr is None else tr.num_steps,
                              "master": None if tr is None else tr.master}
    torch.save(state, os.path.join(path, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump(_meta(rt.cfg) | {"step": step}, f, indent=1)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "latest.tmp"), "w") as f:
            f.write(f"step_{step}\n")
        os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    return path


def find(resume: str, out_dir: str) -> str:
    """The checkpoint directory to resume from: `resume` itself, or out_dir/latest."""
    path = resume
    if not os.path.isfile(os.path.join(path, "meta.json")):
        latest = os.path.join(out_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"--resume: no checkpoint at {resume!r} and no {latest}")
        with open(latest) as f:
            path = os.path.join(out_dir, f.read().strip())
    return path


def check(cfg, path: str) -> int:
    """Raise ValueError if the checkpoint was made for other models or another plan; returns its step."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    mine = _meta(cfg)
    for k in ("algo", "models", "paths", "plan", "seed", "reward"):
        if meta.get(k) != mine[k]:
            raise ValueError(f"checkpoint {path} was made with a different {k}: {meta.get(k)} vs this "
                             f"config's {mine[k]}; resume with the config that made it")
    return int(meta["step"])


def load(rt, path: str) -> int:
    """Restore this rank's trained shards, optimizer state and RNG; returns the step."""
    state = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=False,
                       map_location="cpu")
    for m, eng in rt.models.engines.items():
        if eng is None or eng.optim is None:
            continue
        s = state["models"].get(m)
        if s is None or s["flat"].shape != eng.shard.flat.shape or s["layout"] != str(eng.layout):
            raise ValueError(f"checkpoint {path} rank {dist.get_rank()}: no matching {m} shard for "
                             f"{eng.layout}")
        eng.shard.flat.copy_(s["flat"])
        if s["exp_avg"] is not None:
            # The engine builds its Trainer lazily; build it now to restore the moments.
            eng._trainer = eng._trainer or Trainer(eng, eng.optim)
            eng._trainer.exp_avg.copy_(s["exp_avg"])
            eng._trainer.exp_avg_sq.copy_(s["exp_avg_sq"])
            eng._trainer.num_steps = s["num_steps"]
            if s.get("master") is not None:  # bf16 shards: the fp32 master weights
                eng._trainer.master.copy_(s["master"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


__all__ = ["save", "load", "find", "check"]
