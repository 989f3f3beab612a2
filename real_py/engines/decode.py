"""Decode steps of one pipeline stage: dynamic KV cache, static KV cache, CUDA-graph replay.

    dec = Decoder(engine, batch, max_len, valid, mode)    # valid: bool [B, max_len], updated in place
    out = dec.prefill(inp, pos, mask)                     # the prompt, eager, [B, P] / [B, P, H]
    out = dec.step(inp, pos, slot)                        # one token per sequence at cache `slot`

`out` is the stage's output for the last position: local logits [B, V_local] on the last stage,
hidden [B, n, H] on the others. Modes:

  dynamic  the model's own KVCache: every step attends over the keys written so far (the key
           length grows by one per step, so shapes change every step)
  static   StaticKVCache: the step writes its key/value at a device index and attends over the
           whole preallocated cache; unwritten slots are masked out by `valid`. Every step has
           the same shapes and no host-side scalar, which is what makes it capturable
  graph    static, with the step captured once into a torch.cuda.CUDAGraph (static input,
           position and index buffers; `valid` is read in place) and replayed for every token,
           as ReaL does. CUDA only, and only with tp == 1 (no TP collectives inside the capture)

On CPU `static` (asked for explicitly) runs the same code as `graph` does on a GPU, eagerly. A
graph is captured per generate() call and dropped with it, so reallocations and offload reloads
(which may move the weights' storage) never meet a stale graph. Models with sliding-window
attention or dynamic RoPE scaling decode with the dynamic cache only.
"""

from __future__ import annotations

import torch

from ..models.transformer import KVCache


class StaticKVCache(KVCache):
    """Keys/values of one layer, preallocated [B, n_kv_local, max_len, hd].

    Prefill (the first update) writes slots [0, P) and returns that prefix, exactly like the
    dynamic cache. Once Decoder sets `decoding` (after prefill) every update writes its one slot
    at `index` (a device int64 [1] shared by all layers of the stage) and returns the whole
    buffers.
    """

    def __init__(self, batch: int, num_kv: int, max_len: int, head_dim: int, dtype, device,
                 index: torch.Tensor):
        super().__init__(batch, num_kv, max_len, head_dim, dtype, device)
        self.index, self.decoding = index, False

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple:
        if not self.decoding:
            return super().update(k, v)
        self.k.index_copy_(2, self.index, k)
        self.v.index_copy_(2, self.index, v)
        return self.k, self.v


MODES = ("dynamic", "static", "graph")


def pick_mode(engine, mode: str) -> str:
    """"auto": a CUDA graph where one can be captured (CUDA, tp == 1), else the dynamic cache (a
    static cache without a graph only adds attention over the whole preallocated length)."""
    allowed = MODES + ("auto",)
    if mode not in allowed:
        raise ValueError(f"decode={mode!r}; allowed: {allowed}")
    c = engine.config
    # The window mask and dynamic RoPE follow the cache's current length, which the static cache
    # (and a captured graph) does not track.
    length_bound = (any(c.uses_window(i) for i in range(c.num_hidden_layers))
                    or dict(c.rope_scaling or ()).get("rope_type") == "dynamic")
    # MoE: the routing reads expert counts on the host (and ep > 1 runs gloo/NCCL all-to-alls),
    # which a CUDA graph cannot capture
    cuda_ok = engine.device.type == "cuda" and engine.groups.tp_size == 1 and not c.num_experts
    if mode == "auto":
        return "graph" if cuda_ok and not length_bound else "dynamic"
    if mode != "dynamic" and length_bound:
        raise ValueError(f"decode={mode!r} needs a model without sliding-window attention and "
                         "dynamic RoPE scaling; use decode='dynamic' (or 'auto')")
    if mode == "graph" and not cuda_ok:
        raise ValueError(f"decode='graph' needs a CUDA engine with tp == 1 and no experts; this one is "
                         f"on {engine.device} with tp={engine.groups.tp_size}, num_experts={c.num_experts}")
    return mode


class Decoder:
    def __init__(self, engine, batch: int, max_len: int, valid: torch.Tensor, mode: str):
        c, model = engine.config, engine.model
        self.model, self.groups, self.valid, self.mode = model, engine.groups, valid, mode
        self.index = torch.zeros(1, dtype=torch.int64, device=engine.device)
        if mode == "dynamic":
            self.caches = model.new_caches(batch, max_len)
        else:
            self.caches = [StaticKVCache(batch, c.num_key_value_heads // engine.groups.tp_size,
                                         max_len, c.head_dim, engine.dtype, engine.device, self.index)
                           for _ in range(model.hi - model.lo)]
        self.graph = None

    def _run(self, inp, pos, mask):
        h = self.model(inp, pos, mask, self.caches)
        return self.model.head(h[:, -1]) if self.groups.is_last_stage else h

    def prefill(self, inp, pos, mask):
        out = self._run(inp, pos, mask)
        if self.mode != "dynamic":
            for cache in self.caches:
                cache.decoding = True
        return out

    def step(self, inp, pos, slot: int):
        """inp: tokens [B, 1] or hidden [B, 1, H]; pos [B, 1]; writes cache slot `slot`."""
        if self.mode == "dynamic":
            return self._run(inp, pos, self.valid[:, None, None, :slot + 1])
        self.index.fill_(slot)
        if self.mode == "static":
            return self._run(inp, pos, self.valid[:, None, None, :])
        if self.graph is None:
            self._capture(inp, pos)
        self.static_inp.copy_(inp)
        self.static_pos.copy_(pos)
        self.graph.replay()
        return self.static_out

    def _capture(self, inp, pos):
        """Warm up on a side stream, then capture one step (the warm-up writes the same slot
        with the same values the replay will write, so it leaves no trace)."""
        self.static_inp, self.static_pos = inp.clone(), pos.clone()
        mask = self.valid[:, None, None, :]
        side = torch.cuda.Stream(device=inp.device)
        side.wait_stream(torch.cuda.current_stream(inp.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(self.static_inp, self.static_pos, mask)
        torch.cuda.current_stream(inp.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the NCCL watchdog's event queries) must not
        # invalidate the capture.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.static_out = self._run(self.static_inp, self.static_pos, mask)


__all__ = ["Decoder", "StaticKVCache", "pick_mode", "MODES"]
