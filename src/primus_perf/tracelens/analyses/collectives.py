"""Collectives: what each communication kernel moved, its bandwidth, and the skew across ranks.

Per communication GPU event (:func:`trace_collectives`, one trace at a time):

- the collective (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, reduce,
  send/recv), from the ops around its launch (``nccl:all_reduce``, ``c10d::alltoall_base_``,
  ``symm_mem::multimem_all_reduce_``, ``vllm::all_gather``) and else its kernel name; a
  kernel of an expert-parallel library (DeepEP, pplx, MORI, ...:
  ``categories.expert_parallel_kind``) is its token ``dispatch`` or ``combine`` (else
  ``all_to_all``), whatever op launched it, with sizes unknown unless an op records them;
- the message size ``bytes`` in NCCL's convention (the larger of the collective's input and
  output: an all-gather's output, a reduce-scatter's input), from the recorded input shapes
  and dtypes of those ops; unknown (-1) when the trace has no shapes; and the rank's own
  input and output (``in_bytes``, ``out_bytes``: what an all-to-all sends and receives)
  where the ops record both;
- an all-to-all with split sizes (``all_to_all_single`` with splits: expert-parallel
  dispatch and combine) is an ``all_to_allv``: its input and output sizes differ by rank
  and by call; it is recognized by split sizes recorded with the op, else by an input and
  output of different sizes;
- the group size: the last argument of ``record_param_comms`` (its group size), else the
  output/input ratio of a ``c10d`` all-gather or reduce-scatter, else the one process-group
  size of the trace's ``distributedInfo`` (its world size when groups differ); -1 unknown;
- its ``phase`` (:func:`event_phases`): ``forward``, ``backward`` (launched in a backward
  node, or during the step's backward pass from its thread), ``after backward`` (launched
  after the step's backward pass: a gradient sync that waited for it, the parameters'
  gather after the optimizer step) or ``optimizer`` (inside the optimizer step);
- its ``role``: ``tokens`` (an all-to-all, an expert-parallel dispatch or combine),
  ``activations`` (launched inside a model's op: tensor or sequence parallelism) or
  ``parameters`` (data-parallel gradient reduction, FSDP's gathers, the optimizer's, or
  outside every op): what the collective's size follows, tokens or parameters. An op around
  the launch names the role only where the pattern agrees: a trace whose forward pass
  reduces nothing (no all-reduce or reduce-scatter of more than :data:`SCALAR_BYTES` in the
  forward pass, which every tensor-parallel layer does) runs no tensor parallelism, so its
  all-reduces, reduce-scatters and all-gathers are data-parallel (``parameters``) whatever
  op or annotation launched them, unless launched inside a modeled compute op (a GEMM or
  attention op: context parallelism's gathers); in one that does, those launched after the
  backward pass or in the optimizer step are (a layer's collectives run inside the passes);

From those (:func:`bandwidth`): per (collective, bytes, group size), calls and time per
step, algorithm bandwidth (bytes / kernel time) and bus bandwidth (algorithm bandwidth times
NCCL's factor for the collective, :data:`BUS_FACTORS`), per rank and over ranks, with the
start skew across ranks. A collective whose size changes from call to call
(:data:`VARIABLE_SIZE`) has one row per group size, its ``bytes`` the mean message per call
and its bandwidth the bytes of all its calls over their time. :func:`rank_bandwidth` is the
same per rank: each collective's time, bytes (message, input and output) and bandwidth per
step on every rank. :func:`collective_skew` is the same skew per kernel name, and
:func:`rank_summary` each rank's median step breakdown.

A collective's kernel time includes the wait for the last rank to arrive, so a rank that
waits shows a lower bandwidth than the links gave; the skew columns say how much of that
there was.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from primus_perf.problems import DTYPE_BYTES, dtype_name
from primus_perf.tracelens import load as L
from primus_perf.tracelens.arrays import unique
from primus_perf.tracelens.categories import (
    COMBINE,
    COMMUNICATION,
    COMMUNICATION_OP,
    DISPATCH,
    expert_parallel_kind,
    first_match,
)
from primus_perf.tracelens.link import Linked

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
ALL_TO_ALLV = "all_to_allv"  # an all-to-all with split sizes: each rank sends and receives its own amounts
BROADCAST, REDUCE, SEND_RECV = "broadcast", "reduce", "send_recv"
# collectives whose message size changes from call to call: one bandwidth row per group size
# (an expert-parallel library's token dispatch and combine: ``categories.expert_parallel_kind``)
VARIABLE_SIZE = frozenset({ALL_TO_ALLV, DISPATCH, COMBINE})

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
    **dict.fromkeys((ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, ALL_TO_ALLV, DISPATCH, COMBINE), lambda n: (n - 1) / n),
    **dict.fromkeys((BROADCAST, REDUCE, SEND_RECV), lambda n: 1.0),
}

# element sizes of the integer types as the profiler writes them (float types: problems.dtype_name)
_INT_BYTES = {"long": 8, "long int": 8, "int": 4, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1}
_CHAIN_DEPTH = 6  # ops above a communication kernel's launch that are searched
_GROUP_OP = "record_param_comms"

EVENT_COLUMNS = ["rank", "step", "ts_us", "dur_us", "name", "collective", "bytes", "group_size", "in_bytes",
                 "out_bytes", "role", "phase"]
FORWARD, BACKWARD, AFTER_BACKWARD, OPTIMIZER_STEP = "forward", "backward", "after backward", "optimizer"
# a reduction of at most this many bytes in the forward pass is a scalar's (a loss or a metric),
# not a tensor-parallel layer's activations
SCALAR_BYTES = 1024
# what a collective moves, by the first op around its launch that is not a communication op:
# tokens (an all-to-all, an expert-parallel dispatch or combine), activations (inside a model's
# op: tensor/sequence parallelism), else parameters and their gradients (data-parallel
# reduction, FSDP's gathers, the optimizer's; or launched outside every op): per-parameter
# work, the same at any micro-batch
TOKENS, ACTIVATIONS, PARAMETERS = "tokens", "activations", "parameters"
_PARAMETER_OPS = re.compile(r"AccumulateGrad|DistributedDataParallel|Reducer|^FSDP|FullyShardedDataParallel|fsdp"
                            r"|^Optimizer\.|DeepSpeed|[Zz]ero|clip_grad|^ProfilerStep#")
COLLECTIVE_COLUMNS = ["name", "calls", "mean_skew_us", "max_skew_us", "mean_dur_us", "last_rank"]
BANDWIDTH_COLUMNS = ["collective", "bytes", "group_size", "ranks", "calls", "time_s", "mean_us", "algbw_gbs",
                     "busbw_gbs", "min_busbw_gbs", "max_busbw_gbs", "slowest_rank", "sizes", "mean_skew_us",
                     "max_skew_us", "last_rank"]
RANK_BANDWIDTH_COLUMNS = ["collective", "group_size", "rank", "calls", "time_s", "bytes", "in_bytes", "out_bytes",
                          "algbw_gbs", "busbw_gbs"]
RANK_COLUMNS = ["rank", "steps", "step_time_s", "compute_s", "exposed_comm_s", "exposed_memcpy_s", "idle_s",
                "slowest"]


def collective_kind(name: str) -> str | None:
    """The collective an op or kernel name stands for, or None."""
    return first_match(COLLECTIVE_RULES, name)


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


class Described(NamedTuple):
    """What :func:`_describe` reads from the ops around a communication kernel's launch."""

    collective: str
    nbytes: int  # the message size (NCCL's convention), -1 unknown
    group: int  # ranks in the group, -1 unknown
    in_bytes: int  # this rank's input (an all-to-all's send buffer), -1 unknown
    out_bytes: int  # this rank's output (an all-to-all's receive buffer), -1 unknown
    role: str = PARAMETERS  # TOKENS, ACTIVATIONS or PARAMETERS


