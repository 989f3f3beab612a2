"""`python -m real_py export --run runs/train [--step N] --out DIR`: trained models as HF
checkpoints.

Writes DIR/actor (LlamaForCausalLM layout) and DIR/critic (...ForSequenceClassification, PPO
only) with model.safetensors + config.json, loadable by transformers' `from_pretrained`. The
tensors are the checkpoint's shards reassembled: reading them back and slicing them into the
train layout gives the saved rank files bit for bit.

`export_live` does the same at the end of `python -m real_py train` with `export: hf` (from the
engines in memory, a collective).
"""

from __future__ import annotations

import os

TRAINED = ("actor", "critic")


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's trained actor / critic as HF checkpoints")
    p.add_argument("--run", required=True, help="run directory of `train` (its out_dir)")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output directory (gets actor/ and critic/)")


def _source_config(path: str | None) -> str | None:
    """The HF checkpoint a model was loaded from, whose non-computation fields (e.g. bos/eos ids)
    save_hf keeps on export; None when there is none."""
    return path if path and os.path.exists(path) else None


def _check_out(out: str) -> None:
    for m in TRAINED:
        if os.path.exists(os.path.join(out, m)):
            raise ValueError(f"{os.path.join(out, m)} already exists; export to a new directory")


def export_live(rt, out: str) -> list[str]:
    """Collective over the world: gather each trained model from its train layout and write it
    (on that layout's first rank). Returns the directories written (on every rank)."""
    import torch.distributed as dist

    from ..interop.hf import gather_experts, gather_state_dict, save_hf

    written = []
    paths = rt.cfg.model_paths()
    for m in TRAINED:
        call = rt.graph.train_call(m)
        if call is None:
            continue
        path = os.path.join(out, m)
        g = rt.groups[call]
        if g.member:
            eng = rt.models.engines[m]
            full = gather_state_dict(eng.shard, g)
            if eng.experts is not None:  # MoE: the expert tensors from every (stage, ep rank)
                ex = gather_experts(eng.experts, g)
                full = None if full is None else {**full, **ex}
            if full is not None:
                save_hf(path, rt.configs[m], full, source=_source_config(paths.get(m)))
        written.append(path)
    dist.barrier()
    return written


def export_checkpoint(step_dir: str, out: str) -> list[str]:
    """Reassemble the trained models of one saved step from its rank files and write them."""
    from ..dataflow.execplan import ExecutionPlan
    from ..dataflow.graph import ALGORITHMS, Graph
    from ..interop.hf import experts_full, gather_full_stage, save_hf
    from ..realloc.shard import ExpertShard, ModelShard
    from ..rlhf.checkpoint import read_meta, read_rank_file
    from ..spec import ModelConfig, model_spec

    meta = read_meta(step_dir)
    if (
        meta.get("algo") not in ALGORITHMS
        or not isinstance(meta.get("models"), dict)
        or "plan" not in meta
    ):
        raise ValueError(
            f"checkpoint {step_dir}/meta.json lacks algo, models or plan; it was not "
            "written by this version of real_py"
        )
    _check_out(out)
    graph, plan = Graph(ALGORITHMS[meta["algo"]]), ExecutionPlan.from_json(meta["plan"])
    states: dict[int, dict] = {}  # rank -> its file, each read and verified once
    written = []
    for m in TRAINED:
        call = graph.train_call(m)
        if call is None:
            continue
        config = ModelConfig(**meta["models"][m])
        spec, layout = model_spec(config, name=m), plan.calls[call]
        by_stage: dict[int, list] = {}
        for s in range(layout.pp):
            for t in range(layout.tp):
                r = layout.rank(0, t, s)
                if r not in states:
                    states[r] = read_rank_file(step_dir, r)
                st = states[r]["models"].get(m)
                if st is None or st["layout"] != str(layout):
                    raise ValueError(f"checkpoint {step_dir} rank {r}: no {m} shard of {layout}")
                by_stage.setdefault(s, []).append(ModelShard(spec, layout, r, st["flat"]))
        full = {}
        for shards in by_stage.values():
            for name, t in gather_full_stage(spec, shards).items():
                full.setdefault(name, t)
        if spec.num_experts:  # MoE: expert-dp replica 0 of every (stage, ep rank)
            ex = []
            for s in range(layout.pp):
                for g in range(layout.ep):
                    r = layout.expert_rank(0, g, 0, s)
                    if r not in states:
                        states[r] = read_rank_file(step_dir, r)
                    st = states[r]["models"].get(m)
                    if st is None or "experts" not in st:
                        raise ValueError(
                            f"checkpoint {step_dir} rank {r}: no {m} expert shard of {layout}"
                        )
                    ex.append(ExpertShard(spec, layout, r, st["experts"]["flat"]))
            full.update(experts_full(ex))
        path = os.path.join(out, m)
        save_hf(path, config, full, source=_source_config(meta.get("paths", {}).get(m)))
        written.append(path)
    return written


def step_dir(run: str, step: int | None) -> str:
    """out_dir/step_<step>, or the step out_dir/latest names (checked as --resume checks it)."""
    from ..rlhf.checkpoint import latest

    path = os.path.join(run, f"step_{step}") if step is not None else latest(run)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        have = (
            sorted(n for n in os.listdir(run) if n.startswith("step_"))
            if os.path.isdir(run)
            else []
        )
        raise ValueError(f"no checkpoint at {path}; saved steps in {run}: {have or 'none'}")
    return path


def run(args) -> int:
    src = step_dir(args.run, args.step)
    for path in export_checkpoint(src, args.out):
        print(f"exported {path} (from {src})")
    return 0
