"""What to tune next: GEMM, grouped GEMM and attention problems ranked by the time they
could save.

A problem's score is its GPU time per step times its distance to the roofline,
``time_s * (1 - pct_roofline)``: the time it would save at the roof. Where the roof is
unknown (a device or dtype without a peak entry) the distance counts as 1, so those rank
by time. An attention problem's forward and backward are one row (the tuner tunes the
pair); each pass of a grouped GEMM is a problem of its own. Each row carries the command
that tunes it (:func:`tune_command`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.problems import AttentionProblem, GemmProblem, GroupedGemmProblem

COLUMNS = ["kind", "key", "label", "calls", "time_s", "pct_roofline", "score", "command"]


TunedProblem = GemmProblem | GroupedGemmProblem | AttentionProblem


def _problem_item(kind: str, problem: TunedProblem) -> dict[str, Any]:
    """The shortest problems-file item that reads back as exactly this problem: a GEMM's
    row-major spelling when it gives the same key (packed operands), else every field."""
    if isinstance(problem, GemmProblem):
        M, N, K, a_t, b_t = problem.row_major_shapes()
        short: dict[str, Any] = {"M": M, "N": N, "K": K, "a_transposed": a_t, "b_transposed": b_t,
                                 "dtype": problem.dtype_a}
        if problem.dtype_d != problem.dtype_a:
            short["out_dtype"] = problem.dtype_d
        if problem.batch != 1:
            short["batch"] = problem.batch
        if problem.epilogue != "none":
            short["epilogue"] = problem.epilogue
        try:
            if GemmProblem.from_row_major(**short).key() == problem.key():
                return short
        except (TypeError, ValueError):
            pass
    return {"kind": kind, "problem": problem.to_dict()}


def tune_command(kind: str, problem: TunedProblem) -> str:
    """The shell command that tunes one problem (the tuners' command-line spelling lives here)."""
    if isinstance(problem, AttentionProblem) and problem.seq_q == problem.seq_kv and problem.layout == "bshd":
        p = problem
        mask = "causal" if p.causal else "full"
        return (f"primus-tune attention --problem {p.batch},{p.heads_q},{p.heads_kv},{p.seq_q},{p.head_dim},{mask}"
                f" --dtype {p.dtype}")
    doc = json.dumps([_problem_item(kind, problem)], separators=(",", ":"))
    name = f"tune_{kind}_{re.sub(r'[^A-Za-z0-9]+', '_', str(problem)).strip('_')}.json"
    return f"echo '{doc}' > {name} && primus-tune {kind.replace('_', '-')} --problems {name}"


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
