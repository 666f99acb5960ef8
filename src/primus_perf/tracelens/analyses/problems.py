"""The unique GEMM, grouped GEMM and attention problems of the modeled op calls, against
the roofline.

One row per (problem key, direction): ``calls`` (per step), ``time_s`` (per step), FLOPs
and bytes of one call (the mean over its calls: a grouped GEMM's calls of one problem
carry different exact token totals), arithmetic intensity, achieved TFLOP/s and TB/s, the
fraction of the roofline, the share of the kind's time, the dtype and the problem object.
GEMM rows add m, n, k; grouped GEMM rows (direction: the pass) add groups, k, n, the
tokens and skew buckets and ``skew_known``: False for calls whose split of the tokens over
the groups the trace does not record (another program's ``aten::_grouped_mm``: taken as
balanced, and the label says so).

GEMM directions: a call inside a backward node of autograd (the call table says ``bwd``;
CPU-only traces too) is a weight gradient (``wgrad``) when it reduces over a token count
of the forward GEMMs (dW = dY^T X sums over tokens), else an input gradient (``dgrad``,
dX = dY W); ``bwd`` when the shapes cannot tell (a token count equal to a feature size).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.base.devices import DevicePeaks
from primus_perf.tracelens.roofline import explain_over, roofline

# the table's columns per kind (the registry's: key, label, the problem's shape, the rest)
KIND_COLUMNS = {kind.name: kind.columns for kind in kinds.all_kinds()}


def gemm_directions(gemm_calls: pd.DataFrame) -> pd.Series:
    """``fwd``, ``dgrad``, ``wgrad`` or ``bwd`` for each GEMM call (see the module docstring)."""
    in_bwd = (gemm_calls["direction"] == "bwd").to_numpy()
    shapes = [p.row_major_shapes() for p in gemm_calls["problem"]]
    tokens = {s[0] for s, b in zip(shapes, in_bwd) if not b}  # row-major M of the forward GEMMs
    out = []
    for (m, _n, k, _at, _bt), b in zip(shapes, in_bwd):
        if not b:
            out.append("fwd")
        elif k in tokens and m not in tokens:
            out.append("wgrad")
        elif m in tokens and k not in tokens:
            out.append("dgrad")
        else:
            out.append("bwd")
    return pd.Series(out, index=gemm_calls.index, dtype=object)


def _labels(problems: list, keys: list[str]) -> list[str]:
    """``str(problem)``, unique per key: where different problems would share a label, the
    leading dimensions and output dtype are added, and where they still would, the key."""
    labels = [str(p) for p in problems]
    for widen in (_with_layout, lambda label, _p, key: f"{label} [{key}]"):
        seen: dict[str, set[str]] = {}
        for label, key in zip(labels, keys, strict=True):
            seen.setdefault(label, set()).add(key)
        labels = [widen(label, p, key) if len(seen[label]) > 1 else label
                  for label, p, key in zip(labels, problems, keys, strict=True)]
    return labels


def _with_layout(label: str, p: object, _key: str) -> str:
    if not hasattr(p, "lda"):
        return label
    d = p.to_dict()  # type: ignore[attr-defined]
    return f"{label} ld {d['lda']}/{d['ldb']}/{d['ldd']} -> {d['dtype_d']}"


def problem_table(calls: pd.DataFrame, kind: str, peaks: DevicePeaks | None, per_step: int,
                  device_time: bool = True) -> pd.DataFrame:
    """The table of one kind (a name of ``kinds``); its trace part's ``directions`` give the
    rows' pass (GEMM: :func:`gemm_directions`).
    ``device_time``: the calls' times are their kernels' GPU time; False (a trace without
    GPU events: the ops' CPU times) leaves TFLOP/s, TB/s and % of roofline unknown (NaN),
    since a CPU op's duration says nothing about what the device reached."""
    spec = kinds.get(kind)
    cols = spec.columns
    sub = calls[(calls["kind"] == kind) & calls["problem"].notna()]
    if sub.empty:
        return pd.DataFrame(columns=cols)
    directions = spec.part("trace").directions if "trace" in spec.parts else None
    if directions is not None:  # the kind's passes, from its calls
        sub = sub.assign(direction=kinds.resolve(directions)(sub))
    g = sub.groupby(["key", "direction"], sort=False).agg(
        problem=("problem", "first"), n=("row", "size"), time_us=("time_us", "sum"),
        flops=("flops", "sum"), bytes=("bytes", "sum"), dtype=("dtype", "first"),
        assumed=("assumed", "max")).reset_index()
    time_s = g.pop("time_us").to_numpy(dtype=np.float64) / 1e6
    n = g.pop("n").to_numpy(dtype=np.float64)
    total_flops = g["flops"].to_numpy(dtype=np.float64)
    total_bytes = g["bytes"].to_numpy(dtype=np.float64)
    g["tflops"], pct = roofline(total_flops, total_bytes, time_s, list(g["dtype"]), peaks)
    g["pct_roofline"], g["roofline_note"] = explain_over(pct, total_flops, total_bytes, time_s, list(g["dtype"]),
                                                         [kind] * len(g), n, peaks)
    with np.errstate(divide="ignore", invalid="ignore"):
        g["tb_s"] = np.where(time_s > 0, total_bytes / time_s / 1e12, np.nan)
    if not device_time:
        g["tflops"] = g["pct_roofline"] = g["tb_s"] = np.nan
        g["roofline_note"] = ""
    g["flops"], g["bytes"] = total_flops / n, total_bytes / n
    g["intensity"] = g["flops"] / g["bytes"].where(g["bytes"] > 0)
    g["calls"] = n / per_step
    g["time_s"] = time_s / per_step
    tot = time_s.sum()
    g["share_of_kind"] = time_s / tot if tot > 0 else np.nan
    g["label"] = _labels(list(g["problem"]), list(g["key"]))
    for field in spec.shape_columns:
        if field != "skew_known":
            g[field] = [getattr(p, field) for p in g["problem"]]
    if "skew_known" in spec.shape_columns:
        g["skew_known"] = g["assumed"] == ""
    # what the problem takes for granted that the trace does not record (a grouped GEMM's
    # balanced split, a varlen attention's equal lengths) is said in its label
    g["label"] = [f"{label} ({assumed})" if assumed else label for label, assumed in zip(g["label"], g["assumed"])]
    return g.sort_values("time_s", ascending=False, ignore_index=True)[cols]
