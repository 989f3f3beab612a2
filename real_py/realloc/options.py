"""A move's options, and every interaction between them, resolved in one place.

    options = MoveOptions(bucket_bytes=64 << 20, verify=True)      # what a caller sets
    resolved = options.resolve(transport, element_size, dtype)     # what runs (ResolvedOptions)

Executors (reallocator.py, moe_exec.py) take the same knobs as keywords
(`Reallocator(plan, transport, bucket_bytes=...)`) or one `options=MoveOptions(...)`. Only
`bucket_bytes` matters to most callers; the rest default to what the transport suits best:

  one_pass   None: on where the transport addresses its peers' buffers (in-process threads, CUDA
             IPC) and verify is off; the knobs below then have no effect (no staging, no rounds)
  pipeline   None: on for asynchronous transports (DistTransport, cupy-NCCL); off leaves 1 slot
  inflight   staging slots with pipelining: 2 by default, 3 allowed; fewer when the bucket holds
             under two elements per slot (1 slot: no pipelining)
  merge      None: on for stream-ordered transports (NCCL): one message per peer and round,
             direct pieces included
  direct_min_bytes  contiguous pieces at least this big travel without staging; an asynchronous
             transport posts them all at the start, unless verify or merge keeps them in rounds
  verify     checksums on the wire: needs the rounds (refused with one_pass=True)
"""

from __future__ import annotations

from dataclasses import dataclass

from .transports.base import Transport

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_DIRECT_MIN_BYTES = 256 << 10
"""Smallest contiguous piece sent without staging inside a mixed message (measured on gloo:
below a few hundred KiB the extra message costs about what the saved copies gain)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class MoveOptions:
    """The knobs of one move, as a caller sets them (None: the transport decides, see resolve)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Staging bound per rank: all slots together stay within it; a round holds bucket / inflight
    bytes (half of it per direction and rank)."""
    pipeline: bool | None = None
    """Pack round r+1 while the rounds before it are on the wire (None: asynchronous transports)."""
    inflight: int | None = None
    """Staging slots with pipelining, 1, 2 or 3 (None: 2)."""
    merge: bool | None = None
    """One message per peer and round, direct pieces included (None: stream-ordered transports)."""
    direct_min_bytes: int | None = DEFAULT_DIRECT_MIN_BYTES
    """Contiguous pieces of at least this many bytes inside a mixed message travel without
    staging (0 or None: every piece of a mixed message is staged)."""
    verify: bool = False
    """An int64 checksum per message travels after the round's data; a mismatch raises
    TransferError naming the chunk, the peer and the round."""
    one_pass: bool | None = None
    """Every chunk a rank receives and its local copies as ONE compiled copy from the senders'
    buffers (None: on for addressable transports without verify; False keeps the rounds)."""

    def __post_init__(self):
        if self.direct_min_bytes is not None and self.direct_min_bytes < 0:
            raise ValueError(
                f"direct_min_bytes={self.direct_min_bytes} must be >= 0 (0 or None: send "
                "every piece of a mixed message through staging)"
            )
        if self.inflight is not None and self.inflight not in (1, 2, 3):
            raise ValueError(f"inflight={self.inflight}: 1, 2 or 3 rounds in flight")

    def resolve(self, transport: Transport, element_size: int, dtype) -> ResolvedOptions:
        """The options for `transport` and elements of `element_size` bytes: every default and
        interaction decided here; ValueError for a combination that cannot run."""
        if self.bucket_bytes < 2 * element_size:
            raise ValueError(
                f"bucket_bytes={self.bucket_bytes} is smaller than two elements of {dtype}"
            )
        bucket_elems = self.bucket_bytes // element_size
        pipeline = transport.asynchronous if self.pipeline is None else self.pipeline
        slots = (self.inflight or 2) if pipeline else 1
        # Slots of at least two elements each, else a single buffer without overlap.
        while slots > 1 and bucket_elems // slots < 2:
            slots -= 1
        merge = (
            getattr(transport, "stream_ordered", False) if self.merge is None else bool(self.merge)
        )
        return ResolvedOptions(
            one_pass=resolve_one_pass(transport, self.one_pass, self.verify),
            round_elems=bucket_elems // slots,
            inflight=slots,
            merge=merge,
            verify=self.verify,
            # An asynchronous transport posts every direct piece at the start (they use no
            # staging); with verify=True (or merged messages) they stay in their rounds.
            direct_first=transport.asynchronous and not self.verify and not merge,
            # Rounded up to whole elements, so a tiny positive threshold never turns it off.
            direct_min_elems=-(-(self.direct_min_bytes or 0) // element_size),
        )


@dataclass(kw_only=True, slots=True, frozen=True)
class ResolvedOptions:
    """MoveOptions decided for one transport and element size: what the executors read."""

    one_pass: bool
    """One compiled copy per rank and move (direct.py): no staging and no rounds, so only
    round_elems and direct_min_elems (which cut the chunks) matter then."""
    round_elems: int
    """Elements per round (bucket / inflight): the per-rank budget is half of it per direction
    (rank_schedule.py)."""
    inflight: int
    """Staging slots: rounds packed or on the wire at once (1: no pipelining)."""
    merge: bool
    """One message per peer and round, direct pieces included (round_layout.py)."""
    verify: bool
    direct_first: bool
    """Direct pieces of every round posted at the start, apart from the rounds."""
    direct_min_elems: int
    """Smallest contiguous piece (elements) cut out of a mixed message to travel unstaged."""

    @property
    def pipeline(self) -> bool:
        return self.inflight > 1


def resolve_one_pass(transport: Transport, one_pass: bool | None, verify: bool) -> bool:
    """one_pass None: on for addressable transports without verify; True where it cannot run:
    ValueError naming why."""
    if getattr(transport, "one_pass_only", False) and (verify or one_pass is False):
        raise ValueError(
            f"{type(transport).__name__} moves in one pass only; verify=True and one_pass=False "
            "need a transport with a wire (DistTransport)"
        )
    if one_pass is None:
        return transport.addressable and not verify
    if one_pass and not transport.addressable:
        raise ValueError(
            f"one_pass=True needs a transport that addresses its peers' buffers "
            f"(in-process, CUDA IPC); {type(transport).__name__} does not"
        )
    if one_pass and verify:
        raise ValueError(
            "verify=True checksums chunks on the wire, and one_pass=True has none; "
            "pass one_pass=False to verify"
        )
    return bool(one_pass)


RoundOptions = ResolvedOptions
"""The name the round loop (rounds.py) used for the resolved options."""

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_MIN_BYTES",
    "MoveOptions",
    "ResolvedOptions",
    "RoundOptions",
    "resolve_one_pass",
]
