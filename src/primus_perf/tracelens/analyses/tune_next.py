"""What to tune next: the problems of every kind ranked by the time they could save.

A problem's score is its GPU time per step times its distance to the roofline,
``time_s * (1 - pct_roofline)``: the time it would save at the roof. Where the roof is
unknown (a device or dtype without a peak entry) the distance counts as 1, so those rank
by time. An attention problem's forward and backward are one row (the tuner tunes the
pair); each pass of a grouped GEMM is a problem of its own. Each row carries the command
that tunes it (:func:`tune_command`, spelled as the kind's trace part says).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from primus_perf import kinds

COLUMNS = ["kind", "key", "label", "calls", "time_s", "pct_roofline", "score", "command"]


def tune_command(kind: str, problem: Any) -> str:
    """The shell command that tunes one problem: the options its kind's trace part spells it
    with (``spec``), else a problems file of its shortest item (``item``)."""
    part = kinds.get(kind).part("trace")
    command = f"primus-tune {kind.replace('_', '-')}"
    spec = part.spec(problem) if part.spec is not None else None
    if spec:
        return f"{command} {spec}"
    item = part.item(problem) if part.item is not None else {"kind": kind, "problem": problem.to_dict()}
    doc = json.dumps([item], separators=(",", ":"))
    name = f"tune_{kind}_{re.sub(r'[^A-Za-z0-9]+', '_', str(problem)).strip('_')}.json"
    return f"echo '{doc}' > {name} && {command} --problems {name}"


def _rows(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    distance = 1.0 - df["pct_roofline"].astype(np.float64).clip(0.0, 1.0).fillna(0.0)
    d = pd.DataFrame({"key": df["key"], "label": df["label"], "problem": df["problem"], "calls": df["calls"],
                      "time_s": df["time_s"].astype(np.float64), "score": df["time_s"] * distance,
                      "known": df["pct_roofline"].notna()})
    g = d.groupby("key", sort=False).agg(label=("label", "first"), problem=("problem", "first"),
                                         calls=("calls", "max"), time_s=("time_s", "sum"), score=("score", "sum"),
                                         known=("known", "all")).reset_index()
    with np.errstate(divide="ignore", invalid="ignore"):
        g["pct_roofline"] = np.where(g["known"] & (g["time_s"] > 0), 1.0 - g["score"] / g["time_s"], np.nan)
    g["kind"] = kind
    g["command"] = [tune_command(kind, p) for p in g["problem"]]
    return g[COLUMNS]


def tune_next(problems: Mapping[str, pd.DataFrame], top: int = 20) -> pd.DataFrame:
    """The ``top`` problems by score, highest first, from the problem tables of
    :mod:`.problems` by kind (``Analysis.problem_tables()``)."""
    parts = [p for p in (_rows(df, kind) for kind, df in problems.items()) if len(p)]
    if not parts:
        return pd.DataFrame(columns=COLUMNS)
    out = pd.concat(parts, ignore_index=True)
    return out.sort_values("score", ascending=False, kind="stable", ignore_index=True).head(top)
