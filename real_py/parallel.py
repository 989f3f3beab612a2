"""Process groups of one Layout inside an existing torch.distributed world.

    groups = ParallelGroups(layout)          # every world rank, every layout, same order

`dist.new_group` is collective over the whole world, so EVERY world rank must build the groups
of EVERY layout in the same order, including ranks outside the layout: those get an object with
`member == False` and None groups. Groups are passed explicitly to the models and engines; there
is no module-level state.

Axes (coords from Layout.coords: dp_idx, tp_idx, pp_idx):
  tp_group   ranks sharing (dp, pp), varying tp     tensor-parallel collectives
  dp_group   ranks sharing (tp, pp), varying dp     gradient all-reduce
  pp_group   ranks sharing (dp, tp), varying pp     pipeline broadcasts (tokens, results)
  ep_group   ranks sharing (expert-dp, etp, pp), varying ep (Layout.expert_coords; built only
             when ep > 1): the all-to-all of MoE token dispatch. ep_ranks in ep order.
  edp_group  (moe=True or ep > 1) ranks holding the same experts: sharing (ep, etp, pp), varying
             expert-dp (all dp x tp ranks of the stage when ep = 1); None when that is one rank.
             Expert gradients are summed over it.
  etp_group  (etp > 1) ranks holding the other etp pieces of this rank's experts (same expert-dp,
             ep index and stage): MoE rows gathered / partial outputs reduced over it.
  layout_group (moe=True or ep > 1) every rank of the layout: the MoE aux loss's token counts.
  tied_group (first stage, last stage) of one (dp, tp) pipeline when pp > 1 (tied embeddings);
             None on middle stages, which hold no embedding copy (any pp >= 2 works)

The tied groups are always built when pp > 1 (one small group per pipeline), so an Engine for
a tied-embedding model works with the plain `ParallelGroups(layout)` whatever the spec; every
world rank, middle stages and non-members included, still calls new_group for each of them.
`tied` is accepted for old callers and ignored. `timeout_s` bounds every collective on these groups.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from .layout import Layout, require_layout


class ParallelGroups:
    def __init__(
        self,
        layout: Layout,
        *,
        tied: bool = True,
        timeout_s: float | None = None,
        moe: bool = False,
    ):
        require_layout(layout)
        if not dist.is_initialized():
            raise RuntimeError("ParallelGroups needs an initialized torch.distributed world")
        world = dist.get_world_size()
        if max(layout.ranks) >= world:
            raise ValueError(
                f"layout {layout} uses global rank {max(layout.ranks)} but the world has "
                f"{world} ranks; pick ranks in 0..{world - 1}"
            )
        self.layout = layout
        self.rank = dist.get_rank()
        coords = layout.coords(self.rank)
        self.member = coords is not None
        self.dp_rank, self.tp_rank, self.stage = coords if coords else (-1, -1, -1)
        self.dp_size, self.tp_size, self.pp_size = layout.dp, layout.tp, layout.pp
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        L = layout
        self.tp_group = self.dp_group = self.pp_group = self.tied_group = None
        self.tp_ranks = self.dp_ranks = self.pp_ranks = ()
        # Same enumeration order on every rank: that is what makes new_group safe.
        for p in range(L.pp):
            for d in range(L.dp):
                ranks = tuple(L.rank(d, t, p) for t in range(L.tp))
                g = dist.new_group(list(ranks), **kw)
                if self.rank in ranks:
                    self.tp_group, self.tp_ranks = g, ranks
        for p in range(L.pp):
            for t in range(L.tp):
                ranks = tuple(L.rank(d, t, p) for d in range(L.dp))
                g = dist.new_group(list(ranks), **kw)
                if self.rank in ranks:
                    self.dp_group, self.dp_ranks = g, ranks
        for d in range(L.dp):
            for t in range(L.tp):
                ranks = tuple(L.rank(d, t, p) for p in range(L.pp))
                g = dist.new_group(list(ranks), **kw)
                if self.rank in ranks:
                    self.pp_group, self.pp_ranks = g, ranks
                if L.pp > 1:
                    pair = (ranks[0], ranks[-1])
                    g = dist.new_group(list(pair), **kw)
                    if self.rank in pair:
                        self.tied_group = g
        self.ep_group, self.ep_ranks = None, ()
        self.edp_group = self.layout_group = self.etp_group = None
        if L.etp > 1:  # the pieces of one rank's experts: same expert-dp, ep index and stage
            for p in range(L.pp):
                for e in range(L.edp):
                    for g in range(L.ep):
                        ranks = tuple(L.expert_rank(e, g, t, p) for t in range(L.etp))
                        grp = dist.new_group(list(ranks), **kw)
                        if self.rank in ranks:
                            self.etp_group = grp
        if L.ep > 1:  # every world rank builds them, in this order, like the groups above
            for p in range(L.pp):
                for e in range(L.edp):
                    for t in range(L.etp):
                        ranks = tuple(L.expert_rank(e, g, t, p) for g in range(L.ep))
                        grp = dist.new_group(list(ranks), **kw)
                        if self.rank in ranks:
                            self.ep_group, self.ep_ranks = grp, ranks
        if moe or L.ep > 1:
            for p in range(L.pp):
                for g in range(L.ep):
                    for t in range(L.etp):
                        ranks = tuple(L.expert_rank(e, g, t, p) for e in range(L.edp))
                        grp = dist.new_group(list(ranks), **kw) if len(ranks) > 1 else None
                        if self.rank in ranks:
                            self.edp_group = grp
            grp = dist.new_group(list(L.ranks), **kw)
            if self.member:
                self.layout_group = grp

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (same dp, tp)."""
        return self.pp_ranks[self.stage - 1]

    @property
    def next_rank(self) -> int:
        return self.pp_ranks[self.stage + 1]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_ranks[-1]

    def __repr__(self) -> str:
        if not self.member:
            return f"ParallelGroups({self.layout}, rank={self.rank}, not a member)"
        return (
            f"ParallelGroups({self.layout}, rank={self.rank}, dp={self.dp_rank}, "
            f"tp={self.tp_rank}, stage={self.stage})"
        )
