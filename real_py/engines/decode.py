"""Decode steps of one pipeline stage: dynamic KV cache, static KV cache, CUDA-graph replay.

    dec = Decoder(engine, batch, max_len, valid, mode)    # valid: bool [B, max_len] (copied)
    out = dec.prefill(inp, pos, mask)                     # the prompt, eager, [B, P] / [B, P, H]
    dec.valid[:, slot] = True                             # the live key mask, [B, >= max_len]
    out = dec.step(inp, pos, slot)                        # one token per sequence at cache `slot`

`out` is the stage's output for the last position: local logits [B, V_local] on the last stage,
hidden [B, n, H] on the others. Modes:

  dynamic  the model's own KVCache: every step attends over the keys written so far (the key
           length grows by one per step, so shapes change every step)
  static   StaticKVCache: the step writes its key/value at a device index (fused with RoPE when
           compiled) and attends over the written part of the cache rounded up to a multiple of
           BUCKET slots (slots past the written ones masked out by `valid`). Within a bucket every
           step has the same shapes and no host-side scalar, which is what makes it capturable
  graph    static, with the step captured into a torch.cuda.CUDAGraph per bucket (static input,
           position and index buffers; `valid` is read in place) and replayed for every token,
           as ReaL does. CUDA only, and only with tp == 1 (no TP collectives inside the capture)

On CPU `static` (asked for explicitly) runs the same code as `graph` does on a GPU, eagerly.

Compiled decode step: in graph mode (CUDA) each decoder layer and the final norm of the step run
through torch.compile (inductor, precision casts emulated as eager rounds them) before capture:
RMSNorm with its residual add, RoPE with the KV-cache write and SwiGLU become single kernels.
One compiled function serves every layer (same code, the weights are its inputs) and every bucket
(the key length is a dynamic dimension). Off with `engine.compile_decode = False` (or the
environment variable REAL_PY_COMPILE_DECODE=0); `compile_decode = True` or a torch.compile backend
name turns it on for `static` too (the CPU tests use "aot_eager"). A failing compile falls back to
the eager layers with a warning.

Reuse across generate() calls: the static cache, the key mask, the input buffers and the captured
graphs live in the engine's DecodeState, keyed by (batch, capacity, dtype, the weights' and the
cache's storage, compile backend); a later generate() with the same batch whose prompt + new
tokens fit the capacity (rounded up to BUCKET) replays the same graphs. Anything else (another
batch, a longer sequence, weights in a new buffer, e.g. after an offload reload into fresh
storage) builds a new state; at most MAX_STATES per engine are kept and `engine.release_decode()`
drops them (their KV cache is device memory held between calls). Reallocations write new weights
into the same storage, which the graphs read on their next replay.
Models with sliding-window attention or dynamic RoPE scaling decode with the dynamic cache only.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

from ..models.transformer import KVCache
from .compiled import backend_of, compiled_calls

BUCKET = 64
"""A decode step attends over the first ceil((slot + 1) / BUCKET) * BUCKET cache slots."""
MAX_STATES = 2
"""DecodeStates (KV cache + graphs) an engine keeps between generate() calls, least recent
dropped."""


class StaticKVCache(KVCache):
    """Keys/values of one layer, preallocated [B, n_kv_local, capacity, hd].

    Prefill (the first update) writes slots [0, P) and returns that prefix, exactly like the
    dynamic cache. Once Decoder sets `decoding` (after prefill) every update writes its one slot
    at `index` (a device int64 [1] shared by all layers of the stage) into the current span's
    views `k_span` / `v_span` (the first `span` slots) and returns them.
    """

    def __init__(
        self,
        batch: int,
        num_kv: int,
        max_len: int,
        head_dim: int,
        dtype,
        device,
        index: torch.Tensor,
    ):
        super().__init__(batch, num_kv, max_len, head_dim, dtype, device)
        self.index, self.decoding = index, False
        self.k_span, self.v_span = self.k, self.v

    def reset(self) -> None:
        self.length, self.decoding = 0, False

    def set_span(self, span: int) -> None:
        self.k_span, self.v_span = self.k[:, :, :span], self.v[:, :, :span]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        if not self.decoding:
            return super().update(k, v)
        self.k_span.index_copy_(2, self.index, k)
        self.v_span.index_copy_(2, self.index, v)
        return self.k_span, self.v_span


MODES = ("dynamic", "static", "graph")


def pick_mode(engine, mode: str) -> str:
    """ "auto": a CUDA graph where one can be captured (CUDA, tp == 1), else the dynamic cache (a
    static cache without a graph only adds attention over the bucket's padding)."""
    allowed = MODES + ("auto",)
    if mode not in allowed:
        raise ValueError(f"decode={mode!r}; allowed: {allowed}")
    c = engine.config
    # The window mask and dynamic RoPE follow the cache's current length, which the static cache
    # (and a captured graph) does not track.
    length_bound = (
        any(c.uses_window(i) for i in range(c.num_hidden_layers))
        or dict(c.rope_scaling or ()).get("rope_type") == "dynamic"
    )
    # MoE: the routing reads expert counts on the host (and ep > 1 runs gloo/NCCL all-to-alls),
    # which a CUDA graph cannot capture
    cuda_ok = engine.device.type == "cuda" and engine.groups.tp_size == 1 and not c.num_experts
    if mode == "auto":
        return "graph" if cuda_ok and not length_bound else "dynamic"
    if mode != "dynamic" and length_bound:
        raise ValueError(
            f"decode={mode!r} needs a model without sliding-window attention and "
            "dynamic RoPE scaling; use decode='dynamic' (or 'auto')"
        )
    if mode == "graph" and not cuda_ok:
        raise ValueError(
            f"decode='graph' needs a CUDA engine with tp == 1 and no experts; this one is "
            f"on {engine.device} with tp={engine.groups.tp_size}, num_experts={c.num_experts}"
        )
    return mode


def compile_backend(engine, mode: str) -> str | None:
    """The torch.compile backend of the decode step, or None for the eager modules.
    engine.compile_decode: None (default: on in graph mode, i.e. on CUDA), True / False, or a
    backend name; REAL_PY_COMPILE_DECODE=0 / 1 / <backend> overrides the default (not an explicit
    setting)."""
    if mode == "dynamic":
        return None
    return backend_of(
        getattr(engine, "compile_decode", None),
        "REAL_PY_COMPILE_DECODE",
        mode == "graph" and engine.config.num_experts == 0,
    )


def _storage_ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().data_ptr()


class DecodeState:
    """What a static / graph decode keeps between generate() calls on one engine: the caches,
    the key mask, the step's index and input buffers, the compiled calls and the graphs."""

    def __init__(self, engine, batch: int, capacity: int, backend: str | None):
        c, model = engine.config, engine.model
        dev = engine.device
        self.batch, self.capacity, self.backend = batch, capacity, backend
        self.index = torch.zeros(1, dtype=torch.int64, device=dev)
        # one column more than capacity: no span's mask view is contiguous, so one compilation
        # covers every span (a contiguous last bucket would specialise a second one)
        self.valid = torch.zeros(batch, capacity + 1, dtype=torch.bool, device=dev)
        # likewise one slot more than capacity: every span's key / value view is strided alike
        self.caches = [
            StaticKVCache(
                batch,
                c.num_key_value_heads // engine.groups.tp_size,
                capacity + 1,
                c.head_dim,
                engine.dtype,
                dev,
                self.index,
            )
            for _ in range(model.hi - model.lo)
        ]
        self.run = compiled_calls(backend) if backend else None
        self.compiled_ok = False
        self.backend_failed = None  # the backend whose first compiled run failed (then eager)
        self.graphs: dict[int, tuple] = {}  # span -> (CUDAGraph, output)
        self.static_inp = self.static_pos = None
        self.pool = None
        self.span = None
        self.weights = _weights_key(engine)

    def fits(self, engine, batch: int, max_len: int, backend) -> bool:
        return (
            batch == self.batch
            and max_len <= self.capacity
            and backend == self.backend
            and _weights_key(engine) == self.weights
        )

    def set_span(self, span: int) -> None:
        if span == self.span:
            return
        self.span = span
        for cache in self.caches:
            cache.set_span(span)
        if self.run is not None:
            for cache in self.caches:  # one compilation for every span
                torch._dynamo.maybe_mark_dynamic(cache.k_span, 2)
                torch._dynamo.maybe_mark_dynamic(cache.v_span, 2)

    def mask(self, span: int) -> torch.Tensor:
        m = self.valid[:, None, None, :span]
        if self.run is not None:
            torch._dynamo.maybe_mark_dynamic(m, 3)
        return m


def _weights_key(engine) -> tuple:
    ex = getattr(engine, "experts", None)
    return (
        engine.dtype,
        str(engine.device),
        _storage_ptr(engine.shard.flat),
        _storage_ptr(ex.flat if ex is not None else None),
    )


def decode_state(engine, batch: int, max_len: int, backend) -> DecodeState:
    """The engine's DecodeState for this call (reused when it fits, else a new one)."""
    states: OrderedDict = engine.__dict__.setdefault("_decode_states", OrderedDict())
    for key, st in states.items():
        if st.fits(engine, batch, max_len, backend):
            states.move_to_end(key)
            return st
    capacity = -(-max_len // BUCKET) * BUCKET
    # a state of the same batch and backend but too short (or stale weights) is replaced
    for key in [k for k, st in states.items() if st.batch == batch and st.backend == backend]:
        del states[key]
    st = DecodeState(engine, batch, capacity, backend)
    states[(batch, capacity, backend, st.weights)] = st
    while len(states) > MAX_STATES:
        states.popitem(last=False)
    return st


class Decoder:
    def __init__(self, engine, batch: int, max_len: int, valid: torch.Tensor, mode: str):
        model = engine.model
        self.model, self.groups, self.mode = model, engine.groups, mode
        self.max_len = max_len
        if mode == "dynamic":
            self.state = None
            self.valid = valid
            self.caches = model.new_caches(batch, max_len)
            return
        st = self.state = decode_state(engine, batch, max_len, compile_backend(engine, mode))
        for cache in st.caches:
            cache.reset()
        st.valid.zero_()
        st.valid[:, :max_len].copy_(valid)
        self.valid, self.caches = st.valid, st.caches

    def _run(self, inp, pos, mask, run=None):
        h = self.model(inp, pos, mask, self.caches, run=run)
        return self.model.head(h[:, -1]) if self.groups.is_last_stage else h

    def prefill(self, inp, pos, mask):
        out = self._run(inp, pos, mask)
        if self.mode != "dynamic":
            for cache in self.caches:
                cache.decoding = True
        return out

    def span(self, slot: int) -> int:
        """Cache slots a step writing `slot` attends over: the bucket holding slot."""
        return min(self.state.capacity, -(-(slot + 1) // BUCKET) * BUCKET)

    def step(self, inp, pos, slot: int):
        """inp: tokens [B, 1] or hidden [B, 1, H]; pos [B, 1]; writes cache slot `slot`."""
        if self.mode == "dynamic":
            return self._run(inp, pos, self.valid[:, None, None, : slot + 1])
        st = self.state
        span = self.span(slot)
        st.index.fill_(slot)
        if self.mode == "static":
            st.set_span(span)
            return self._step_eager(inp, pos, span)
        entry = st.graphs.get(span)
        if entry is None:
            entry = self._capture(inp, pos, span)
        st.static_inp.copy_(inp)
        st.static_pos.copy_(pos)
        entry[0].replay()
        return entry[1]

    def _step_eager(self, inp, pos, span):
        """One step at the current span, compiled when the state compiles (falls back to the
        eager modules if the first compiled run fails)."""
        st = self.state
        if st.run is None:
            return self._run(inp, pos, st.mask(span))
        if st.compiled_ok:
            return self._run(inp, pos, st.mask(span), st.run)
        try:
            out = self._run(inp, pos, st.mask(span), st.run)
        except Exception as e:
            warnings.warn(
                f"compiled decode step failed ({type(e).__name__}: {str(e)[:300]}); "
                "decoding with the eager modules",
                RuntimeWarning,
                stacklevel=2,
            )
            st.run = None
            st.backend_failed = st.backend
            return self._run(inp, pos, st.mask(span))  # rewrites the same slot with the same values
        st.compiled_ok = True
        return out

    def _capture(self, inp, pos, span):
        """Warm up on a side stream (compiles on first use), then capture one step at this span
        (the warm-up writes the same slot with the same values the replay will write, so it
        leaves no trace). Graphs of one state share a memory pool: they never run at once."""
        st = self.state
        if st.static_inp is None:
            st.static_inp, st.static_pos = inp.clone(), pos.clone()
            st.pool = torch.cuda.graph_pool_handle()
        st.static_inp.copy_(inp)
        st.static_pos.copy_(pos)
        st.set_span(span)
        dev = inp.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step_eager(st.static_inp, st.static_pos, span)
        torch.cuda.current_stream(dev).wait_stream(side)
        try:
            st.graphs[span] = self._capture_once(span)
        except Exception as e:
            if st.run is None:
                raise
            warnings.warn(
                f"capturing the compiled decode step failed ({type(e).__name__}: {str(e)[:300]}); "
                "capturing the eager modules",
                RuntimeWarning,
                stacklevel=2,
            )
            torch.cuda.synchronize(dev)
            st.run, st.backend_failed, st.graphs = None, st.backend, {}
            st.graphs[span] = self._capture_once(span)
        return st.graphs[span]

    def _capture_once(self, span):
        st = self.state
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the NCCL watchdog's event queries) must not
        # invalidate the capture.
        with torch.cuda.graph(graph, pool=st.pool, capture_error_mode="thread_local"):
            out = self._run(st.static_inp, st.static_pos, st.mask(span), st.run)
        return graph, out


def release(engine) -> None:
    """Drop the engine's decode states (KV caches, graphs) now."""
    engine.__dict__.pop("_decode_states", None)


__all__ = [
    "Decoder",
    "DecodeState",
    "StaticKVCache",
    "pick_mode",
    "compile_backend",
    "release",
    "MODES",
    "BUCKET",
]
