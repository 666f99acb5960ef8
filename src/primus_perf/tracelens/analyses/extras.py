"""What the kernel-efficiency and memory tables read beside the events, from the loader's one
pass over the file (:attr:`~..load.RawTrace.resources`, :attr:`~..load.RawTrace.memory`):
the launch resources Kineto records on each kernel (grid, block, registers per thread,
shared memory, blocks per SM, estimated achieved occupancy) joined to the kernel's step,
category and time, and the ``[memory]`` instant events of a trace recorded with
``profile_memory=True`` with the CPU ops of the threads that allocated (to name the op of
each allocation). Values of an unexpected type were dropped by the loader: a kernel without
resources is left out of the efficiency table, a memory event without ``Bytes`` out of the
curve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L
from primus_perf.tracelens.link import Linked

KERNEL_COLUMNS = ["step", "dur_us", "name", "category", "grid", "block", "threads", "grid_blocks", "registers",
                  "shared_bytes", "blocks_per_sm", "occupancy_pct"]
OP_COLUMNS = ["ts_us", "dur_us", "name", "thread"]


@dataclass
class Extras:
    """One trace's kernel resources, memory events and (when it has memory events) CPU ops."""

    kernels: pd.DataFrame  # KERNEL_COLUMNS, one row per kernel that recorded its resources
    memory: pd.DataFrame  # load.MEMORY_COLUMNS; bytes > 0 an allocation, < 0 a free
    ops: pd.DataFrame  # OP_COLUMNS (empty when the trace has no memory events)


def _volume(dims: pd.Series) -> np.ndarray:
    """``x,y,z`` -> x*y*z (NaN for "")."""
    cats = dims.cat.categories
    vol = np.array([float(np.prod([int(v) for v in c.split(",")], dtype=np.float64)) if c else np.nan
                    for c in cats] + [np.nan])
    return vol[dims.cat.codes.to_numpy()]


def trace_extras(rt: L.RawTrace, lk: Linked, kernels: pd.DataFrame) -> Extras:
    """One trace's :class:`Extras`; ``kernels``: its GPU events (``tables.kernel_table``, in
    ``lk.gpu`` order)."""
    res = rt.resources
    pos = np.full(len(rt), -1, dtype=np.int64)
    pos[lk.gpu] = np.arange(len(lk.gpu))
    at = pos[res["row"].to_numpy(dtype=np.int64)] if len(res) else np.zeros(0, dtype=np.int64)
    res = res[at >= 0]
    k = kernels.iloc[at[at >= 0]]
    out = pd.DataFrame({  # names and launch shapes stay categorical (codes, not a string per kernel)
        "step": k["step"].to_numpy(), "dur_us": k["dur_us"].to_numpy(), "name": k["name"].array,
        "category": k["category"].array, "grid": res["grid"].array, "block": res["block"].array,
        "threads": _volume(res["block"]), "grid_blocks": _volume(res["grid"]),
        **{c: res[c].to_numpy(dtype=np.float64) for c in ("registers", "shared_bytes", "blocks_per_sm",
                                                           "occupancy_pct")},
    }, columns=KERNEL_COLUMNS)
    memory = rt.memory
    ops = pd.DataFrame(columns=OP_COLUMNS)
    if len(memory):
        rows = np.flatnonzero((rt.kind == L.KIND_CPU_OP) & np.isin(rt.thread, memory["thread"].unique()))
        ops = pd.DataFrame({"ts_us": rt.ts[rows], "dur_us": rt.dur[rows],
                            "name": [rt.names[c] for c in rt.name[rows].tolist()], "thread": rt.thread[rows]})
    return Extras(out, memory, ops)
