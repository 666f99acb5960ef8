"""Collectives: what each communication kernel moved, its bandwidth, and the skew across ranks.

Per communication GPU event (:func:`trace_collectives`, one trace at a time):

- the collective (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, reduce,
  send/recv), from the ops around its launch (``nccl:all_reduce``, ``c10d::alltoall_base_``,
  ``symm_mem::multimem_all_reduce_``, ``vllm::all_gather``) and else its kernel name;
- the message size ``bytes`` in NCCL's convention (the larger of the collective's input and
  output: an all-gather's output, a reduce-scatter's input), from the recorded input shapes
  and dtypes of those ops; unknown (-1) when the trace has no shapes;
- the group size: the last argument of ``record_param_comms`` (its group size), else the
  output/input ratio of a ``c10d`` all-gather or reduce-scatter, else the one process-group
  size of the trace's ``distributedInfo`` (its world size when groups differ); -1 unknown.

From those (:func:`bandwidth`): per (collective, bytes, group size), calls and time per
step, algorithm bandwidth (bytes / kernel time) and bus bandwidth (algorithm bandwidth times
NCCL's factor for the collective, :data:`BUS_FACTORS`), per rank and over ranks, with the
start skew across ranks. :func:`collective_skew` is the same skew per kernel name, and
:func:`rank_summary` each rank's median step breakdown.

A collective's kernel time includes the wait for the last rank to arrive, so a rank that
waits shows a lower bandwidth than the links gave; the skew columns say how much of that
there was.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.problems import DTYPE_BYTES, dtype_name
from primus_perf.tracelens import load as L
from primus_perf.tracelens.categories import COMMUNICATION
from primus_perf.tracelens.link import Linked

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
BROADCAST, REDUCE, SEND_RECV = "broadcast", "reduce", "send_recv"

# op or kernel name -> collective (first match wins: the specific names before "reduce")
COLLECTIVE_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (kind, re.compile(rx, re.I)) for kind, rx in (
        (ALL_REDUCE, r"all_?reduce|cross_device_reduce"),
        (REDUCE_SCATTER, r"reduce_?scatter"),
        (ALL_GATHER, r"all_?gather"),
        (ALL_TO_ALL, r"all_?to_?all"),
        (BROADCAST, r"broadcast"),
        (REDUCE, r"(^|[^a-z])reduce($|[^a-z])"),
        (SEND_RECV, r"send|recv"),
    )
)

# bus bandwidth = algorithm bandwidth x factor(n ranks in the group), as NCCL's tests define it
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    ALL_GATHER: lambda n: (n - 1) / n,
    REDUCE_SCATTER: lambda n: (n - 1) / n,
    ALL_TO_ALL: lambda n: (n - 1) / n,
    BROADCAST: lambda n: 1.0,
    REDUCE: lambda n: 1.0,
    SEND_RECV: lambda n: 1.0,
}

# element sizes of the integer types as the profiler writes them (float types: problems.dtype_name)
_INT_BYTES = {"long": 8, "long int": 8, "int": 4, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
_CHAIN_DEPTH = 6  # ops above a communication kernel's launch that are searched
_GROUP_OP = "record_param_comms"

EVENT_COLUMNS = ["rank", "step", "ts_us", "dur_us", "name", "collective", "bytes", "group_size"]
COLLECTIVE_COLUMNS = ["name", "calls", "mean_skew_us", "max_skew_us", "mean_dur_us", "last_rank"]
BANDWIDTH_COLUMNS = ["collective", "bytes", "group_size", "ranks", "calls", "time_s", "mean_us", "algbw_gbs",
                     "busbw_gbs", "min_busbw_gbs", "max_busbw_gbs", "slowest_rank", "mean_skew_us", "max_skew_us",
                     "last_rank"]
RANK_COLUMNS = ["rank", "steps", "step_time_s", "compute_s", "exposed_comm_s", "exposed_memcpy_s", "idle_s",
                "slowest"]


def collective_kind(name: str) -> str | None:
    """The collective an op or kernel name stands for, or None."""
    for kind, rx in COLLECTIVE_RULES:
        if rx.search(name):
            return kind
    return None


def bus_factor(collective: str, group_size: int) -> float:
    """NCCL's bus-bandwidth factor of a collective over ``group_size`` ranks (nan unknown)."""
    f = BUS_FACTORS.get(collective)
    return f(group_size) if f is not None and group_size > 0 else float("nan")


