"""The keys of a `python -m real_py train` config: one dataclass per section, a docstring under
each field, and the embedded default (tiny models, DEFAULT_PLAN on 4 ranks).

A field declared `ranged(default, allowed)` has an allowed range, checked by ranges.py when a
config is built. Reading YAML and overrides into these classes is load.py; the checks that span
fields, files and the plan are checks.py.

One file past 400 lines: it is the reference of the config format, a dataclass per section with
a docstring under each key, meant to be read top to bottom.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ...dataflow.execplan import ExecutionPlan
from ...dataflow.graph import ALGORITHMS, GROUPED, ROLLOUT_LOGP_CALL, Graph, with_engine_logprobs
from ...spec import ModelConfig
from .ranges import ranged

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    num_hidden_layers=4,
    max_position_embeddings=64,
)

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}

DEFAULT_PLAN = {
    "world_size": 4,
    "calls": {
        "actor_gen": {"ranks": [0, 1, 2, 3], "dp": 4, "tp": 1, "pp": 1},
        "ref_inf": {"ranks": [0, 1], "dp": 2, "tp": 1, "pp": 1},
        "rew_inf": {"ranks": [2, 3], "dp": 1, "tp": 2, "pp": 1},
        "critic_inf": {"ranks": [2, 3], "dp": 1, "tp": 1, "pp": 2},
        "actor_train": {"ranks": [0, 1, 2, 3], "dp": 1, "tp": 2, "pp": 2},
        "critic_train": {"ranks": [0, 1, 2, 3], "dp": 2, "tp": 2, "pp": 1},
    },
}
"""The default plan of algo ppo; default_plan(algo) gives every algorithm's."""

_EXTRA_CALLS = {
    # ReMax's greedy baseline generation, beside the sampled one.
    "actor_greedy": {"ranks": [0, 1, 2, 3], "dp": 4, "tp": 1, "pp": 1},
}


def default_plan(algo: str) -> dict:
    """The embedded 4-rank plan of `algo`: DEFAULT_PLAN's layouts for the calls the algorithm's
    graph has (critic-free algorithms drop critic_inf / critic_train), plus ReMax's extra calls."""
    if algo not in ALGORITHMS:
        raise ValueError(f"config algo={algo!r}; allowed: {sorted(ALGORITHMS)}")
    layouts = {**DEFAULT_PLAN["calls"], **_EXTRA_CALLS}
    return {
        "world_size": DEFAULT_PLAN["world_size"],
        "calls": {n: dict(layouts[n]) for n in Graph(ALGORITHMS[algo]).order},
    }


@dataclass(kw_only=True, slots=True)
class DataConfig:
    num_prompts: int = ranged(256, ">= 1")
    """Size of the built-in synthetic prompt set (random token ids, seeded)."""
    batch_size: int = ranged(8, ">= 1")
    """Prompts per iteration (rows of the global batch)."""
    min_prompt_len: int = 3
    max_prompt_len: int = 8
    """Prompt tokens at most (the width of the prompt buffer); see truncate."""
    path: str | None = None
    """Prompt data set: a local .jsonl (one JSON object per line) or .parquet file; None: the
    synthetic prompts (num_prompts, min_prompt_len are used only then)."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt; the other fields go to a reward function as lists."""
    tokenizer_path: str | None = None
    """Local tokenizer directory (transformers AutoTokenizer); None: actor_path if it holds one."""
    chat_template: bool = False
    """Render each prompt (a string or a list of {role, content} messages) with the tokenizer's
    chat template and its generation prompt before tokenizing."""
    truncate: Literal["error", "left", "right"] = "error"
    """A prompt over max_prompt_len tokens: "error" (refuse the data set), "left" (keep its last
    max_prompt_len tokens), "right" (keep its first)."""
    shuffle: bool = True
    """Visit the data set in a seeded random order (else in file order); wraps around."""
    samples_per_step: int = ranged(4, ">= 0")
    """Samples (prompt, response, reward) appended per step to <out_dir>/samples.jsonl; 0: none."""


