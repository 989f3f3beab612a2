"""vLLM as the runtime's generation engine: one vLLM replica per DP replica of the generation
call, living inside the torchrun ranks of that call (vLLM's `external_launcher` executor, as
verl runs it), written in place from the actor's train layout every step.

    rollout = VLLMRollout(config, layout, gen, ...)   # collective: every rank of the world
    rollout.spec                                      # vLLM's live per-rank format (the plan's dst)
    rollout.write(shard)                              # a received shard -> the live model
    out = rollout.generate(prompts, lengths, seeds, sampling)

Why inside the ranks: the job stays one unit (no process outside torchrun: killing the launcher
ends vLLM too, and vLLM's output is the rank's output, which the launcher already keeps in
<out_dir>/logs/), and the ranks of the generation layout ARE the vLLM workers, so the weights
reach them with the runtime's own reallocation, planned into vLLM's live format
(real_py.spec.vllm_config), at the minimum bytes, ranks that hold a piece on both sides copying
it locally; the write and re-processing is the real_py backend's (worker.write_dense). The cost:
vLLM's tensor-parallel groups are cut from the whole torch world (consecutive ranks), so the
generation layout must use every rank, tp fastest, pp = 1 (checked before launch:
real_py.dataflow.rules.vllm_layout_errors).

Sampling: one vLLM request per row with the row's seed (vLLM seeds each request's own
generator, so a row's tokens do not depend on its neighbours); greedy is temperature 0; stop
tokens are the runtime's (EOS and generation.stop_token_ids, kept in the response), vLLM's own
EOS ignored; the log-prob of every sampled token is kept ("processed": after temperature, and
top-k / top-p when set, i.e. the distribution the token was drawn from).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..layout import Layout
from ..spec import ModelConfig, model_spec, vllm_config
from .names import unknown_params
from .worker import check_live_shapes, write_dense


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """The runtime's generation settings, as vLLM reads them."""

    max_new_tokens: int
    min_new_tokens: int = 0
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0


