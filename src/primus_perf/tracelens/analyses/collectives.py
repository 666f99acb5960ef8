"""Across ranks: the start skew of each collective, and each rank's median step breakdown."""

from __future__ import annotations

import pandas as pd

from primus_perf.tracelens.categories import COMMUNICATION

COLLECTIVE_COLUMNS = ["name", "calls", "mean_skew_us", "max_skew_us", "mean_dur_us", "last_rank"]
RANK_COLUMNS = ["rank", "steps", "step_time_s", "compute_s", "exposed_comm_s", "exposed_memcpy_s", "idle_s",
                "slowest"]


def collective_skew(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per collective kernel name, over ranks: calls, start skew (mean, max, us) and the rank
    that starts last most often (the one the others wait for). The i-th call of a kernel on
    one rank is matched with the i-th call of the same kernel on the others."""
    c = kernels[(kernels["category"] == COMMUNICATION) & (kernels["step"] >= 0)]
    if c.empty or c["rank"].nunique() < 2:
        return pd.DataFrame(columns=COLLECTIVE_COLUMNS)
    c = c.sort_values("ts_us", kind="stable")[["rank", "name", "ts_us", "dur_us"]].copy()
    c["name"] = c["name"].astype(str)
    c["i"] = c.groupby(["rank", "name"]).cumcount()
    n_ranks = c["rank"].nunique()
    g = c.groupby(["name", "i"])
    agg = g["ts_us"].agg(["min", "max", "count"])
    agg = agg[agg["count"] == n_ranks]
    if agg.empty:
        return pd.DataFrame(columns=COLLECTIVE_COLUMNS)
    last = c.loc[g["ts_us"].idxmax()].set_index(["name", "i"])["rank"]
    agg = agg.join(last.rename("last_rank"))
    agg["skew"] = agg["max"] - agg["min"]
    dur = c.groupby("name")["dur_us"].mean()
    rows = []
    for name, a in agg.groupby(level="name"):
        rows.append((name, len(a), float(a["skew"].mean()), float(a["skew"].max()), float(dur[name]),
                     int(a["last_rank"].mode().iloc[0])))
    return pd.DataFrame(rows, columns=COLLECTIVE_COLUMNS).sort_values("max_skew_us", ascending=False,
                                                                     ignore_index=True)


def rank_summary(temporal: pd.DataFrame) -> pd.DataFrame:
    """Per rank, medians over its steps of the temporal breakdown; the slowest rank computes
    longest (the others wait for it in the collectives)."""
    if temporal.empty:
        return pd.DataFrame(columns=RANK_COLUMNS)
    g = temporal.groupby("rank").agg(steps=("step", "size"), step_time_s=("span_s", "median"),
                                     compute_s=("compute_s", "median"), exposed_comm_s=("exposed_comm_s", "median"),
                                     exposed_memcpy_s=("exposed_memcpy_s", "median"), idle_s=("idle_s", "median"))
    g = g.reset_index()
    g["slowest"] = g["compute_s"] == g["compute_s"].max()
    return g[RANK_COLUMNS]