def _has_splits(args: L.ShapeArgs | None) -> bool:
    """Split sizes recorded with an op (``[3, 5]`` among its scalar-list inputs)."""
    if args is None:
        return False
    return any(t == "ScalarList" and isinstance(v, str) and v.startswith("[") and v.strip("[] ")
               for t, v in zip(args.types, args.concrete, strict=False))


def _describe(rt: L.RawTrace, lk: Linked, leaf: int, kernel_name: str, default_group: int) -> Described:
    """What a communication kernel launched under op ``leaf`` moved."""
    kind, group, in_bytes, pair, splits, caller = None, -1, -1, None, False, None
    r, depth = leaf, 0
    while r >= 0 and depth < _CHAIN_DEPTH:
        name = rt.names[rt.name[r]]
        if caller is None and not (name == _GROUP_OP or COMMUNICATION_OP.search(name)):
            caller = name
        args = rt.shape_args(int(rt.shape[r]))
        splits = splits or _has_splits(args)
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
    kind = expert_parallel_kind(kernel_name) or kind or collective_kind(kernel_name) or SEND_RECV
    if kind == ALL_TO_ALL and (splits or (pair is not None and pair[0] != pair[1])):
        kind = ALL_TO_ALLV
    if group < 0 and pair is not None and kind in (ALL_GATHER, REDUCE_SCATTER) and min(pair) > 0:
        group = max(pair) // min(pair)
    if group < 0:
        group = default_group
    role = TOKENS if kind in (ALL_TO_ALL, ALL_TO_ALLV, DISPATCH, COMBINE) else \
        ACTIVATIONS if caller is not None and not _PARAMETER_OPS.search(caller) else PARAMETERS
    if pair is not None:
        return Described(kind, max(pair), group, pair[1], pair[0], role)
    same = in_bytes if kind in (ALL_REDUCE, ALL_TO_ALL) else -1  # output as large as the input
    if in_bytes >= 0 and kind == ALL_GATHER:
        gathered = in_bytes * group if group > 0 else -1
        return Described(kind, gathered, group, in_bytes, gathered, role)
    return Described(kind, in_bytes, group, in_bytes, same, role)


