"""Micro-batching by length and point-to-point activation transfer between pipeline stages.

Variable-length batches arrive right-padded (tokens [B, T], lengths [B]). Sequences are sorted by
length (longest first) and cut into contiguous micro-batches, each trimmed to its own longest
sequence, so a micro-batch only computes padding up to its own maximum. With right padding, the
causal mask alone keeps padding from reaching real tokens, so no attention mask is needed.
Every rank of a DP replica sees the same batch and therefore derives the same micro-batches and
shapes; receivers allocate from those shapes and no shape metadata is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class MicroBatch:
    index: torch.Tensor
    """[b] rows of the DP-local batch, longest first."""
    length: int
    """Longest sequence in the micro-batch: every [B, T] tensor is trimmed to [b, length]."""
    data: dict
    """The batch entries restricted to `index` and trimmed (see split_micro_batches)."""


def split_micro_batches(batch: dict, num: int) -> list[MicroBatch]:
    """batch: "tokens" [B, T] int64 right-padded, "lengths" [B], other tensors with leading dim B.

    Tensors whose dim 1 equals T (or T - 1, per-token quantities of next-token predictions) are
    trimmed to the micro-batch's length (or length - 1).
    """
    tokens, lengths = batch.get("tokens"), batch.get("lengths")
    if tokens is None or lengths is None or tokens.dim() != 2:
        raise ValueError("batch needs 'tokens' [B, T] int64 (right-padded) and 'lengths' [B]")
    B, T = tokens.shape
    if lengths.shape != (B,) or int(lengths.min()) < 1 or int(lengths.max()) > T:
        raise ValueError(
            f"lengths must be [B={B}] in [1, T={T}], got shape {tuple(lengths.shape)} "
            f"range [{int(lengths.min())}, {int(lengths.max())}]"
        )
    if not 1 <= num <= B:
        raise ValueError(f"micro_batches={num} must be in [1, batch size {B}]")
    for k, v in batch.items():
        if not torch.is_tensor(v) or v.shape[:1] != (B,):
            raise ValueError(f"batch[{k!r}] must be a tensor with leading dim {B}")
    order = torch.argsort(lengths, descending=True, stable=True)
    out = []
    for idx in order.tensor_split(num):
        n = int(lengths[idx].max())
        data = {}
        for k, v in batch.items():
            v = v.index_select(0, idx)
            if v.dim() >= 2 and v.shape[1] == T:
                v = v[:, :n]
            elif v.dim() >= 2 and v.shape[1] == T - 1:
                v = v[:, : n - 1]
            data[k] = v.contiguous()
        out.append(MicroBatch(idx, n, data))
    return out


class P2P:
    """Asynchronous sends and blocking receives inside one pipeline; sends are waited in flush()."""

    def __init__(self, groups, device=None):
        self.groups, self.device, self.pending = groups, device, []

    def send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self.pending.append((dist.isend(t, dst, group=self.groups.pp_group), t))

    def recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, src, group=self.groups.pp_group)
        return t

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
