"""Hotspots: GPU time per (category, op, shape), with op calls, FLOPs and the roofline.

``calls`` counts op calls (an op that launches several kernels is one call; a GPU event
without an op is a call of its own), ``kernels`` the GPU events; both, ``time_s`` and
``flops`` are per step. FLOPs and bytes come from the modeled op calls behind the rows
(GEMM, convolution, attention; bytes of norms and elementwise ops), not from a memset or
copy the same call launched. A GEMM or attention row is
one problem: ``problem_key`` and ``problem`` are its canonical key and label (the same
whichever library, backend or op ran it; empty for other rows), so one op and input shape
with two problems (other strides) gives two rows. ``top_kernels`` lists the row's largest
kernels as (name, share of the row's time); ``roofline_note`` says why a row's
``pct_roofline`` above 1 is not real (:func:`~primus_perf.tracelens.roofline.explain_over`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from primus_perf.base.devices import DevicePeaks
from primus_perf.tracelens.categories import (
    ATTENTION_BWD,
    ATTENTION_FWD,
    COMMUNICATION,
    GEMM,
    MEMCPY,
    MEMSET,
)
from primus_perf.tracelens.roofline import explain_over, roofline

COLUMNS = ["category", "op", "shape", "problem_key", "problem", "calls", "kernels", "time_s", "share", "flops",
           "tflops", "tb_s", "pct_roofline", "roofline_note", "top_kernels"]
KEYS = ["category", "op", "shape"]
ROW_KEYS = [*KEYS, "problem_key"]
MODELED = (GEMM, ATTENTION_FWD, ATTENTION_BWD)  # categories whose rows are one problem each
TOP_KERNELS = 3


def in_steps(kernels: pd.DataFrame) -> pd.DataFrame:
    """The GPU events inside profiler steps."""
    return kernels[kernels["step"] >= 0]


def problem_keys(k: pd.DataFrame, calls: pd.DataFrame) -> np.ndarray:
    """Per GPU event of a GEMM or attention category: its op call's problem key, else ""."""
    out = np.full(len(k), "", dtype=object)
    m = (k["category"].isin(MODELED) & (k["call"] >= 0)).to_numpy()
    if m.any() and len(calls):
        idx = pd.MultiIndex.from_arrays([k["rank"].to_numpy()[m], k["call"].to_numpy()[m]])
        out[m] = calls.set_index(["rank", "row"])["key"].reindex(idx).fillna("").to_numpy()
    return out


def _top_kernels(k: pd.DataFrame, top: int) -> dict[tuple[str, ...], list[tuple[str, float]]]:
    """Per row key: its ``top`` kernel names by time with their share of the row's time."""
    g = k.groupby([*ROW_KEYS, "name"], observed=True)["dur_us"].sum().reset_index()
    g["share"] = g["dur_us"] / g.groupby(ROW_KEYS, observed=True)["dur_us"].transform("sum")
    g = g.sort_values("dur_us", ascending=False, kind="stable").groupby(ROW_KEYS, observed=True).head(top)
    out: dict[tuple[str, ...], list[tuple[str, float]]] = {}
    for *key, name, share in zip(*(g[c].astype(str) for c in ROW_KEYS), g["name"].astype(str), g["share"],
                                 strict=True):
        out.setdefault(tuple(key), []).append((name, float(share)))
    return out


def hotspots(kernels: pd.DataFrame, calls: pd.DataFrame, peaks: DevicePeaks | None, per_step: int,
             top_kernels: int = TOP_KERNELS) -> pd.DataFrame:
    k = in_steps(kernels)
    if k.empty:
        return pd.DataFrame(columns=COLUMNS)
    k = k.assign(problem_key=pd.Categorical(problem_keys(k, calls)))
    # one groupby, no reindexing between groupings of different subsets: pandas cannot
    # reindex a categorical MultiIndex whose level codes differ in width (int8 for up to 127
    # categories, int16 above), which crashed traces with many distinct shapes
    call = k["call"].to_numpy(dtype=np.int64)
    unit = np.where(call >= 0, k["rank"].to_numpy(dtype=np.int64) * (1 << 40) + call, -1 - np.arange(len(k)))
    g = k.assign(unit=unit).groupby(ROW_KEYS, observed=True).agg(
        time_us=("dur_us", "sum"), kernels=("dur_us", "size"), calls=("unit", "nunique"))
    distinct = k[k["call"] >= 0].drop_duplicates(["rank", "call", *ROW_KEYS])
    modeled = distinct[~distinct["category"].isin((MEMCPY, MEMSET, COMMUNICATION))]  # not a memset of the call
    work = modeled[[*ROW_KEYS, "rank", "call"]].merge(
        calls[["rank", "row", "flops", "bytes", "dtype"]], left_on=["rank", "call"], right_on=["rank", "row"])
    agg = work.groupby(ROW_KEYS, observed=True).agg(flops=("flops", "sum"), bytes=("bytes", "sum"),
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
    pct, notes = explain_over(np.where(has | has_bytes, pct, np.nan), flops, nbytes, g["time_s"].to_numpy(),
                              [d if isinstance(d, str) else "" for d in g["dtype"]], list(g["category"].astype(str)),
                              g["calls"].to_numpy(dtype=np.float64), peaks)
    g["pct_roofline"], g["roofline_note"] = pct, notes
    g["tb_s"] = np.where(has_bytes, tb_s, np.nan)
    g["flops"] = np.where(has, flops / per_step, np.nan)
    g["calls"] = g["calls"] / per_step
    g["kernels"] = g["kernels"] / per_step
    g["time_s"] = g["time_s"] / per_step
    for c in ROW_KEYS:
        g[c] = g[c].astype(str)
    labels = calls.drop_duplicates("key").set_index("key")["problem"] if len(calls) else pd.Series(dtype=object)
    g["problem"] = [str(labels[key]) if key else "" for key in g["problem_key"]]
    tops = _top_kernels(k, top_kernels)
    g["top_kernels"] = [tops.get(key, []) for key in zip(*(g[c] for c in ROW_KEYS), strict=True)]
    return g.sort_values("time_s", ascending=False, ignore_index=True)[COLUMNS]
