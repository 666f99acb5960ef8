"""Gradient accumulation: what a larger micro-batch at the same global batch saves, in any trace.

A step that runs m backward passes before its optimizer step (:mod:`..micro_batches`: the
autograd engine's passes) does some work once per micro-batch whatever its size:

- per-parameter work outside the optimizer step (the ``param_shaped`` GPU events: the
  gradients' accumulation into ``.grad``, from the second micro-batch on; autocast's weight
  casts; the embedding's dense gradient; FSDP2's copies into and out of its collectives'
  buffers and its sharded gradients' accumulation);
- the data-parallel collectives of the passes (FSDP2's all-gathers in the forward and the
  backward, its reduce-scatters): their exposed time, no compute kernel beside them
  (:func:`comm_exposure`);
- the GPU's idle time that the host causes once per micro-batch: its syncs made once per
  micro-batch (a mask check's ``.item()``: the GPU idles while the host waits, then while it
  refills the queue; the step replayed without them, :mod:`.host_idle`, in their share of the
  syncs' idle time) and, where the trace shows its micro-batches, its launch-bound stretches (a
  micro-batch's first kernels are short, and the GPU waits for the host until its queue fills:
  the step replayed without the host's launch time), at most the step's idle time.

Merging k micro-batches into one: with T_i the work of micro-batch i of the step, m/k
micro-batches k times the size do the work of the first of each group of k, so the saving is
``sum(T_i) - sum(T_jk)`` (the accumulation's adds, absent from the first micro-batch, all go
when k = m); where the trace does not place a GPU event in its micro-batch, its work is taken
as even: ``T (1 - 1/k)``. Not counted: the GEMMs' efficiency at k times the rows (small at
4,096 rows and more on Hopper), the host's launches per token (CUDA graphs' bound is advised
apart).

Checked on an H200 (Qwen2 with 7B dims, 4 layers, 2 x 2,048 tokens a micro-batch, 4
micro-batches, bf16, foreach AdamW, a plain Hugging Face transformers script): one GPU,
micro-batch 8 at the same global batch estimated 18.5 ms a step, measured 21 (337 -> 316 ms);
FSDP2 over 2 GPUs estimated 94.6, measured 79 (411 -> 332 ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.tracelens.analyses.breakdown import covered
from primus_perf.tracelens.analyses.fusion import MEMORY_BOUND
from primus_perf.tracelens.analyses.hotspots import in_steps
from primus_perf.tracelens.categories import COMMUNICATION, MEMCPY, MEMSET


def comm_exposure(a: Any) -> pd.DataFrame:
    """One row per communication GPU event in the steps: its role, collective, phase, step and
    micro-batch, and ``exposed_ms``: its time no compute kernel of its rank overlaps, scaled
    so that all the events add up to the temporal breakdown's exposed communication per step
    (events on several streams at once are counted once there). Empty where the collective
    events do not align with the communication kernels."""
    k, ev = a.kernels, a.collective_events
    comm = np.flatnonzero((k["category"] == COMMUNICATION).to_numpy())
    cols = ["role", "collective", "phase", "step", "micro_batch", "exposed_ms"]
    if a.temporal.empty or len(ev) != len(comm) or not len(comm):
        return pd.DataFrame(columns=cols)
    rank = k["rank"].to_numpy()
    start = k["ts_us"].to_numpy(dtype=np.float64)
    end = start + k["dur_us"].to_numpy(dtype=np.float64)
    compute = ~k["category"].isin((COMMUNICATION, MEMCPY, MEMSET)).to_numpy()
    alone = np.zeros(len(comm))
    for r in np.unique(rank[comm]).tolist():
        mine = rank[comm] == r
        c, w = comm[mine], compute & (rank == r)
        alone[mine] = (end[c] - start[c]) - covered(start[w], end[w], start[c], end[c])
    mb = k["micro_batch"].to_numpy()[comm] if "micro_batch" in k.columns else np.full(len(comm), -1)
    out = pd.DataFrame({"role": ev["role"].to_numpy(), "collective": ev["collective"].to_numpy(),
                        "phase": ev["phase"].to_numpy() if "phase" in ev.columns else "",
                        "step": ev["step"].to_numpy(), "micro_batch": mb, "exposed_ms": alone})
    out = out[out["step"] >= 0]
    total = float(out["exposed_ms"].sum())
    scale = float(a.temporal["exposed_comm_s"].mean()) * 1e3 / total if total > 0 else 0.0
    return out.assign(exposed_ms=out["exposed_ms"] * scale)


def merged_saving(values: pd.Series, index: pd.Series, m: int, k: int) -> float:
    """What ``m`` micro-batches merged ``k`` at a time save of work ``values`` done in
    micro-batch ``index`` (0..m-1; -1 unknown): ``sum(T_i) - sum(T_jk)``, the unplaced work
    taken as even (see the module docstring)."""
    v = values.to_numpy(dtype=np.float64)
    i = index.to_numpy()
    placed = (i >= 0) & (i < m)
    total_placed = float(v[placed].sum())
    first = float(v[placed & (i % k == 0)].sum())
    return (total_placed - first) + float(v[~placed].sum()) * (1 - 1 / k)


@dataclass
class MicroBatchCost:
    """Per step (ms): the per-parameter work, the exposed per-micro-batch collectives and the
    per-micro-batch syncs' cost, each as traced and as saved by merging ``k`` micro-batches
    of ``m``; ``by_op``: the per-parameter work by op; ``syncs``: the per-micro-batch sync
    sites."""

    m: int
    k: int
    param_ms: float = 0.0
    param_saved_ms: float = 0.0
    comm_ms: float = 0.0
    comm_saved_ms: float = 0.0
    sync_ms: float = 0.0  # the GPU's idle time the host causes once per micro-batch
    sync_saved_ms: float = 0.0
    placed: bool = False  # the GPU events were placed in their micro-batches
    by_op: pd.Series = field(default_factory=lambda: pd.Series(dtype=np.float64))
    syncs: list[str] = field(default_factory=list)

    @property
    def saved_ms(self) -> float:
        return self.param_saved_ms + self.comm_saved_ms + self.sync_saved_ms


def per_micro_batch(a: Any, m: int, k: int, replayed: pd.DataFrame, sharded: bool, placed: bool = True
                    ) -> MicroBatchCost:
    """The per-micro-batch costs of analysis ``a`` whose steps run ``m`` micro-batches, and
    what merging ``k`` at a time saves (see the module docstring); ``replayed``: the host
    replays with each step's idle time (``recommendations._replayed``); ``sharded``: the ranks
    gather parameters per layer (FSDP), whose collectives run per micro-batch; ``placed``: the
    trace's micro-batch column counts ``m`` micro-batches a step (else the work is spread
    evenly)."""
    per = a.rank_steps
    out = MicroBatchCost(m, k)
    kern = in_steps(a.kernels)
    if "param_shaped" in kern.columns:
        p = kern[kern["param_shaped"].to_numpy(dtype=bool) & kern["category"].isin(MEMORY_BOUND).to_numpy()]
        idx = p["micro_batch"] if placed and "micro_batch" in p.columns else pd.Series(-1, index=p.index)
        out.placed = bool(len(p)) and bool((idx >= 0).all())
        out.param_ms = float(p["dur_us"].sum()) / 1e3 / per
        out.param_saved_ms = merged_saving(p["dur_us"] / 1e3 / per, idx, m, k)
        out.by_op = p.groupby("leaf_op", observed=True)["dur_us"].sum().sort_values(ascending=False) / 1e3 / per
    if sharded:
        ex = comm_exposure(a)
        ex = ex[(ex["role"] == "parameters") & (ex["phase"] != "optimizer")]
        if len(ex):
            out.comm_ms = float(ex["exposed_ms"].sum())
            out.comm_saved_ms = merged_saving(ex["exposed_ms"], ex["micro_batch"] if placed else ex["micro_batch"] * 0 - 1,
                                              m, k)
    if replayed.empty:
        return out
    sy = a.syncs
    syncs = np.zeros(len(replayed))
    if len(sy):
        calls = sy.groupby(["rank", "step", "site"])["calls"].sum()
        every = calls[(calls >= m) & (calls % m == 0)].index.get_level_values("site").unique()
        share = float(sy.loc[sy["site"].isin(every), "idle_after_s"].sum()) / max(float(sy["idle_after_s"].sum()), 1e-12)
        syncs = (replayed["replay_s"] - replayed["no_sync_s"]).clip(lower=0.0).to_numpy() * share
        out.syncs = [str(s) for s in every]
    # where the trace shows its micro-batches, the host's launch-bound stretches too (a micro-batch's
    # first kernels are short: the GPU waits for the host until the queue fills), once per micro-batch
    launches = (replayed["replay_s"] - replayed["no_host_s"]).clip(lower=0.0).to_numpy() if placed else 0.0
    host = np.minimum(syncs + launches, replayed["idle_s"].to_numpy())
    out.sync_ms = float(host.mean()) * 1e3
    out.sync_saved_ms = out.sync_ms * (1 - 1 / k)
    return out
