"""Kernel efficiency from the launch resources Kineto records on each kernel.

One row per kernel name (every launch of it in the profiled steps, all ranks): launches
and GPU time per step, the most common grid and block, threads per block, registers per
thread, shared memory per block, blocks per SM (grid blocks over the device's SMs/CUs, as
Kineto computes it) and the estimated achieved occupancy (Kineto's figure: resident warps
over the SM's maximum, from the launch resources; time-weighted over the launches; the 0
Kineto writes where it cannot compute it is shown as unknown).

A kernel is flagged when it matters (at least ``MIN_SHARE`` of the kernel time) and
- ``low occupancy``: occupancy below ``LOW_OCCUPANCY_PCT`` (registers or shared memory
  leave few warps per SM to hide memory latency), or
- ``small grid``: fewer blocks than SMs (``blocks per SM`` < 1: part of the GPU idles
  while it runs; a wave-quantization tail is not flagged).
GEMM and attention kernels often run at low occupancy by design (large tiles, one block
per SM): their flag is a pointer, their roofline figures in the problem tables the test.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

COLUMNS = ["name", "category", "launches", "time_s", "share", "grid", "block", "threads", "registers",
           "shared_bytes", "blocks_per_sm", "occupancy_pct", "flag"]
MIN_SHARE = 0.01
LOW_OCCUPANCY_PCT = 25.0


def _modes(r: pd.DataFrame, col: str) -> pd.Series:
    """Per kernel name, the most common non-empty value of ``col`` ("" when none)."""
    c = r.loc[r[col].astype(str) != "", ["name", col]].groupby(["name", col], observed=True).size()
    if c.empty:
        return pd.Series(dtype=object)
    top = c.rename("count").reset_index().astype({"name": str, col: str})
    top = top.sort_values(["name", "count", col], ascending=[True, False, True], kind="stable")
    return top.drop_duplicates("name").set_index("name")[col]


def kernel_efficiency(resources: pd.DataFrame, kernel_us: float, rank_steps: int) -> pd.DataFrame:
    """The table (see the module docstring), by time, largest first. ``resources``: the
    kernels of :func:`.extras.trace_extras` of every trace; ``kernel_us``: the GPU event time
    in the steps, the shares' denominator."""
    r = resources[resources["step"] >= 0] if len(resources) else resources
    if r.empty:
        return pd.DataFrame(columns=COLUMNS)
    r = r.copy()
    total = kernel_us or 1.0
    # Kineto writes 0% where its occupancy calculator has no answer (cluster launches, large
    # shared memory): no kernel that ran had no warp resident, so 0 is unknown
    r["occupancy_pct"] = r["occupancy_pct"].where(r["occupancy_pct"] > 0)
    r["occ_w"] = r["occupancy_pct"] * r["dur_us"]
    r["occ_t"] = r["dur_us"].where(r["occupancy_pct"].notna(), 0.0)
    g = r.groupby("name", sort=False, observed=True).agg(
        category=("category", "first"), launches=("dur_us", "size"), dur=("dur_us", "sum"),
        threads=("threads", "median"), registers=("registers", "median"),
        shared_bytes=("shared_bytes", "median"), blocks_per_sm=("blocks_per_sm", "median"),
        occ_w=("occ_w", "sum"), occ_t=("occ_t", "sum")).reset_index()
    g = g.astype({"name": str, "category": str})
    for col in ("grid", "block"):
        g[col] = g["name"].map(_modes(r, col)).fillna("")
    with np.errstate(invalid="ignore", divide="ignore"):
        g["occupancy_pct"] = np.where(g["occ_t"] > 0, g["occ_w"] / g["occ_t"], np.nan)
    g["time_s"] = g["dur"] / 1e6 / rank_steps
    g["launches"] = g["launches"] / rank_steps
    g["share"] = g["dur"] / total
    matters = g["share"] >= MIN_SHARE
    low = matters & (g["occupancy_pct"] < LOW_OCCUPANCY_PCT)
    small = matters & (g["blocks_per_sm"] < 1.0)
    g["flag"] = np.where(low & small, "low occupancy, small grid",
                         np.where(low, "low occupancy", np.where(small, "small grid", "")))
    return g.sort_values("time_s", ascending=False, ignore_index=True)[COLUMNS]
