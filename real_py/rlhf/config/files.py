"""Checks of a train config that read the disk, before any rank starts: the output directory and
every input path exist (`check_paths`), tokenizers agree (`check_same_tokenizer`), checkpoint
headers match their config.json (`check_checkpoints`), and the prompt data, tokenizer and reward
function load (`check_data_and_reward`).
"""

from __future__ import annotations

import json
import os

from ...dataflow.graph import Graph
from ...interop.hf import HFCheckpoint
from ...spec import model_spec
from .paths import path_origin
from .schema import TrainConfig


def check_paths(cfg: TrainConfig) -> None:
    """out_dir is not a file; the checkpoints, prompt file, tokenizer directory, reward file and
    plan file the config names exist."""
    if os.path.exists(cfg.out_dir) and not os.path.isdir(cfg.out_dir):
        raise ValueError(
            f"config out_dir={cfg.out_dir!r} is a file, not a directory; pick another out_dir"
        )
    for key, path in (
        ("actor_path", cfg.actor_path),
        ("critic_path", cfg.critic_path),
        ("reward_path", cfg.reward_path),
        ("ref_path", cfg.ref_path),
    ):
        if path and not os.path.exists(path):
            raise ValueError(
                f"config {key}={path!r}: no such local file or directory "
                f"({path_origin(key, path)}); "
                "only local HF checkpoint directories are read (nothing is downloaded from the "
                "Hub: download it first, e.g. huggingface-cli download, and give its directory)"
            )
    check_input_files(cfg)


def check_input_files(cfg: TrainConfig) -> None:
    """The prompt file, tokenizer directory, reward file and plan file exist; a missing one is
    named with the base its relative path was resolved against (paths.path_origin)."""
    d, plan = cfg.data, cfg.plan
    reward_file = (
        cfg.reward.path.rpartition(":")[0]
        if cfg.reward.kind == "function"
        and isinstance(cfg.reward.path, str)
        and cfg.reward.path.rpartition(":")[0].endswith(".py")
        else None
    )
    plan_file = (
        plan.get("path") if set(plan) == {"path"} and isinstance(plan.get("path"), str) else None
    )
    for key, value, path, ok, what in (
        ("data.path", d.path, d.path, os.path.isfile, "no such file"),
        (
            "data.tokenizer_path",
            d.tokenizer_path,
            d.tokenizer_path,
            os.path.isdir,
            "no such directory",
        ),
        (
            "reward.path",
            cfg.reward.path,
            reward_file,
            os.path.isfile,
            f"no such file {reward_file!r}",
        ),
        ("plan.path", plan_file, plan_file, os.path.isfile, "no such file"),
    ):
        if path and not ok(path):
            raise ValueError(f"config {key}={value!r}: {what} ({path_origin(key, value)})")


def tokenizer_vocab(path: str):
    """token -> id of a checkpoint's tokenizer.json (vocab and added tokens), or None without
    one."""
    f = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(f):
        return None
    try:
        with open(f) as fh:
            d = json.load(fh)
        vocab = dict(d.get("model", {}).get("vocab") or {})
        vocab.update({t["content"]: t["id"] for t in d.get("added_tokens") or ()})
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{f}: not a tokenizers JSON file ({e})") from None
    return vocab


def check_same_tokenizer(actor_path: str, path: str, model: str) -> None:
    a, b = tokenizer_vocab(actor_path), tokenizer_vocab(path)
    if a is None or b is None or a == b:
        return
    diff = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
    raise ValueError(
        f"config: {model} ({path}) and the actor ({actor_path}) have different tokenizers: "
        f"{len(diff)} tokens map to other ids, e.g. {diff[:3]}; {model} would read the "
        "actor's token ids as other tokens"
    )


def check_checkpoints(cfg: TrainConfig, graph: Graph, models: dict) -> None:
    """Read the safetensors headers of every checkpoint the graph's models load (cheap: no tensor
    data), so a truncated or missing file, or a tensor whose shape disagrees with config.json,
    fails here, naming the file and tensor, instead of on every rank after start-up."""
    paths = cfg.model_paths()
    for m in sorted({c.model for c in graph.calls.values()}):
        if not paths.get(m) or (m == "reward" and cfg.reward.kind != "model"):
            continue
        fresh = m == "critic" and cfg.critic_init != "checkpoint"
        try:
            ck = HFCheckpoint(paths[m])
            if m == "reward" and "score.weight" not in ck.shapes:
                raise ValueError(
                    f"config reward_path={paths[m]!r} is not a reward model: it has no value head "
                    "'score.weight' (a causal-LM checkpoint?). A reward model is a trained "
                    "*ForSequenceClassification checkpoint with num_labels=1; critic_init gives "
                    "only the critic a fresh head (it trains; a frozen reward model with a fresh "
                    "head would score at random). Give reward_path such a checkpoint, or score the "
                    "text with reward: {kind: function, path: 'file.py:fn'} and no reward_path"
                )
            if m == "critic" and not fresh and "score.weight" not in ck.shapes:
                raise ValueError(
                    f"config critic_path={paths[m]!r} has no value head 'score.weight' "
                    "(a causal-LM checkpoint?); set critic_init: zero (or normal) to start a fresh "
                    "value head on its body, or give a *ForSequenceClassification checkpoint "
                    "with num_labels=1"
                )
            ck.check(model_spec(models[m], name=m), fresh_head=fresh)
        except ValueError as e:
            if str(e).startswith("config "):
                raise
            raise ValueError(f"model {m} ({paths[m]}): {e}") from None


def check_data_and_reward(cfg: TrainConfig, models: dict) -> None:
    """Load the prompt data set, tokenizer and reward function once, so that any error in them
    shows before ranks start (every rank loads them again, cached per process)."""
    from .. import data as prompt_data
    from ..rewards import FunctionReward, check_call, check_signature

    data = prompt_data.load(cfg, models["actor"].vocab_size)
    if cfg.reward.kind == "function":
        fr = FunctionReward(cfg.reward.path)
        if prompt_data.tokenizer(cfg, data) is None:
            raise ValueError(
                "config reward.kind=function needs a tokenizer to decode responses: set "
                "data.tokenizer_path (or data.path with a tokenizer)"
            )
        if data is None:
            check_signature(fr, [], "no data.path: the built-in synthetic prompts")
        else:
            fields = sorted({k for r in data.rows for k in r} - {data.prompt_key})
            check_signature(
                fr, fields, f"data.path={cfg.data.path!r}, prompt_key={data.prompt_key!r}"
            )
            check_call(fr, data)