def element_bytes(type_name: str) -> int | None:
    """Bytes per element of a profiler ``Input type`` (``float``, ``c10::BFloat16``, ``long``)."""
    if type_name in _INT_BYTES:
        return _INT_BYTES[type_name]
    try:
        return DTYPE_BYTES[dtype_name(type_name)]
    except ValueError:
        return None


def tensor_bytes(args: L.ShapeArgs | None) -> list[int]:
    """Bytes of each tensor input (flat dims and a known dtype) of an op, in order."""
    if args is None:
        return []
    out = []
    for dims, typ in zip(args.dims, args.types, strict=False):
        size = element_bytes(typ) if isinstance(typ, str) else None
        if size is None or not isinstance(dims, list) or not all(type(d) is int and d >= 0 for d in dims):
            continue
        out.append(int(np.prod(dims, dtype=np.int64)) * size)
    return out


def _concrete_int(args: L.ShapeArgs | None, index: int) -> int | None:
    if args is None or not args.concrete or len(args.concrete) <= abs(index):
        return None
    v = args.concrete[index]
    return int(v) if isinstance(v, str) and v.isdigit() else None


def default_group_size(distributed: dict[str, Any]) -> int:
    """The group size of a trace's collectives when no op says: its one process-group size
    above 1, else its world size; -1 unknown."""
    sizes = {int(g["pg_size"]) for g in distributed.get("pg_config") or []
             if isinstance(g, dict) and isinstance(g.get("pg_size"), int) and g["pg_size"] > 1}
    if len(sizes) == 1:
        return sizes.pop()
    ws = distributed.get("world_size")
    return int(ws) if isinstance(ws, int) and ws > 0 else -1


def _describe(rt: L.RawTrace, lk: Linked, leaf: int, kernel_name: str, default_group: int) -> tuple[str, int, int]:
    """(collective, bytes, group size) of a communication kernel launched under op ``leaf``."""
    kind, group, in_bytes, pair = None, -1, -1, None
    r, depth = leaf, 0
    while r >= 0 and depth < _CHAIN_DEPTH:
        name = rt.names[rt.name[r]]
        args = rt.shape_args(int(rt.shape[r]))
        if name == _GROUP_OP:
            group = _concrete_int(args, -1) or group
        else:
            k = collective_kind(name)
            if k is not None:
                kind = kind or k
                sizes = tensor_bytes(args)
                if len(sizes) >= 2 and pair is None and name.startswith("c10d::"):
                    pair = (sizes[0], sizes[1])  # c10d's base collectives: output, input
                elif sizes and in_bytes < 0:
                    in_bytes = sizes[0]
        r, depth = int(lk.op_parent[r]), depth + 1
    kind = kind or collective_kind(kernel_name) or SEND_RECV
    if group < 0 and pair is not None and kind in (ALL_GATHER, REDUCE_SCATTER) and min(pair) > 0:
        group = max(pair) // min(pair)
    if group < 0:
        group = default_group
    if pair is not None:
        nbytes = max(pair)
    elif in_bytes >= 0 and kind == ALL_GATHER:
        nbytes = in_bytes * group if group > 0 else -1
    else:
        nbytes = in_bytes
    return kind, nbytes, group