def event_phases(rt: L.RawTrace, lk: Linked, events: np.ndarray) -> np.ndarray:
    """The phase of each GPU event of ``events`` (positions in ``lk.gpu``): :data:`OPTIMIZER_STEP`
    inside the optimizer step; :data:`BACKWARD` launched by an op in a backward node, or in
    its step's backward pass (from its first backward op's start to its last's end, on the
    host) from a thread that runs backward ops; :data:`AFTER_BACKWARD` launched after it;
    else :data:`FORWARD` (before it, a step without one, or a later micro-batch's forward)."""
    out = np.full(len(events), FORWARD, dtype=object)
    launch, leaf = lk.launch[events], lk.leaf_op[events]
    bwd = np.flatnonzero(lk.op_backward)
    if len(bwd):
        win = pd.DataFrame({"step": lk.op_step[bwd], "start": rt.ts[bwd], "end": rt.ts[bwd] + rt.dur[bwd]}).groupby(
            "step").agg(start=("start", "min"), end=("end", "max"))
        step = lk.step[events]
        b0, b1 = win["start"].reindex(step).to_numpy(), win["end"].reindex(step).to_numpy()
        at = np.clip(launch, 0, None)
        t = np.where(launch >= 0, rt.ts[at], np.nan)
        on_bwd_thread = (launch >= 0) & np.isin(rt.thread[at], unique(rt.thread[bwd]))
        in_node = (leaf >= 0) & lk.op_backward[np.clip(leaf, 0, None)]
        with np.errstate(invalid="ignore"):
            out[t > b1] = AFTER_BACKWARD
            out[in_node | ((t >= b0) & (t <= b1) & on_bwd_thread)] = BACKWARD
    out[lk.in_optimizer[events]] = OPTIMIZER_STEP
    return out