class VLLMRollout:
    def __init__(
        self,
        config: ModelConfig,
        layout: Layout,
        *,
        max_model_len: int,
        seed: int,
        source: str | None = None,
        kv_cache_gib: int = 1,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        block_size: int | None = None,
    ):
        """Start this rank's vLLM worker (collective over the world: every rank, same time).

        config: the actor's ModelConfig; source: its HF checkpoint directory, whose config.json
        vLLM reads (None: one written from `config`). No weights are loaded (load_format dummy):
        the runtime writes the actor's before the first generation."""
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if layout.pp != 1 or tuple(layout.ranks) != tuple(range(world)) or config.num_experts:
            raise ValueError(
                f"vLLM generation on {layout} in a world of {world}: see "
                "real_py.dataflow.rules.vllm_layout_errors"
            )
        self.layout, self.config = layout, config
        self.tp = layout.tp
        self.spec = model_spec(vllm_config(config, self.tp), name="actor")
        self._dir = tempfile.mkdtemp(prefix=f"real_py_vllm_rank{self.rank}_")
        from ..interop.hf import hf_config_dict

        src = None
        if source and os.path.isfile(os.path.join(source, "config.json")):
            with open(os.path.join(source, "config.json")) as f:
                src = json.load(f)
        with open(os.path.join(self._dir, "config.json"), "w") as f:
            json.dump(hf_config_dict(config, source=src), f, default=str)
        # vLLM's external launcher reads the torchrun environment; the runtime's world may come
        # from elsewhere (tests spawn ranks), so it is written from the live world.
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("WORLD_SIZE", str(world))
        os.environ.setdefault("LOCAL_RANK", str(self.rank))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm import LLM

        kw = {"block_size": block_size} if block_size else {}
        try:
            self.llm = LLM(
                model=self._dir,
                tensor_parallel_size=self.tp,
                distributed_executor_backend="external_launcher",
                dtype=config.dtype,
                load_format="dummy",
                skip_tokenizer_init=True,
                enforce_eager=enforce_eager,
                max_model_len=max_model_len,
                seed=seed,
                enable_prefix_caching=True,
                gpu_memory_utilization=gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
                **kw,
            )
        except Exception as e:
            lines = [
                x.strip()
                for x in str(e).splitlines()
                if x.strip() and not x.strip().startswith("For further information")
            ]
            hint = ""
            if not cuda:
                _unlink_cpu_shm(self.rank)  # what this rank created before the failure
            if "create shm" in str(e):
                names = " ".join(sorted(glob.glob("/dev/shm/*cpushm_*")))
                hint = (
                    f" (shared-memory names of the same kind exist: {names or 'none now'}; another "
                    "vLLM job with tp > 1 is starting on this machine, or one was killed while "
                    "starting: if none runs, remove them with `rm -- <file>`)"
                )
            raise RuntimeError(
                f"rank {self.rank}: vLLM did not start for the actor "
                f"({config.model_type}, tp={self.tp}, max_model_len={max_model_len}): "
                f"{type(e).__name__}: {' | '.join(lines)[:600]}{hint}"
            ) from e
        if not cuda:
            _unlink_cpu_shm(self.rank)
        self.model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        unknown = unknown_params(self.spec, self.model)
        if unknown:
            raise RuntimeError(
                f"rank {self.rank}: vLLM's {type(self.model).__name__} holds parameters "
                f"real_py does not plan: {unknown[:6]}"
            )
        check_live_shapes(self.model, self.spec, self.tp, f"rank {self.rank}")

    def write(self, shard) -> None:
        """The actor's shard, received in vLLM's live format, into the live model; the prefix
        cache is dropped (its KV blocks were computed with the previous weights)."""
        write_dense(self.model, self.spec, shard)
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def generate(
        self,
        prompt_tokens: torch.Tensor,
        prompt_lengths: torch.Tensor,
        seeds: torch.Tensor,
        s: Sampling,
    ) -> dict:
        """prompt_tokens [B, P] right-padded, prompt_lengths [B], seeds [B]. Returns {"tokens":
        [B, P' + N] right-padded prompt + response, "lengths": [B], "logprobs": [B, P' + N - 1]
        (vLLM's log-prob of each response token at the position that predicts it, 0 elsewhere)}."""
        from vllm import SamplingParams

        B = prompt_tokens.shape[0]
        pl = prompt_lengths.cpu().tolist()
        prompts = [{"prompt_token_ids": prompt_tokens[b, : pl[b]].tolist()} for b in range(B)]
        params = [
            SamplingParams(
                max_tokens=s.max_new_tokens,
                min_tokens=s.min_new_tokens,
                temperature=0.0 if s.greedy else s.temperature,
                top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else 0,
                seed=int(seeds[b]),
                stop_token_ids=list(s.stop_token_ids),
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
            )
            for b in range(B)
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        new = [list(o.outputs[0].token_ids) for o in outs]
        width = max(pl[b] + len(new[b]) for b in range(B))
        tokens = torch.full((B, width), s.pad_token_id, dtype=torch.int64)
        logp = torch.zeros(B, max(width - 1, 1), dtype=torch.float32)
        for b, o in enumerate(outs):
            n = pl[b]
            tokens[b, :n] = prompt_tokens[b, :n].cpu()
            tokens[b, n : n + len(new[b])] = torch.tensor(new[b], dtype=torch.int64)
            for k, (tok, d) in enumerate(zip(new[b], o.outputs[0].logprobs or [])):
                logp[b, n - 1 + k] = d[tok].logprob
        lengths = torch.tensor([pl[b] + len(new[b]) for b in range(B)], dtype=torch.int64)
        where = prompt_tokens.device
        return {
            "tokens": tokens.to(where),
            "lengths": lengths.to(where),
            "logprobs": logp.to(where),
        }

    def close(self) -> None:
        """End this rank's vLLM now, while the process groups live: vLLM's own teardown (the one
        it runs when the LLM is collected), which destroys its groups and, as its
        cleanup_dist_env_and_memory does, torch.distributed's default group; so close last. Left
        to interpreter exit it ran after the groups were gone and printed tracebacks."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["Sampling", "VLLMRollout"]


def _unlink_cpu_shm(rank: int) -> None:
    """Remove the names of the shared-memory segments this rank created for vLLM's CPU tp / pp
    groups (each rank creates one per group, "-tp:0-[0-1]-cpushm_<i>", and maps its peers').

    Under the external launcher every job's segments get the same names (the worker derives them
    from the init method, "env://"), and vLLM never unlinks them, so the next job with tp > 1 on
    the machine failed to start ("create shm in SHMManager failed. errno: 17"). Every rank of a
    group has mapped every segment of it by the time LLM() returns (vLLM's barrier after the
    join), so the names can go now; the mappings live on until the process ends. Only this rank's
    own segments, and only while still named: a name already gone may have been taken again by a
    job that started since."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "cpushm" in line}
    except OSError:
        return
    for path in paths:
        m = re.search(r"\[([\d-]+)\]-cpushm_(\d+)$", path)
        if not path.startswith("/dev/shm/") or m is None:
            continue  # " (deleted)": already unnamed
        ranks, i = [int(r) for r in m.group(1).split("-")], int(m.group(2))
        if (ranks[i] if i < len(ranks) else i) != rank:
            continue  # a peer's segment: the peer removes its name
        try:
            os.unlink(path)
        except OSError:
            pass
