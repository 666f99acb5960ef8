"""Hotspots: GPU time per (category, op, shape), with op calls, FLOPs and the roofline.

``calls`` counts op calls (an op that launches several kernels is one call; a GPU event
without an op is a call of its own), ``kernels`` the GPU events; both, ``time_s`` and
``flops`` are per step. FLOPs and bytes come from the modeled op calls behind the rows
(GEMM, convolution, attention; bytes of norms and elementwise ops), not from a memset or
copy the same call launched.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from primus_perf.devices import DevicePeaks
from primus_perf.tracelens.categories import COMMUNICATION, MEMCPY, MEMSET
from primus_perf.tracelens.roofline import roofline

COLUMNS = ["category", "op", "shape", "calls", "kernels", "time_s", "share", "flops", "tflops", "tb_s",
           "pct_roofline"]
KEYS = ["category", "op", "shape"]


def in_steps(kernels: pd.DataFrame) -> pd.DataFrame:
    """The GPU events inside profiler steps."""
    return kernels[kernels["step"] >= 0]


def hotspots(kernels: pd.DataFrame, calls: pd.DataFrame, peaks: DevicePeaks | None, per_step: int) -> pd.DataFrame:
    k = in_steps(kernels)
    if k.empty:
        return pd.DataFrame(columns=COLUMNS)
    # one groupby, no reindexing between groupings of different subsets: pandas cannot
    # reindex a categorical MultiIndex whose level codes differ in width (int8 for up to 127
    # categories, int16 above), which crashed traces with many distinct shapes
    call = k["call"].to_numpy(dtype=np.int64)
    unit = np.where(call >= 0, k["rank"].to_numpy(dtype=np.int64) * (1 << 40) + call, -1 - np.arange(len(k)))
    g = k.assign(unit=unit).groupby(KEYS, observed=True).agg(
        time_us=("dur_us", "sum"), kernels=("dur_us", "size"), calls=("unit", "nunique"))
    distinct = k[k["call"] >= 0].drop_duplicates(["rank", "call", *KEYS])
    modeled = distinct[~distinct["category"].isin((MEMCPY, MEMSET, COMMUNICATION))]  # not a memset of the call
    work = modeled[[*KEYS, "rank", "call"]].merge(
        calls[["rank", "row", "flops", "bytes", "dtype"]], left_on=["rank", "call"], right_on=["rank", "row"])
    agg = work.groupby(KEYS, observed=True).agg(flops=("flops", "sum"), bytes=("bytes", "sum"),
                                                dtype=("dtype", "first"))
    g = g.join(agg, how="left").reset_index()
    g["time_s"] = g.pop("time_us") / 1e6
    total = g["time_s"].sum()
    g["share"] = g["time_s"] / total if total > 0 else np.nan
    flops = g["flops"].fillna(0.0).to_numpy(dtype=np.float64)
    nbytes = g["bytes"].fillna(0.0).to_numpy(dtype=np.float64)
    has = flops > 0
    has_bytes = nbytes > 0
    tfl, pct = roofline(flops, nbytes, g["time_s"].to_numpy(), [d if isinstance(d, str) else "" for d in g["dtype"]],
                        peaks)
    with np.errstate(divide="ignore", invalid="ignore"):
        tb_s = nbytes / g["time_s"].to_numpy() / 1e12
    g["tflops"] = np.where(has, tfl, np.nan)
    g["pct_roofline"] = np.where(has | has_bytes, pct, np.nan)
    g["tb_s"] = np.where(has_bytes, tb_s, np.nan)
    g["flops"] = np.where(has, flops / per_step, np.nan)
    g["calls"] = g["calls"] / per_step
    g["kernels"] = g["kernels"] / per_step
    g["time_s"] = g["time_s"] / per_step
    for c in KEYS:
        g[c] = g[c].astype(str)
    return g.sort_values("time_s", ascending=False, ignore_index=True)[COLUMNS]