@dataclass(kw_only=True, slots=True)
class GenConfig:
    max_new_tokens: int = ranged(12, ">= 1")
    min_new_tokens: int = ranged(0, ">= 0 (0: off)")
    """No response ends before this many new tokens: the EOS and stop_token_ids are never sampled
    earlier (transformers' min_new_tokens, vLLM's min_tokens); 0: off."""
    greedy: bool = False
    temperature: float = ranged(1.0, "> 0")
    top_p: float = ranged(1.0, "(0, 1]")
    eos_token_id: int | None = None
    top_k: int = ranged(0, ">= 0 (0: no top-k)")
    """Sample among the top_k most likely tokens only (after temperature, before top_p); 0: all."""
    stop_token_ids: list | None = None
    """More token ids that end a response besides the EOS (e.g. <|im_end|>); the stop token is
    part of the response."""
    decode: Literal["auto", "dynamic", "static", "graph"] = "auto"
    """KV cache and decode step (real_py/engines/decode.py): "auto" replays the decode step from a
    CUDA graph on CUDA with tp == 1 and uses the dynamic (growing) cache elsewhere; "static"
    (the graph's code run eagerly), "dynamic" or "graph" (CUDA with tp == 1 only) force one."""
    engine: Literal["builtin", "vllm"] = "builtin"
    """Who runs the actor's generation call: "builtin" (real_py's engine on the call's layout) or
    "vllm" (vLLM inside the ranks of the call's layout: its tp is vLLM's tensor_parallel_size,
    its dp the number of vLLM replicas; the layout must use every rank, tp fastest, pp 1). With
    vLLM the actor's weights go from its train layout straight into vLLM's live per-rank format
    every step, the rollouts keep vLLM's log-prob of each sampled token (rollout_logp) and an
    extra call, actor_logp (on the actor's train layout unless the plan places it), recomputes
    old_logp with the trainer's weights; the step logs their gap (rollout_logp_diff,
    rollout_kl). Needs vLLM (make vllm-venv; docs/vllm.md)."""
    vllm_logp: Literal["recompute", "rollout"] = "recompute"
    """With engine: vllm, where old_logp (the PPO ratio's denominator, the kl term) comes from:
    "recompute" (the call actor_logp recomputes it with the trainer's weights; the step logs the
    gap to vLLM's) or "rollout" (vLLM's own log-probs are old_logp: no recompute call, the gap
    is not measured and ppo.tis_cap cannot apply; slime's --use-rollout-logprobs, AReaL's
    recompute_logprob: false)."""
    vllm_kv_cache_gib: int = ranged(1, ">= 1")
    """vLLM on CPU: KV-cache memory per rank in whole GiB (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_gpu_memory_utilization: float = ranged(0.3, "(0, 1]")
    """vLLM on GPU: the share of the GPU it may take (weights, KV cache), beside the train
    engines' own memory."""


