"""Whether the data-parallel ranks shard, and what: told by the collectives' pattern where no
annotation says (a ZeRO-style or hand-written distributed optimizer records no FSDP op).

A sharded data-parallel step reduce-scatters the gradients (each rank keeps the sum of its
shard) instead of all-reducing them, and all-gathers the parameters each rank updated; it
reduces nothing in the forward pass (a tensor-parallel layer does: the roles of
:mod:`.collectives` say so). From the data-parallel collectives (``role`` parameters):

- :data:`SHARDS_OPTIMIZER`: the gradients reduce-scattered in or after the backward pass and the
  parameters all-gathered outside it (after the optimizer step, or before or in the next
  forward): the optimizer's state and its update are sharded, the forward and backward run
  on whole parameters (ZeRO-1/2, Megatron's distributed optimizer);
- :data:`SHARDS_PARAMETERS`: the parameters all-gathered in the backward pass too (gathered again
  for it after the forward freed them): the parameters are sharded (FSDP, ZeRO-3).
"""

from __future__ import annotations

import pandas as pd

from primus_perf.tracelens.analyses.collectives import (
    ALL_GATHER,
    BACKWARD,
    FORWARD,
    PARAMETERS,
    REDUCE_SCATTER,
)

SHARDS_OPTIMIZER, SHARDS_PARAMETERS = "optimizer", "parameters"  # what the data-parallel ranks shard
PATTERN = "the collectives' pattern"  # how the evidence begins


def _where(phases: pd.Series) -> str:
    found = [p for p in ("forward", "backward", "after backward", "optimizer") if (phases == p).any()]
    text = {"forward": "in the forward pass", "backward": "in the backward pass",
            "after backward": "after the backward pass", "optimizer": "in the optimizer step"}
    return " and ".join(text[p] for p in found)


def _mb(e: pd.DataFrame, per_step: int) -> str:
    b = e["bytes"]
    return f", {b.sum() / 1e6 / per_step:,.0f} MB a step" if len(b) and (b >= 0).all() else ""


def sharding_pattern(events: pd.DataFrame, per_step: int) -> tuple[str, str]:
    """What the ranks shard by the pattern of ``events`` (the analysis's collective events;
    ``per_step``: its (rank, step) pairs): (:data:`SHARDS_OPTIMIZER` or :data:`SHARDS_PARAMETERS`, the
    evidence), or ("", "") when the pattern is not a sharded one."""
    if not len(events):
        return "", ""
    e = events[(events["role"] == PARAMETERS) & (events["step"] >= 0)]
    rs, ag = e[e["collective"] == REDUCE_SCATTER], e[e["collective"] == ALL_GATHER]
    if rs.empty or ag.empty or (rs["phase"] == FORWARD).any():
        return "", ""
    what = SHARDS_PARAMETERS if (ag["phase"] == BACKWARD).any() else SHARDS_OPTIMIZER
    evidence = (f"{PATTERN}: gradients reduce-scattered {_where(rs['phase'])} ({len(rs) / per_step:.0f} a step"
                f"{_mb(rs, per_step)}) and parameters all-gathered {_where(ag['phase'])} ({len(ag) / per_step:.0f} a "
                f"step{_mb(ag, per_step)}), nothing reduced in the forward pass: "
                + ("a sharded optimizer (ZeRO-1/2, a distributed optimizer)" if what == SHARDS_OPTIMIZER
                   else "sharded parameters (ZeRO-3/FSDP-style)"))
    return what, evidence
