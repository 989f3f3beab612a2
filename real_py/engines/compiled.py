"""torch.compile of the decoder layers, shared by the decode step (decode.py) and the train step
(train.py).

    # for StageModel.forward(..., run=(layer_fn, norm_fn))
    layer_fn, norm_fn = compiled_calls("inductor")
    calls = TrainCalls("inductor"); model(x, pos, run=calls.run)

One compiled function serves every layer of every engine of the process: the layer module, its
weights and its KV cache are inputs (guards on their shapes and on the module's constant
attributes), not constants, so a 22-layer model compiles one layer graph. Inductor runs with
emulate_precision_casts (bf16 intermediates rounded where eager rounds them), so fused kernels
keep eager's numerics up to the order of reductions.
"""

from __future__ import annotations

import os
import warnings

import torch


def backend_of(opt, env: str, default: bool) -> str | None:
    """An engine's compile setting (None = default, True / False, or a backend name), the
    environment variable `env` (0 / 1 / <backend>) overriding only the default."""
    if opt is None:
        val = os.environ.get(env)
        if val is not None:
            opt = (
                False
                if val.lower() in ("0", "false", "no", "")
                else (True if val.lower() in ("1", "true") else val)
            )
    if opt is None:
        opt = default
    if opt is False:
        return None
    return "inductor" if opt is True else str(opt)


def _layer_call(layer, h, cos, sin, mask, cache):
    return layer(h, cos, sin, mask, cache)


def _norm_call(norm, h):
    return norm(h)


_COMPILED: dict[str, tuple] = {}


def compiled_calls(backend: str) -> tuple:
    """(layer_fn, norm_fn) compiled with `backend`, shared by every engine of the process."""
    if backend not in _COMPILED:
        import torch._dynamo

        cfg = torch._dynamo.config
        # one cache entry per (batch, dtype, grad mode, model family); many engines of one test
        # process may exceed the default of 8 and would then silently run eagerly
        for name in ("recompile_limit", "cache_size_limit"):
            if getattr(cfg, name, 64) < 64:
                setattr(cfg, name, 64)
        opts = {}
        if backend == "inductor":
            import torch._inductor.config as ind

            if hasattr(ind, "emulate_precision_casts"):
                opts["emulate_precision_casts"] = True  # round bf16 intermediates as eager does
        kw = {"options": opts} if opts else {}
        _COMPILED[backend] = (
            torch.compile(_layer_call, backend=backend, **kw),
            torch.compile(_norm_call, backend=backend, **kw),
        )
    return _COMPILED[backend]


class TrainCalls:
    """run=(layer_fn, norm_fn) for a train step's StageModel.forward: the compiled layer and
    final norm with the micro-batch's batch and length dimensions dynamic (one compilation for
    every micro-batch shape). If the first compiled forward fails, a warning and the eager
    modules from then on (a failure inside the compiled backward is not caught: it raises)."""

    def __init__(self, backend: str):
        self.backend = backend
        self.layer, self.norm = compiled_calls(backend)
        self.ok, self.failed = False, None
        self.run = (self.layer_fn, self.norm_fn)

    def _call(self, fn, eager, args):
        if self.failed is not None:
            return eager(*args)
        for t in args[1:]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(t, 0)
                torch._dynamo.maybe_mark_dynamic(t, 1)
        if self.ok:
            return fn(*args)
        try:
            out = fn(*args)
        except Exception as e:
            warnings.warn(
                f"compiled train forward failed ({type(e).__name__}: {str(e)[:300]}); training "
                "with the eager modules",
                RuntimeWarning,
                stacklevel=3,
            )
            self.failed = f"{type(e).__name__}: {e}"
            return eager(*args)
        self.ok = True
        return out

    def layer_fn(self, layer, h, cos, sin, mask, cache):
        return self._call(self.layer, _layer_call, (layer, h, cos, sin, mask, cache))

    def norm_fn(self, norm, h):
        return self._call(self.norm, _norm_call, (norm, h))


__all__ = ["backend_of", "compiled_calls", "TrainCalls"]