def _data_parallel_roles(kind: np.ndarray, role: np.ndarray, nbytes: np.ndarray, phase: np.ndarray,
                         in_model_op: np.ndarray) -> np.ndarray:
    """``role`` with the activations of a trace whose forward pass reduces nothing made
    parameters (see the module docstring)."""
    reduction = np.isin(kind, (ALL_REDUCE, REDUCE_SCATTER))
    tensor_parallel = reduction & (phase == FORWARD) & (role == ACTIVATIONS) & ((nbytes > SCALAR_BYTES) | (nbytes < 0))
    dp = np.isin(kind, (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)) & (role == ACTIVATIONS) & ~in_model_op
    if tensor_parallel.any():  # a layer's collectives run inside the passes, never after them
        dp &= np.isin(phase, (AFTER_BACKWARD, OPTIMIZER_STEP))
    return np.where(dp, PARAMETERS, role)


def trace_collectives(rt: L.RawTrace, lk: Linked, kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per communication GPU event of one trace (``kernels``: its kernel table)."""
    comm = np.flatnonzero((kernels["category"] == COMMUNICATION).to_numpy())
    if not len(comm):
        return pd.DataFrame(columns=EVENT_COLUMNS)
    default_group = default_group_size(rt.distributed)
    names = kernels["name"].to_numpy()[comm].astype(str)
    seen: dict[tuple[int, str], Described] = {}
    described = []
    for leaf, kname in zip(lk.leaf_op[comm].tolist(), names.tolist(), strict=True):
        key = (leaf, kname)
        if key not in seen:
            seen[key] = _describe(rt, lk, leaf, kname, default_group)
        described.append(seen[key])
    kind, nbytes, group, in_bytes, out_bytes, role = zip(*described, strict=True)
    sub = kernels.iloc[comm]

    def ints(values: tuple[int, ...]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    phase = event_phases(rt, lk, comm)
    roles = _data_parallel_roles(np.asarray(kind, dtype=object), np.asarray(role, dtype=object), ints(nbytes), phase,
                                 lk.model_op[comm] >= 0)
    return pd.DataFrame({"rank": sub["rank"].to_numpy(), "step": sub["step"].to_numpy(),
                         "ts_us": sub["ts_us"].to_numpy(), "dur_us": sub["dur_us"].to_numpy(), "name": names,
                         "collective": list(kind), "bytes": ints(nbytes), "group_size": ints(group),
                         "in_bytes": ints(in_bytes), "out_bytes": ints(out_bytes), "role": list(roles),
                         "phase": list(phase)})


SIZES_VARY = "sizes vary by call"  # the shape of a variable-size collective's GPU events


def pool_variable_sizes(kernels: pd.DataFrame, events: pd.DataFrame) -> None:
    """Give the GPU events of variable-size collectives (:data:`VARIABLE_SIZE`) one shape,
    :data:`SIZES_VARY`, in place: tables by (op, shape) (hotspots, comparisons) then keep one
    row for them instead of one per size. ``events``: :func:`trace_collectives` of these
    ``kernels`` (one row per communication event, in order)."""
    comm = np.flatnonzero((kernels["category"] == COMMUNICATION).to_numpy())
    rows = comm[events["collective"].isin(VARIABLE_SIZE).to_numpy()] if len(events) == len(comm) else comm[:0]
    if not len(rows):
        return
    shape = kernels["shape"].astype("category")
    if SIZES_VARY not in shape.cat.categories:
        shape = shape.cat.add_categories([SIZES_VARY])
    shape.iloc[rows] = SIZES_VARY
    kernels["shape"] = shape


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


def _gbs(nbytes: pd.Series, seconds_us: pd.Series) -> np.ndarray:
    """GB/s of byte totals over kernel microseconds; nan where the bytes are unknown (< 0)."""
    b = nbytes.to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b >= 0, b / (seconds_us.to_numpy(dtype=np.float64) * 1e-6) / 1e9, np.nan)


def _bus(alg: np.ndarray, collectives: pd.Series, groups: pd.Series) -> np.ndarray:
    factor = [bus_factor(k, int(g)) for k, g in zip(collectives, groups, strict=True)]
    return alg * np.asarray(factor, dtype=np.float64)


def _total(values: pd.Series) -> float:
    """Sum of byte counts, -1 when any is unknown."""
    return -1.0 if (values < 0).any() else float(values.sum())


def bandwidth(events: pd.DataFrame, per_rank_steps: int) -> pd.DataFrame:
    """Per (collective, bytes, group size): ranks, calls and time per step (per rank),
    mean kernel time, algorithm and bus bandwidth in GB/s (the median rank's; min and max
    over ranks; the slowest rank), the number of distinct message sizes, and the start
    skew across ranks. A collective of :data:`VARIABLE_SIZE` has one row per group size:
    ``bytes`` is its mean message per call, its bandwidth its bytes over its time.
    Bandwidths are nan where the message size or group size is unknown.
    ``per_rank_steps``: profiled steps per rank."""
    keys = ["collective", "size_key", "group_size"]
    e = events[events["step"] >= 0]
    if e.empty:
        return pd.DataFrame(columns=BANDWIDTH_COLUMNS)
    e = e.assign(size_key=np.where(e["collective"].isin(VARIABLE_SIZE), 0, e["bytes"]))
    per = e.groupby([*keys, "rank"]).agg(n=("dur_us", "size"), t=("dur_us", "sum"), b=("bytes", _total)).reset_index()
    sizes = e.groupby(keys)["bytes"].nunique()
    per["alg"] = _gbs(per["b"], per["t"])
    per["bus"] = _bus(per["alg"].to_numpy(), per["collective"], per["group_size"])
    rows = []
    for (kind, size, group), g in per.groupby(keys, sort=False):
        slow = g.loc[g["bus"].idxmin(), "rank"] if g["bus"].notna().any() else g.loc[g["t"].idxmax(), "rank"]
        nbytes = size if kind not in VARIABLE_SIZE else -1 if (g["b"] < 0).any() else round(g["b"].sum() / g["n"].sum())
        rows.append((kind, int(nbytes), group, len(g), float(g["n"].mean()) / per_rank_steps,
                     float(g["t"].mean()) / 1e6 / per_rank_steps, float(g["t"].sum() / g["n"].sum()),
                     float(g["alg"].median()), float(g["bus"].median()), float(g["bus"].min()), float(g["bus"].max()),
                     int(slow), int(sizes[(kind, size, group)]), size))
    out = pd.DataFrame(rows, columns=[*BANDWIDTH_COLUMNS[:13], "size_key"])
    out = out.merge(_skew(e, keys).drop(columns="matched"), on=keys, how="left")
    return out.sort_values("time_s", ascending=False, ignore_index=True)[BANDWIDTH_COLUMNS]


def rank_bandwidth(events: pd.DataFrame, per_rank_steps: int) -> pd.DataFrame:
    """Per (collective, group size, rank), per step: calls, kernel time, message bytes, the
    rank's input and output bytes (what an all-to-all sends and receives; nan unknown), and
    algorithm and bus bandwidth (GB/s: the message bytes of all calls over their time), every
    message size together. Collectives by total time, then ranks."""
    e = events[events["step"] >= 0]
    if e.empty:
        return pd.DataFrame(columns=RANK_BANDWIDTH_COLUMNS)
    keys = ["collective", "group_size", "rank"]
    g = e.groupby(keys).agg(calls=("dur_us", "size"), t=("dur_us", "sum"), b=("bytes", _total),
                            i=("in_bytes", _total), o=("out_bytes", _total)).reset_index()
    g["algbw_gbs"] = _gbs(g["b"], g["t"])
    g["busbw_gbs"] = _bus(g["algbw_gbs"].to_numpy(), g["collective"], g["group_size"])
    g["calls"] = g["calls"] / per_rank_steps
    g["time_s"] = g["t"] / 1e6 / per_rank_steps
    for col, src in (("bytes", "b"), ("in_bytes", "i"), ("out_bytes", "o")):
        g[col] = np.where(g[src] >= 0, g[src] / per_rank_steps, np.nan)
    order = g.groupby(["collective", "group_size"])["t"].transform("sum")
    g = g.assign(order=-order).sort_values(["order", "collective", "group_size", "rank"], ignore_index=True)
    return g[RANK_BANDWIDTH_COLUMNS]


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