@dataclass(kw_only=True, slots=True)
class PPOConfig:
    kl_coef: float = ranged(0.05, ">= 0")
    gamma: float = ranged(1.0, "[0, 1]")
    lam: float = ranged(0.95, "[0, 1]")
    clip: float = ranged(0.2, "> 0")
    """Policy ratio clip."""
    value_clip: float = ranged(0.2, "> 0")
    ppo_epochs: int = ranged(2, ">= 1")
    mini_batches: int = ranged(2, ">= 1")
    """Mini-batches per PPO epoch (each an optimizer step)."""
    micro_batches: int = ranged(1, ">= 1")
    """Micro-batches per train step (pipeline schedule)."""
    actor_lr: float = ranged(1e-3, "> 0")
    critic_lr: float = ranged(1e-3, "> 0")
    warmup_steps: int = ranged(0, ">= 0")
    """Optimizer steps of linear learning-rate warmup (actor and critic); 0: none."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after the warmup, over all optimizer steps of the run (steps *
    ppo_epochs * mini_batches), down to min_lr_ratio * the base rate (ppo.lr_at)."""
    min_lr_ratio: float = ranged(0.0, "[0, 1]")
    max_grad_norm: float = ranged(1.0, "> 0")
    adam_eps: float = ranged(1e-8, "> 0")
    group_size: int = ranged(2, ">= 1")
    """GRPO: consecutive rows sharing a prompt (the prompt is repeated group_size times)."""
    whiten_advantages: bool = True
    kl_in: Literal["loss", "reward"] | None = None
    """Where the KL to the reference (coefficient kl_coef, GRPO's beta) enters: "reward" (k1
    penalty -kl_coef * (log pi_old - log pi_ref) per token in the rewards, InstructGPT-style) or
    "loss" (kl_coef * the k3 estimator per token added to the policy loss, as GRPO is published).
    None: "loss" for grpo, "reward" for ppo."""
    entropy_coef: float = 0.0
    """Entropy bonus: the actor loss subtracts entropy_coef * the response-token entropy,
    aggregated like the policy loss (loss_agg); 0 disables."""
    norm_adv_by_std: bool = True
    """grpo: divide the group-centred score by the group's std (GRPO); false: Dr.GRPO (Liu et al.
    2025), which also pairs with loss_agg: seq-mean-token-sum-norm."""
    tis_cap: float | None = ranged(None, ">= 1 or null")
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): every response token's policy loss is weighted by
    min(pi_train_old / pi_rollout, tis_cap), pi_rollout being the generation engine's log-prob of
    the token and pi_train_old the trainer's recompute of it (generation.engine: vllm, where the
    two differ); None: off. Applies to every algorithm's actor loss."""
    clip_high: float | None = ranged(None, "> 0 or null")
    """Upper clip of the ratio, 1 + clip_high (DAPO clip-higher, e.g. 0.28); None: clip. `clip` is
    the lower one, 1 - clip."""
    dual_clip: float | None = ranged(None, "> 1 or null")
    """Dual-clip constant c > 1 (e.g. 3): for negative advantages the loss is capped at -c * A."""
    ratio: Literal["token", "sequence"] = "token"
    """Importance ratio per token (PPO) or per sequence, the geometric mean over the response
    (GSPO, Zheng et al. 2025; use small clips, e.g. clip 3e-4, clip_high 4e-4)."""
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How per-token losses (policy, KL, entropy) become the loss of a global mini-batch (all DP
    ranks and micro-batches together); see ppo.aggregate."""
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    """Estimator of the per-token KL where it enters (kl_in); None: k1 in the reward, k3 in the
    loss."""
    kl_clamp: float | None = ranged(None, "> 0 or null")
    """Clamp the per-token KL estimate to [-kl_clamp, kl_clamp]; None: no clamp."""
    kl_target: float | None = ranged(None, "> 0 or null")
    """Adaptive KL controller (Ziegler et al. 2019): the coefficient starts at kl_coef and after
    each step is multiplied by 1 + clip(KL / kl_target - 1, -0.2, 0.2) * batch_size / kl_horizon, KL
    the step's mean per-sequence k1 sum. None: fixed kl_coef."""
    kl_horizon: int = ranged(10000, ">= 1")
    """Horizon (in samples) of the adaptive KL controller."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, eq. 11): after the reward call, groups
    whose scores are all equal are dropped and their rows regenerated from new prompts (rollout
    calls rerun on those rows only), up to max_gen_rounds generation rounds; groups still all-equal
    after the last round stay (advantage 0). Grouped algorithms only."""
    max_gen_rounds: int = ranged(3, ">= 1")
    """Generation rounds at most per step with dynamic_sampling (1: no refill)."""
    decoupled: bool = False
    """Decoupled PPO objective (AReaL, Fu et al. 2025, eq. 5): per token
    w * clipped-surrogate(pi / pi_prox) with w = pi_prox / pi_behav (detached). pi_behav: the
    log-probs recorded at generation (old_logp); pi_prox: recomputed by an inference call of the
    train engine with the weights before this step's update (the previous version). Works with
    every actor loss (ppo, grpo, rloo, reinforce_pp*, remax); with fresh rollouts w is 1 up to
    layout rounding."""
    behav_imp_weight_cap: float | None = ranged(None, "> 1 or null")
    """With decoupled: tokens whose w = pi_prox / pi_behav exceeds this cap get weight 0 (AReaL's
    behav_imp_weight_cap); None: no cap."""
    whiten_returns: bool = True
    """reinforce_pp / reinforce_pp_baseline: whiten the returns over the global batch
    (REINFORCE++)."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    kind: Literal["model", "rule", "function"] = "model"
    """"model" (the reward model's value at the last token), "rule" (fraction of target_token) or
    "function" (a user callable, `path`)."""
    target_token: int = 7
    path: str | None = None
    """kind "function": "file.py:fn" or "package.module:fn", called as fn(prompts, responses, **row)
    -> list[float] with decoded texts and the data set's other fields (see rlhf/rewards.py)."""
    normalize: bool = False
    """Standardise scores with the running mean and std of every score seen so far, this step's
    included (moments summed over the whole batch, then over steps)."""
    overlong_buffer: int = ranged(0, ">= 0 (0: no overlong penalty)")
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a response longer than
    max_new_tokens - overlong_buffer gets overlong_penalty * (max_new_tokens - overlong_buffer -
    length) / overlong_buffer added (down to -overlong_penalty at max_new_tokens); 0 disables."""
    overlong_penalty: float = ranged(1.0, ">= 0")
    missing_eos_penalty: float | None = None
    """Subtracted from the score of a response that ended without a stop token (truncated)."""
    clip: float | None = ranged(None, "> 0 or null")
    """Clamp the shaped score to [-clip, clip] (after normalisation and penalties); None: no
    clamp."""
    mask_truncated: bool = False
    """Leave truncated responses (no stop token) out of the policy and value losses (DAPO's
    overlong filtering): their tokens get mask 0. They still count in the reward metric."""


@dataclass(kw_only=True, slots=True)
class AsyncConfig:
    max_staleness: int = ranged(0, ">= 0 (0: synchronous)")
    """k: the actor weight version that generated a batch is at most k train steps behind the
    version that trains on it. 0: the synchronous iteration (generation waits for the previous
    train step), bit for bit. k >= 1: the rollout calls of batch s + k run (on their ranks) while
    the train calls of batch s run, with the weights of version s; see rlhf/asyncrl.py."""
    overlap_realloc: bool = False
    """Double-buffered weight transfer (opt-in: it holds a second copy of the actor's generation
    shard on the generation ranks): right after step s's actor update the train ranks send
    version s + 1 to the generation layout while the generation ranks, in a background thread,
    receive it into a second buffer during their generation of step s; step s + 1 generates with
    that buffer without a reallocation at its start. Used when the actor's rollout calls sit on
    ranks disjoint from its train ranks and no other model is reallocated before a rollout call
    (else the transfer happens at the step's start, as with false)."""
    interrupt: bool = False
    """Interruptible generation (with overlap_realloc): between decode steps the generation ranks
    of a replica agree whether version s + 1 has arrived; if so the rollout continues with it
    (KV cache recomputed by one prefill, engines/generate.py). Its tokens then carry two versions
    (per token in `versions`) and their behaviour log-probs are computed with each token's own
    version."""
    interrupt_wait_step: int | None = ranged(None, ">= 1 or null")
    """With interrupt: wait (up to the timeout) for version s + 1 before decode step j, so the swap
    happens exactly there (deterministic runs and tests); None: swap whenever it has arrived."""
    check_versions: bool = False
    """Keep the train ranks' actor shard of the last k + 1 versions and recompute the behaviour
    log-probs of each trained row with the weights of the version it recorded; the step reports
    the max abs difference (version_err) and the one against the newest version
    (version_err_newest). A diagnostic (costs k + 1 shard copies and one inference per step)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    algo: str = "ppo"
    """A key of graph.ALGORITHMS: "ppo" (GAE, critic) or a critic-free one: "grpo", "rloo",
    "reinforce_pp", "reinforce_pp_baseline", "remax". Each has its own default plan."""
    steps: int = ranged(30, ">= 1")
    seed: int = 1234
    out_dir: str = "runs/train"
    save_every: int = ranged(10, ">= 0 (0: no checkpoints)")
    """Checkpoint every N steps (and at the end); 0 disables."""
    actor: dict | None = None
    """ModelConfig fields of the actor (the reference shares it, and its initial weights unless
    ref_path is set); None: a tiny random-init model, or the config of actor_path."""
    critic: dict | None = None
    """ModelConfig fields of the critic and reward model (head is forced to "value")."""
    actor_path: str | None = None
    """HF checkpoint (LLaMA / Qwen2 safetensors) of the actor and reference; `actor` overrides
    its config fields. None: random init from `seed`."""
    critic_path: str | None = None
    """HF checkpoint of the critic (a ...ForSequenceClassification with num_labels=1)."""
    reward_path: str | None = None
    """HF checkpoint of the reward model; None: random init (or critic's shape)."""
    critic_init: Literal["checkpoint", "zero", "normal"] = "checkpoint"
    """Value head of critic_path: "checkpoint" reads its score.weight; "zero" / "normal"
    (N(0, 0.02), seeded) start a fresh head on the checkpoint's body, e.g. a causal-LM (SFT)
    checkpoint whose lm_head is dropped."""
    ref_path: str | None = None
    """HF checkpoint of the reference model; None: actor_path (or the actor's random init). Its
    vocab must cover the actor's (checked before ranks start)."""
    verify_realloc: bool = False
    """Ship a checksum with every reallocation chunk and fail on a mismatch (costs a pass over the
    bytes on both sides)."""
    offload_frozen: bool = False
    """Keep the frozen models' weights (reference, reward model; not a rule reward) in host memory
    except during their call: reloaded just before it, offloaded right after it, every iteration
    (pinned host buffer on GPU; on CPU the working buffer is freed but the copy lives in the same
    RAM). Trainable models (actor, critic) stay in place."""
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenConfig = field(default_factory=GenConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    """YAML key `async` (a Python keyword): asynchronous RL, generation overlapped with training."""
    plan: dict = field(default_factory=dict)
    """ExecutionPlan JSON (or {"path": file.json}); empty: default_plan(algo)."""
    allow_idle_ranks: bool = False
    """Run a plan that leaves some ranks without a call (they only join the world collectives).
    Off by default so that a plan that does not cover the world is caught before launch; ranks a
    plan lists in its own idle_ranks (a searched plan that used fewer ranks than it was searched
    for records them) need no allow_idle_ranks."""
    wandb: dict | None = None
    """Weights & Biases run options passed to `wandb.init` (e.g. {project: rlhf, name: run1}); None:
    no W&B (the package is not imported). TensorBoard events are always written to out_dir."""
    export: Literal["hf"] | None = None
    """"hf": at the end of the run write the trained actor (and critic) as HF checkpoints to
    <out_dir>/hf/actor and <out_dir>/hf/critic (see also `python -m real_py export`)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where every engine runs: "cuda" puts rank r's models on cuda:{LOCAL_RANK} and uses NCCL for
    every collective, reallocation and row push; "cpu" uses gloo; "auto" picks cuda when torch
    sees a GPU."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Parameter and activation dtype of every model: "bf16" keeps the shards (and what a
    reallocation moves) in bfloat16, with fp32 master weights, fp32 Adam states and fp32 gradient
    reduction held by the train engines. Overrides the models' dtype (set it here, not in
    actor/critic)."""

    def model_configs(self) -> dict[str, ModelConfig]:
        out = {}
        tiny = {"actor": TINY, "critic": dict(TINY, num_hidden_layers=2)}
        dtype = PRECISION_DTYPES.get(self.precision)
        for name, d, path, head in (
            ("actor", self.actor, self.actor_path, "lm"),
            ("critic", self.critic, self.critic_path, "value"),
            ("reward", self.critic, self.reward_path, "value"),
        ):
            if d and "dtype" in d and d["dtype"] != dtype:
                raise ValueError(
                    f"config {'actor' if name == 'actor' else 'critic'}.dtype="
                    f"{d['dtype']!r} conflicts with precision={self.precision!r} "
                    f"(dtype {dtype!r}); set precision instead"
                )
            try:
                if path:
                    out[name] = ModelConfig.from_hf(
                        path, **{**(d or {}), "head": head, "dtype": dtype}
                    )
                else:
                    out[name] = ModelConfig(
                        **{
                            **tiny.get(name, tiny["critic"]),
                            **(d or {}),
                            "head": head,
                            "dtype": dtype,
                        }
                    )
            except OSError as e:
                key = {"actor": "actor_path", "critic": "critic_path", "reward": "reward_path"}[
                    name
                ]
                raise ValueError(
                    f"config {key}={path!r}: not an HF checkpoint directory ({e.strerror or e}: "
                    f"{getattr(e, 'filename', None) or path}); give the directory save_pretrained "
                    "wrote (config.json and *.safetensors)"
                ) from None
            except TypeError as e:
                raise ValueError(
                    f"config {name}{' (' + path + ')' if path else ''}: {e}; allowed "
                    f"fields: {[f.name for f in dataclasses.fields(ModelConfig)]}"
                ) from None
        out["ref"] = out["actor"]
        if self.ref_path:
            try:
                out["ref"] = ModelConfig.from_hf(
                    self.ref_path, **{**(self.actor or {}), "head": "lm", "dtype": dtype}
                )
            except OSError as e:
                raise ValueError(
                    f"config ref_path={self.ref_path!r}: not an HF checkpoint directory "
                    f"({e.strerror or e}: {getattr(e, 'filename', None) or self.ref_path}); "
                    "give the directory save_pretrained wrote (config.json and *.safetensors)"
                ) from None
            except TypeError as e:
                raise ValueError(f"config ref ({self.ref_path}): {e}") from None
        return out

    def model_paths(self) -> dict[str, str | None]:
        return {
            "actor": self.actor_path,
            "ref": self.ref_path or self.actor_path,
            "critic": self.critic_path,
            "reward": self.reward_path,
        }

    def execution_plan(self) -> ExecutionPlan:
        data = self.plan or default_plan(self.algo)
        if set(data) == {"path"}:
            if not isinstance(data["path"], str) or not data["path"]:
                raise ValueError(
                    f"config plan.path={data['path']!r}: expected the path of an execution-plan "
                    "JSON file (python -m real_py search --out plan.json)"
                )
            return self._with_engine_calls(ExecutionPlan.from_json(data["path"]))
        return self._with_engine_calls(ExecutionPlan.from_json(data))

    def _with_engine_calls(self, plan: ExecutionPlan) -> ExecutionPlan:
        """generation.engine: vllm adds the call actor_logp; a plan that does not place it runs it
        on the actor's train layout (no reallocation)."""
        if not self.recomputes_logp() or ROLLOUT_LOGP_CALL in plan.calls:
            return plan
        train = Graph(ALGORITHMS[self.algo]).train_call("actor")
        if train not in plan.calls:
            return plan  # validate names the missing call
        return dataclasses.replace(plan, calls={**plan.calls, ROLLOUT_LOGP_CALL: plan.calls[train]})

    def graph(self) -> Graph:
        calls = ALGORITHMS[self.algo]
        if self.async_.max_staleness > 0:
            # The actor's sampling call also writes the weight version of every response token,
            # and the actor's train call reads it (staleness, drop rule, version checks).
            calls = tuple(
                dataclasses.replace(c, writes=c.writes + ("versions",))
                if c.kind == "generate"
                else dataclasses.replace(c, reads=c.reads + ("versions",))
                if c.trains and c.model == "actor"
                else c
                for c in calls
            )
        if self.recomputes_logp():
            calls = with_engine_logprobs(calls)
        return Graph(calls)

    def recomputes_logp(self) -> bool:
        """The graph has the call actor_logp: vLLM generation, old_logp recomputed."""
        return self.generation.engine == "vllm" and self.generation.vllm_logp == "recompute"

    def group_size(self) -> int:
        """Rows per prompt: ppo.group_size for the grouped algorithms, else 1."""
        return self.ppo.group_size if self.algo in GROUPED else 1


def single_process_plan(graph: Graph) -> dict:
    """Every call on (dp1, tp1, pp1) of rank 0: the reference run of the distributed tests."""
    return {
        "world_size": 1,
        "calls": {n: {"ranks": [0], "dp": 1, "tp": 1, "pp": 1} for n in graph.order},
    }
