"""Where GPU time goes: category sums, the temporal breakdown and multi-rank skew.

The temporal breakdown of a step on one rank is interval arithmetic over all streams of
the device: the step runs from its first GPU event to the next step's first GPU event
(the last step to its last event's end);

- compute: the union of compute kernels (everything but communication and copies),
- exposed communication: communication kernels not overlapped by compute,
- exposed memcpy: copies and memsets overlapped by neither,
- idle: the rest of the step.

They add up to the step's span.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from primus_perf.tracelens.categories import COMMUNICATION, MEMCPY, MEMSET


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total length covered by the intervals [start, end)."""
    if len(start) == 0:
        return 0.0
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    # a new merged segment starts where an interval begins after everything before it ended
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    seg = np.cumsum(new) - 1
    seg_start = s[new]
    seg_end = np.zeros(seg[-1] + 1)
    np.maximum.at(seg_end, seg, e)
    return float((seg_end - seg_start).sum())


def temporal(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): span, compute, exposed communication, exposed memcpy, idle (seconds)."""
    cols = ["rank", "step", "span_s", "busy_s", "compute_s", "exposed_comm_s", "exposed_memcpy_s", "idle_s"]
    k = kernels[kernels["step"] >= 0]
    if len(k) == 0:
        return pd.DataFrame(columns=cols)
    rows = []
    for rank, kr in k.groupby("rank", sort=True):
        firsts = kr.groupby("step")["ts_us"].min().sort_index()
        nexts = dict(zip(firsts.index[:-1], firsts.to_numpy()[1:], strict=True))
        for step, ks in kr.groupby("step", sort=True):
            s = ks["ts_us"].to_numpy(dtype=np.float64)
            e = s + ks["dur_us"].to_numpy(dtype=np.float64)
            cat = ks["category"].to_numpy().astype(str)
            comm = cat == COMMUNICATION
            copy = (cat == MEMCPY) | (cat == MEMSET)
            comp = ~(comm | copy)
            t0 = float(s.min())
            t1 = float(nexts.get(step, e.max()))
            e = np.minimum(e, t1)  # a kernel running past the next step's start belongs to it from there
            c = union_length(s[comp], e[comp])
            cm = union_length(s[comp | comm], e[comp | comm])
            everything = union_length(s, e)
            span = t1 - t0
            rows.append((int(rank), int(step), span / 1e6, everything / 1e6, c / 1e6, (cm - c) / 1e6,
                         (everything - cm) / 1e6, max(0.0, span - everything) / 1e6))
    return pd.DataFrame(rows, columns=cols)


def categories(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step, category): summed GPU event time in seconds (steps only)."""
    k = kernels[kernels["step"] >= 0]
    out = k.groupby(["rank", "step", "category"], observed=True)["dur_us"].sum().reset_index()
    out["seconds"] = out.pop("dur_us") / 1e6
    return out


def collective_skew(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per collective kernel name, over ranks: calls, start skew (mean, max, us) and the rank
    that starts last most often (the one the others wait for). The i-th call of a kernel on
    one rank is matched with the i-th call of the same kernel on the others."""
    cols = ["name", "calls", "mean_skew_us", "max_skew_us", "mean_dur_us", "last_rank"]
    c = kernels[(kernels["category"] == COMMUNICATION) & (kernels["step"] >= 0)]
    if c.empty or c["rank"].nunique() < 2:
        return pd.DataFrame(columns=cols)
    c = c.sort_values("ts_us", kind="stable")[["rank", "name", "ts_us", "dur_us"]].copy()
    c["name"] = c["name"].astype(str)
    c["i"] = c.groupby(["rank", "name"]).cumcount()
    n_ranks = c["rank"].nunique()
    g = c.groupby(["name", "i"])
    agg = g["ts_us"].agg(["min", "max", "count"])
    agg = agg[agg["count"] == n_ranks]
    if agg.empty:
        return pd.DataFrame(columns=cols)
    last = c.loc[g["ts_us"].idxmax()].set_index(["name", "i"])["rank"]
    agg = agg.join(last.rename("last_rank"))
    agg["skew"] = agg["max"] - agg["min"]
    dur = c.groupby("name")["dur_us"].mean()
    rows = []
    for name, a in agg.groupby(level="name"):
        rows.append((name, len(a), float(a["skew"].mean()), float(a["skew"].max()), float(dur[name]),
                     int(a["last_rank"].mode().iloc[0])))
    return pd.DataFrame(rows, columns=cols).sort_values("max_skew_us", ascending=False, ignore_index=True)
