"""Engine: one rank's view of a model under one layout (generate, inference, train_step).

    groups = ParallelGroups(layout)                  # collective over the whole world
    engine = Engine(config, layout, groups, shard)   # shard: this rank's ModelShard
    engine.inference(tokens, lengths)                # {"logprobs": [B, T-1]} or {"values": [B, T]}
    engine.generate(prompt_tokens, prompt_lengths, seeds, max_new_tokens=...)
    engine.train_step(loss_fn, batch, micro_batches=2)

Every rank of a DP replica (all its TP and PP ranks) calls with the same DP-local batch and gets
the same result tensors back. The engine computes on the device of its shard (`engine.device`:
the runtime puts shards on cuda:{local_rank} on a GPU); inputs may live anywhere and results
come back on the device of the inputs (CPU tensors in, CPU tensors out). MoE models also take the
rank's ExpertShard (`experts=`) and groups built with ParallelGroups(layout, moe=True). The model
reads the shard's flat buffer directly, so writing new weights into `shard.flat` (a reallocation)
takes effect on the next call without a copy.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from ..layout import Layout
from ..models import StageModel
from ..models.tp import gather_from_tp
from ..models.vocab import vocab_parallel_logprobs
from ..realloc.shard import ExpertShard, ModelShard
from ..spec import ModelConfig, model_spec, torch_dtype
from .pipeline import P2P, split_micro_batches


class Engine:
    def __init__(
        self,
        config: ModelConfig,
        layout: Layout,
        groups,
        shard: ModelShard,
        *,
        optim=None,
        experts: ExpertShard | None = None,
        compile_decode: bool | str | None = None,
        compile_train: bool | str | None = None,
    ):
        if layout.dp_shard != "none":
            raise ValueError(
                f"Engine: layout {layout} is dp-sharded (dp_shard={layout.dp_shard!r}); "
                "engines run on whole (stage, tp rank) shards. Reallocate to a layout "
                "with dp_shard='none' first (dp-sharded layouts are for trainers "
                "embedding the reallocation, real_py.interop.embed)"
            )
        if config.qkv_layout != "blocked" or config.gate_up_layout != "blocked":
            raise ValueError(
                f"the engines compute on blocked fused tensors, config has qkv_layout="
                f"{config.qkv_layout!r}, gate_up_layout={config.gate_up_layout!r}; "
                "reallocate into a blocked spec first (plan_realloc(..., dst_model=...))"
            )
        spec = model_spec(config)
        spec.check_compatible(shard.model)
        if shard.layout != layout or groups.layout != layout:
            raise ValueError(
                f"layout mismatch: engine {layout}, shard {shard.layout}, groups {groups.layout}"
            )
        if not groups.member or groups.rank != shard.rank:
            raise ValueError(
                f"rank {groups.rank} is not this shard's rank {shard.rank} in layout {layout}"
            )
        tied = any(p.tied_to_head for p in spec.params)
        # Only the first and last stage hold a copy of a tied embedding;
        # middle stages need no group.
        if (
            tied
            and layout.pp > 1
            and (groups.is_first_stage or groups.is_last_stage)
            and groups.tied_group is None
        ):
            raise ValueError(
                f"tied embeddings with pp > 1: groups for {layout} have no tied group on "
                f"stage {groups.stage}; build them with real_py.parallel.ParallelGroups"
            )
        self.config, self.layout, self.groups, self.shard = config, layout, groups, shard
        self.logit_temperature = 1.0
        """Log-probs and entropy (inference and training) are those of logits / logit_temperature:
        the RL runtime sets it to generation.temperature, so the PPO ratio, the KL and the entropy
        describe the distribution the sampler drew from (as verl and OpenRLHF do)."""
        if config.num_experts and groups.layout_group is None and layout.world > 1:
            raise ValueError(
                f"Engine: {config.model_type} has experts; build its groups with "
                "ParallelGroups(layout, moe=True) (expert-dp and layout groups)"
            )
        self.experts = experts
        self.model = StageModel(
            config,
            shard,
            groups.tp_group,
            experts,
            groups.ep_group,
            getattr(groups, "etp_group", None),
        )
        self.dtype = torch_dtype(config.dtype)
        self.device = shard.flat.device
        self.optim = optim
        self.compile_decode = compile_decode
        """torch.compile of the static / graph decode step (engines/decode.py): None = on for
        CUDA-graph decoding, True / False, or a torch.compile backend name."""
        self.compile_train = compile_train
        """torch.compile of the layers in train steps (engines/compiled.py): None = on for CUDA
        with tp == 1 and no experts, True / False, or a backend name; read when the first train
        step builds the Trainer."""
        self._trainer = None
        self._calls = Counter()

    @contextlib.contextmanager
    def _context(self, op: str):
        """Re-raise collective failures (gloo timeouts, peer crashes) naming rank, layout and
        call."""
        self._calls[op] += 1
        g = self.groups
        try:
            yield
        except RuntimeError as e:
            raise RuntimeError(
                f"rank {g.rank} ({self.layout} dp_rank={g.dp_rank} tp_rank={g.tp_rank} "
                f"stage={g.stage}) failed in {op} call {self._calls[op]}: {e}"
            ) from e

    # -- forward-only pipeline ---------------------------------------------------------------
    def _forward_pipeline(self, mbs, last_fn):
        """Run every micro-batch through the pipeline; last_fn(h, mb) on the last stage."""
        g, p2p, outs = self.groups, P2P(self.groups, self.device), []
        H = self.config.hidden_size
        for mb in mbs:
            tok = mb.data["tokens"]
            b, n = tok.shape
            pos = torch.arange(n, device=self.device).expand(b, n)
            x = tok if g.is_first_stage else p2p.recv((b, n, H), self.dtype, g.prev_rank)
            h = self.model(x, pos)
            if g.is_last_stage:
                outs.append(last_fn(h, mb))
            else:
                p2p.send(h, g.next_rank)
        p2p.flush()
        return outs

    def _bcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        if self.groups.pp_size > 1:
            dist.broadcast(t, self.groups.last_stage_rank, group=self.groups.pp_group)
        return t

    @torch.no_grad()
    def inference(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        *,
        micro_batches: int = 1,
        with_entropy: bool = False,
    ) -> dict:
        """LM head: {"logprobs": [B, T-1]} (log p of tokens[:, 1:]; "entropy" [B, T-1] on request);
        value head: {"values": [B, T]}. Positions past each sequence are 0."""
        with self._context("inference"):
            out = self._inference(
                tokens.to(self.device), lengths.to(self.device), micro_batches, with_entropy
            )
            return {k: v.to(tokens.device) for k, v in out.items()}

    def _inference(self, tokens, lengths, micro_batches, with_entropy):
        B, T = tokens.shape
        mbs = split_micro_batches({"tokens": tokens, "lengths": lengths}, micro_batches)
        lm = self.config.head == "lm"
        keys = (["logprobs"] + (["entropy"] if with_entropy else [])) if lm else ["values"]
        width = T - 1 if lm else T
        result = {k: torch.zeros(B, width, dtype=torch.float32, device=self.device) for k in keys}

        def last_fn(h, mb):
            out = self.head_outputs(h, mb.data["tokens"], with_entropy)
            for k in keys:
                v = out[k].float()
                result[k][mb.index, : v.shape[1]] = v
            return None

        self._forward_pipeline(mbs, last_fn)
        for k in keys:
            ar = torch.arange(width, device=self.device)
            valid = ar < (lengths - 1 if lm else lengths).unsqueeze(1)
            result[k] = self._bcast_from_last(result[k].masked_fill(~valid, 0.0))
        return result

    def head_outputs(self, h: torch.Tensor, tokens: torch.Tensor, with_entropy: bool) -> dict:
        """Last stage: {"logprobs", "entropy"} [b, n-1] of tokens[:, 1:], or {"values"} [b, n]."""
        out = self.model.head(h)
        if self.config.head == "value":
            return {"values": out}
        # chunked over tokens, in fp32 per chunk (models/vocab.py): no [tokens, V] fp32 tensor
        lp, ent = vocab_parallel_logprobs(
            out[:, :-1],
            tokens[:, 1:],
            self.groups.tp_group,
            self.groups.tp_rank,
            self.config.vocab_size,
            with_entropy,
            temperature=self.logit_temperature,
        )
        return {"logprobs": lp, "entropy": ent} if with_entropy else {"logprobs": lp}

    @torch.no_grad()
    def forward_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Full logits [B, T, V] (gathered over TP; for tests and debugging, not for training)."""
        if self.config.head != "lm":
            raise ValueError("forward_logits needs head='lm'; use inference() for values")
        B, T = tokens.shape
        where, tokens = tokens.device, tokens.to(self.device)
        lengths = torch.full((B,), T, dtype=torch.int64, device=self.device)
        full = torch.zeros(B, T, self.config.vocab_size, dtype=self.dtype, device=self.device)

        def last_fn(h, mb):
            logits = gather_from_tp(self.model.head(h), self.groups.tp_group, self.groups.tp_ranks)
            full[mb.index] = logits[..., : self.config.vocab_size]

        self._forward_pipeline(
            split_micro_batches({"tokens": tokens, "lengths": lengths}, 1), last_fn
        )
        return self._bcast_from_last(full).to(where)

    # -- generation and training live in their own modules -----------------------------------
    def generate(self, prompt_tokens, prompt_lengths, seeds, **kw) -> dict:
        from .generate import generate

        with self._context("generate"):
            return generate(self, prompt_tokens, prompt_lengths, seeds, **kw)

    def release_decode(self) -> None:
        """Free the static KV caches and CUDA graphs kept between generate() calls (decode.py)."""
        from .decode import release

        release(self)

    def train_step(self, loss_fn, batch: dict, micro_batches: int = 1, **kw) -> dict:
        from .train import Trainer

        if self._trainer is None:
            self._trainer = Trainer(self, self.optim)
        with self._context("train_step"):
            return self._trainer.step(loss_fn, batch, micro_batches, **kw)
