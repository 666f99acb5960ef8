"""Where GPU time goes: category sums per step and the temporal breakdown of each step.

The temporal breakdown of a step on one rank is interval arithmetic over all streams of
the device, over the GPU events of that step (the step of their launch, :mod:`..link`).
The step's span runs from the first start of its GPU events to the later of their last
end and the first start of the next step's GPU events (the last step: to its last end).
So the host's gaps between steps count as the step's idle time, and a GPU that lags its
host stretches the span of the step whose work it runs late instead of making anything
negative. That span is the step time, the one definition every table, report and
comparison uses. Within it

- compute: the union of the step's compute kernels (everything but communication and copies),
- exposed communication: its communication kernels not overlapped by its compute,
- exposed memcpy: its copies and memsets overlapped by neither,
- idle: the rest of the span.

Each is non-negative and they add up to the span.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from primus_perf.tracelens.arrays import order_by_start, unique_pairs
from primus_perf.tracelens.categories import COMMUNICATION, MEMCPY, MEMSET

TEMPORAL_COLUMNS = ["rank", "step", "span_s", "busy_s", "compute_s", "exposed_comm_s", "exposed_memcpy_s",
                    "idle_s"]


def _segments(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The intervals [start, end) merged into disjoint segments, in order."""
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    # a new merged segment starts where an interval begins after everything before it ended
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    seg = np.cumsum(new) - 1
    seg_end = np.zeros(seg[-1] + 1)
    np.maximum.at(seg_end, seg, e)
    return s[new], seg_end


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total length covered by the intervals [start, end)."""
    if len(start) == 0:
        return 0.0
    seg_start, seg_end = _segments(start, end)
    return float((seg_end - seg_start).sum())


def covered(start: np.ndarray, end: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """For each window [a, b), how much of it the intervals [start, end) cover."""
    if len(start) == 0:
        return np.zeros(len(a))
    s, e = _segments(start, end)
    before = np.r_[0.0, np.cumsum(e - s)]  # covered length before each segment

    def upto(t: np.ndarray) -> np.ndarray:  # covered length of (-inf, t)
        i = np.searchsorted(s, t, side="right") - 1
        j = np.clip(i, 0, None)
        return np.where(i >= 0, before[j] + np.clip(t - s[j], 0.0, e[j] - s[j]), 0.0)

    return upto(b) - upto(a)


def _union_by_group(group: np.ndarray, start: np.ndarray, end: np.ndarray, n: int) -> np.ndarray:
    """Per group code (0..n-1), the length covered by its intervals [start, end)."""
    out = np.zeros(n)
    if not len(group):
        return out
    order = order_by_start(start, group=group)
    g, s, e = group[order], start[order], end[order]
    reach = pd.Series(e).groupby(g).cummax().to_numpy()  # the end of all intervals so far, per group
    first = np.r_[True, g[1:] != g[:-1]]
    new = first | (s > np.r_[-np.inf, reach[:-1]])  # a new covered segment starts
    seg = np.cumsum(new) - 1
    seg_end = np.zeros(int(seg[-1]) + 1)
    np.maximum.at(seg_end, seg, e)
    np.add.at(out, g[new], seg_end - s[new])
    return out


def temporal(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): span (the step time), busy, compute, exposed communication, exposed
    memcpy and idle, in seconds."""
    k = kernels[kernels["step"] >= 0]
    if len(k) == 0:
        return pd.DataFrame(columns=TEMPORAL_COLUMNS)
    rank, step = k["rank"].to_numpy(dtype=np.int64), k["step"].to_numpy(dtype=np.int64)
    ranks, steps, code = unique_pairs(rank, step)  # sorted by rank, then step
    n = len(ranks)
    s = k["ts_us"].to_numpy(dtype=np.float64)
    e = s + k["dur_us"].to_numpy(dtype=np.float64)
    cat = k["category"]
    comm = (cat == COMMUNICATION).to_numpy()
    comp = ~(comm | (cat == MEMCPY).to_numpy() | (cat == MEMSET).to_numpy())
    c = _union_by_group(code[comp], s[comp], e[comp], n)
    cm = _union_by_group(code[comp | comm], s[comp | comm], e[comp | comm], n)
    everything = _union_by_group(code, s, e, n)
    t0 = pd.Series(s).groupby(code).min().to_numpy()
    last = pd.Series(e).groupby(code).max().to_numpy()
    same_rank_next = np.r_[ranks[1:] == ranks[:-1], False]  # keys sorted: the rank's next step follows
    t1 = np.maximum(last, np.where(same_rank_next, np.r_[t0[1:], np.inf], -np.inf))
    span = t1 - t0
    return pd.DataFrame({"rank": ranks, "step": steps, "span_s": span / 1e6,
                         "busy_s": everything / 1e6, "compute_s": c / 1e6, "exposed_comm_s": (cm - c) / 1e6,
                         "exposed_memcpy_s": (everything - cm) / 1e6,
                         "idle_s": np.maximum(0.0, span - everything) / 1e6}, columns=TEMPORAL_COLUMNS)


def categories(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step, category): summed GPU event time in seconds (steps only)."""
    k = kernels[kernels["step"] >= 0]
    out = k.groupby(["rank", "step", "category"], observed=True)["dur_us"].sum().reset_index()
    out["seconds"] = out.pop("dur_us") / 1e6
    out["category"] = out["category"].astype(str)
    return out


def steps_in_order(temporal: pd.DataFrame, breakdown: pd.DataFrame) -> pd.DataFrame:
    """Per step index (0..n-1 in time order on each rank), averaged over ranks: the step time
    (``span_s``) and the summed GPU event time (``kernel_s``)."""
    if temporal.empty:
        return pd.DataFrame(columns=["index", "span_s", "kernel_s"])
    kernel_s = breakdown.groupby(["rank", "step"])["seconds"].sum().rename("kernel_s")
    t = temporal.join(kernel_s, on=["rank", "step"])
    t["index"] = t.groupby("rank")["step"].rank(method="first").astype(int) - 1
    return t.groupby("index", as_index=False)[["span_s", "kernel_s"]].mean()