def trace_collectives(rt: L.RawTrace, lk: Linked, kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per communication GPU event of one trace (``kernels``: its kernel table)."""
    comm = np.flatnonzero((kernels["category"] == COMMUNICATION).to_numpy())
    if not len(comm):
        return pd.DataFrame(columns=EVENT_COLUMNS)
    default_group = default_group_size(rt.distributed)
    names = kernels["name"].to_numpy()[comm].astype(str)
    seen: dict[tuple[int, str], tuple[str, int, int]] = {}
    described = []
    for leaf, kname in zip(lk.leaf_op[comm].tolist(), names.tolist(), strict=True):
        key = (leaf, kname)
        if key not in seen:
            seen[key] = _describe(rt, lk, leaf, kname, default_group)
        described.append(seen[key])
    kind, nbytes, group = zip(*described, strict=True)
    sub = kernels.iloc[comm]
    return pd.DataFrame({"rank": sub["rank"].to_numpy(), "step": sub["step"].to_numpy(),
                         "ts_us": sub["ts_us"].to_numpy(), "dur_us": sub["dur_us"].to_numpy(), "name": names,
                         "collective": list(kind), "bytes": np.asarray(nbytes, dtype=np.int64),
                         "group_size": np.asarray(group, dtype=np.int64)})


def _skew(events: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per key, over ranks: the i-th call on one rank matched with the i-th on the others;
    calls seen on every rank, their start skew (mean, max, us), and the rank that starts
    last most often (the one the others wait for)."""
    cols = [*keys, "matched", "mean_skew_us", "max_skew_us", "last_rank"]
    c = events[events["step"] >= 0]
    n_ranks = c["rank"].nunique()
    if c.empty or n_ranks < 2:
        return pd.DataFrame(columns=cols)
    c = c.sort_values("ts_us", kind="stable")[["rank", *keys, "ts_us"]].copy()
    c["i"] = c.groupby(["rank", *keys]).cumcount()
    g = c.groupby([*keys, "i"])
    agg = g["ts_us"].agg(["min", "max", "count"])
    agg = agg[agg["count"] == n_ranks]
    if agg.empty:
        return pd.DataFrame(columns=cols)
    last = c.loc[g["ts_us"].idxmax()].set_index([*keys, "i"])["rank"]
    agg = agg.join(last.rename("last_rank"))
    agg["skew"] = agg["max"] - agg["min"]
    out = agg.groupby(level=keys).agg(matched=("skew", "size"), mean_skew_us=("skew", "mean"),
                                      max_skew_us=("skew", "max"),
                                      last_rank=("last_rank", lambda s: int(s.mode().iloc[0])))
    return out.reset_index()[cols]


def collective_skew(kernels: pd.DataFrame) -> pd.DataFrame:
    """Per collective kernel name, over ranks: calls, start skew (mean, max, us), mean
    duration and the rank that starts last most often."""
    c = kernels[(kernels["category"] == COMMUNICATION) & (kernels["step"] >= 0)]
    c = c.assign(name=c["name"].astype(str))
    s = _skew(c, ["name"])
    if s.empty:
        return pd.DataFrame(columns=COLLECTIVE_COLUMNS)
    s["mean_dur_us"] = s["name"].map(c.groupby("name")["dur_us"].mean())
    s = s.rename(columns={"matched": "calls"})
    return s.sort_values("max_skew_us", ascending=False, ignore_index=True)[COLLECTIVE_COLUMNS]


def bandwidth(events: pd.DataFrame, per_rank_steps: int) -> pd.DataFrame:
    """Per (collective, bytes, group size): ranks, calls and time per step (per rank),
    mean kernel time, algorithm and bus bandwidth in GB/s (the median rank's; min and max
    over ranks; the slowest rank), and the start skew across ranks. Bandwidths are nan
    where the message size or group size is unknown. ``per_rank_steps``: profiled steps
    per rank."""
    keys = ["collective", "bytes", "group_size"]
    e = events[events["step"] >= 0]
    if e.empty:
        return pd.DataFrame(columns=BANDWIDTH_COLUMNS)
    per = e.groupby([*keys, "rank"]).agg(n=("dur_us", "size"), t=("dur_us", "sum")).reset_index()
    nbytes = per["bytes"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        alg = np.where(nbytes >= 0, nbytes * per["n"] / (per["t"] * 1e-6) / 1e9, np.nan)
    factor = [bus_factor(k, int(g)) for k, g in zip(per["collective"], per["group_size"], strict=True)]
    per["alg"], per["bus"] = alg, alg * np.asarray(factor, dtype=np.float64)
    rows = []
    for key, g in per.groupby(keys, sort=False):
        slow = g.loc[g["bus"].idxmin(), "rank"] if g["bus"].notna().any() else g.loc[g["t"].idxmax(), "rank"]
        rows.append((*key, len(g), float(g["n"].mean()) / per_rank_steps, float(g["t"].mean()) / 1e6 / per_rank_steps,
                     float(g["t"].sum() / g["n"].sum()), float(g["alg"].median()), float(g["bus"].median()),
                     float(g["bus"].min()), float(g["bus"].max()), int(slow)))
    out = pd.DataFrame(rows, columns=BANDWIDTH_COLUMNS[:12])
    out = out.merge(_skew(e, keys).drop(columns="matched"), on=keys, how="left")
    return out.sort_values("time_s", ascending=False, ignore_index=True)[BANDWIDTH_COLUMNS]


def world_size(distributed: Sequence[dict[str, Any]], n_ranks: int) -> int:
    """The job's world size: the largest ``distributedInfo.world_size`` of the traces, else
    the number of traces analyzed."""
    sizes = [int(d["world_size"]) for d in distributed if isinstance(d.get("world_size"), int)]
    return max([*sizes, n_ranks])


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
