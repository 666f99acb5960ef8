"""Per op name: GPU time of the kernels it launched itself (self) and of all kernels launched
inside it (inclusive; ``aten::linear`` includes its ``aten::mm``), and its calls with GPU
work, per step. Only GPU events inside profiler steps count (all when the trace has none).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L
from primus_perf.tracelens.link import Linked
from primus_perf.tracelens.tables import op_label

COLUMNS = ["op", "calls", "self_s", "inclusive_s"]


def trace_op_times(rt: L.RawTrace, lk: Linked) -> pd.DataFrame:
    """One trace's totals: op, calls, self_us, inclusive_us."""
    leaf = lk.leaf_op
    dur = rt.dur[lk.gpu]
    ok = leaf >= 0
    if lk.steps:
        ok &= lk.step >= 0
    n = len(rt)
    self_t = np.zeros(n)
    np.add.at(self_t, leaf[ok], dur[ok])
    incl = np.zeros(n)
    cur, d = leaf[ok].copy(), dur[ok].copy()
    while len(cur):
        np.add.at(incl, cur, d)
        up = lk.op_parent[cur]
        keep = up >= 0
        cur, d = up[keep], d[keep]
    rows = np.flatnonzero(incl > 0)
    labels = np.array([op_label(nm) for nm in rt.names] or [""], dtype=object)
    df = pd.DataFrame({"op": labels[rt.name[rows]], "self_us": self_t[rows], "inclusive_us": incl[rows]})
    return df.groupby("op").agg(calls=("op", "size"), self_us=("self_us", "sum"),
                                inclusive_us=("inclusive_us", "sum")).reset_index()


def op_times(per_trace: Sequence[pd.DataFrame], per_step: int) -> pd.DataFrame:
    """The traces' totals combined, per step, by inclusive time."""
    df = pd.concat(per_trace, ignore_index=True) if per_trace else pd.DataFrame()
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df = df.groupby("op", as_index=False).sum()
    out = pd.DataFrame({"op": df["op"], "calls": df["calls"] / per_step, "self_s": df["self_us"] / 1e6 / per_step,
                        "inclusive_s": df["inclusive_us"] / 1e6 / per_step})
    return out.sort_values("inclusive_s", ascending=False, ignore_index=True)
