"""What the calibration engines run: `Setup` (the model shape and dtype, the rows and lengths of
one pass per rank; `DEFAULT`, `for_job`, `for_workload`), the layer counts and generation lengths
timed, and the calibration reallocation (`realloc_plan`). Shared by measure.py, which times them,
and fit.py, which fits the timings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..layout import Layout
from ..realloc.plan import plan_realloc
from ..search.costmodel import Workload
from ..spec import ModelConfig, model_spec

G = (2, 10)
"""The two generation lengths per calibration rank (the decode step is their difference)."""
LAYERS = (1, 5)
"""Layer counts of the calibration model: the per-layer cost is the least-squares slope over them,
the fixed cost the mean of what is left at each count."""
PP_LAYERS = 4
"""Layers of the pp=2 calibration engine (2 per stage)."""


@dataclass(frozen=True)
class Setup:
    """What the calibration engines run: a model shape (its layer count varies, LAYERS) and dtype
    and the data of one pass per rank, `rows` sequences of `seq` tokens for inference and
    generation (prompts of `prompt` tokens), `train_rows` for a train step.

    The default is a small model, so that dispatch costs dominate. `for_job` takes the job's own
    actor shape and pass sizes instead, as ReaL profiles the model it plans for: a fixed
    calibration model carries its own size into every estimate (its train step costs about twice
    the default job's shape per layer at the same rows and tokens:
    bench/results/calibration_shape_cpu2_20261204.md). Scored side by side on the same
    measurements (a one-off run of `bench/bench_estimator.py`), the job's setup fits the
    single-rank train steps but estimates the other calls worse: it has the rows of a one-replica
    call, so it charges the ranks of dp > 1 plans for rows they do not hold. The small model is
    the default."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    vocab_size: int = 128
    dtype: str = "float32"
    rows: int = 2
    train_rows: int = 2
    seq: int = 24
    prompt: int = 8

    def __post_init__(self):
        if not 1 <= self.prompt < self.seq:
            raise ValueError(f"Setup: need 1 <= prompt ({self.prompt}) < seq ({self.seq})")
        if min(self.rows, self.train_rows) < 1:
            raise ValueError(
                f"Setup: rows={self.rows} and train_rows={self.train_rows} must be >= 1"
            )

    def config(self, layers: int, head: str = "lm") -> ModelConfig:
        shape = {
            k: v
            for k, v in asdict(self).items()
            if k not in ("rows", "train_rows", "seq", "prompt")
        }
        return ModelConfig(
            **shape,
            max_position_embeddings=max(64, self.seq, self.prompt + G[1]),
            num_hidden_layers=layers,
            head=head,
        )

    @classmethod
    def for_job(
        cls, model: ModelConfig, batch_rows: int, train_rows: int, seq: int, prompt: int
    ) -> Setup:
        """The job's model shape (attention and MLP sizes, vocabulary) and dtype, with its per-rank
        rows of an inference / generation pass and of a train step, its sequence and prompt
        lengths."""
        return cls(
            hidden_size=model.hidden_size,
            intermediate_size=model.intermediate_size,
            num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_key_value_heads,
            vocab_size=model.vocab_size,
            dtype=model.dtype,
            rows=batch_rows,
            train_rows=train_rows,
            seq=seq,
            prompt=prompt,
        )

    @classmethod
    def for_workload(cls, model: ModelConfig, wl: Workload) -> Setup:
        """for_job with one replica's passes of `wl` as the runtime runs them: the whole batch per
        inference / generation pass, one micro-batch of a mini-batch per train pass."""
        return cls.for_job(
            model,
            batch_rows=wl.batch_size,
            train_rows=max(1, wl.batch_size // (wl.ppo_minibatches * wl.micro_batches)),
            seq=wl.seq_len,
            prompt=wl.prompt_len,
        )


DEFAULT = Setup()


def realloc_plan(world: int, cal: Setup = DEFAULT):
    """The calibration reallocation: the calibration model from tp=2 x pp=world/2 (a training
    layout) to dp=world (a generation layout) on every rank, busy at once as in the runtime."""
    spec = model_spec(cal.config(4))
    ranks = tuple(range(world))
    return plan_realloc(
        spec,
        Layout(tp=2, pp=world // 2, ranks=ranks),
        Layout(dp=world, ranks=ranks),
        ranks_per_node=world,
    )
