"""The memory view of a trace recorded with ``profile_memory=True``: its ``[memory]``
instant events (one per allocation, ``Bytes`` > 0, and per free, ``Bytes`` < 0).

- ``curve``: per (rank, device), the allocated bytes over time: Kineto's ``Total
  Allocated`` where the trace records it, else the running sum of ``Bytes`` from the first
  event (old traces: relative to what was allocated before profiling began). Thinned to at
  most ``MAX_POINTS`` points per device, keeping each bucket's highest value so the peak
  stays.
- ``peaks``: per (rank, device), the peak allocated bytes, when it happened, allocations
  and frees.
- ``by_op``: per CPU op name, the allocations made while it was the innermost op running on
  the allocating thread (allocations outside every op go to ``(no op)``): count and bytes
  allocated per step, and the largest single allocation.

Device type 1 is the GPU (CUDA and HIP alike), 0 the host.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

CURVE_COLUMNS = ["rank", "device", "ts_us", "allocated"]
PEAK_COLUMNS = ["rank", "device", "peak_bytes", "peak_ts_us", "allocations", "frees", "recorded_total"]
BY_OP_COLUMNS = ["op", "allocations", "bytes", "largest"]
MAX_POINTS = 2000
NO_OP = "(no op)"


def _device(t: float, i: float) -> str:
    if t == 1:
        return f"gpu {int(i)}" if i == i else "gpu"
    return "cpu" if t == 0 else f"type {t:g}"


def _innermost(ops: pd.DataFrame, times: np.ndarray, thread: str) -> np.ndarray:
    """For each time (sorted or not) the row in ``ops`` (one thread) of the innermost op
    running then, -1 where none: ops sorted by start; a stack gives each op's parent, and a
    time's op is the last started op still running (or its running ancestor)."""
    o = ops.sort_values(["ts_us", "dur_us"], ascending=[True, False], kind="stable")
    starts = o["ts_us"].to_numpy(dtype=np.float64)
    ends = starts + o["dur_us"].to_numpy(dtype=np.float64)
    parent = np.full(len(o), -1, dtype=np.int64)
    stack: list[int] = []
    for j in range(len(o)):
        while stack and ends[stack[-1]] <= starts[j]:
            stack.pop()
        parent[j] = stack[-1] if stack else -1
        stack.append(j)
    out = np.full(len(times), -1, dtype=np.int64)
    idx = o.index.to_numpy()
    last = np.searchsorted(starts, times, side="right") - 1
    for i, j in enumerate(last.tolist()):
        while j >= 0 and ends[j] <= times[i]:
            j = int(parent[j])
        out[i] = idx[j] if j >= 0 else -1
    return out


def memory_view(events: pd.DataFrame, ops: pd.DataFrame, top: int = 30
                ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(curve, peaks, by_op)`` from the memory events and CPU ops of
    :func:`.extras.read_extras`, each with a ``rank`` column (see the module docstring)."""
    if events.empty:
        return (pd.DataFrame(columns=CURVE_COLUMNS), pd.DataFrame(columns=PEAK_COLUMNS),
                pd.DataFrame(columns=BY_OP_COLUMNS))
    ev = events.sort_values("ts_us", kind="stable").reset_index(drop=True)
    ev["device"] = [_device(t, i) for t, i in zip(ev["device_type"], ev["device_id"], strict=True)]
    curves, peaks = [], []
    for (rank, dev), g in ev.groupby(["rank", "device"], sort=True):
        recorded = bool(g["total_allocated"].notna().all())
        alloc = g["total_allocated"].to_numpy(dtype=np.float64) if recorded else np.cumsum(g["bytes"].to_numpy())
        ts = g["ts_us"].to_numpy(dtype=np.float64)
        i = int(np.argmax(alloc))
        peaks.append((int(rank), dev, float(alloc[i]), float(ts[i]), int((g["bytes"] > 0).sum()),
                      int((g["bytes"] < 0).sum()), recorded))
        if len(ts) > MAX_POINTS:  # keep each bucket's highest point
            bucket = np.arange(len(ts)) * MAX_POINTS // len(ts)
            keep = pd.Series(alloc).groupby(bucket).idxmax().to_numpy()
            ts, alloc = ts[keep], alloc[keep]
        curves.append(pd.DataFrame({"rank": int(rank), "device": dev, "ts_us": ts, "allocated": alloc}))
    curve = pd.concat(curves, ignore_index=True)
    peak = pd.DataFrame(peaks, columns=PEAK_COLUMNS).sort_values("peak_bytes", ascending=False, ignore_index=True)
    allocs = ev[ev["bytes"] > 0]
    op_name = pd.Series(NO_OP, index=allocs.index, dtype=object)
    if len(ops):
        for (rank, thread), a in allocs.groupby(["rank", "thread"], sort=False):
            o = ops[(ops["rank"] == rank) & (ops["thread"] == thread)]
            if o.empty:
                continue
            rows = _innermost(o, a["ts_us"].to_numpy(dtype=np.float64), thread)
            op_name.loc[a.index] = [str(o.at[r, "name"]) if r >= 0 else NO_OP for r in rows.tolist()]
    by = allocs.assign(op=op_name).groupby("op").agg(allocations=("bytes", "size"), bytes=("bytes", "sum"),
                                                      largest=("bytes", "max")).reset_index()
    by = by.sort_values("bytes", ascending=False, ignore_index=True).head(top)
    return curve, peak, by[BY_OP_COLUMNS]
