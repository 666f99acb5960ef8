"""One linked trace as two tables: its GPU events and its modeled op calls.

- ``kernels``: one row per GPU event (kernel, memcpy, memset): rank, step, device, stream,
  ts_us, dur_us, name, kind, category (:mod:`.categories`), op (the op it is attributed
  to: the nearest op with a perf model, else the op that launched it, else the kernel
  name), shape (that op's input shapes), leaf_op, fwd_op (backward events), and ``call``:
  the trace row of the op call it is attributed to (-1: none), which makes "calls" op
  calls everywhere; ``param_shaped``: outside the optimizer step, launched by an op whose
  first input has the shape of a parameter (the shapes the optimizer step's ops take, the
  weights of linear and embedding ops, of at least :data:`MIN_PARAM_ELEMENTS` elements), or
  by FSDP2's all-gather copy-out: work done per parameter (a weight's cast, a gradient's
  accumulation, an all-gathered layer's copy), not per token.
- ``calls``: every call of a modeled op (:mod:`.perf_models`: GEMM, grouped GEMM,
  convolution, attention) that has no modeled op inside it (a grouped GEMM call owns the
  ops inside it: :mod:`.link`), in a step (or all calls when the trace has no step
  markers), and every call of an op that launched normalization or elementwise kernels
  (kind "memory", bytes only): rank, step, row, kind, key, problem (None for ops without a
  problem type), direction (a GEMM: ``bwd`` inside a backward node, else ``fwd``, a forward op run
  again there too; one run again that launched nothing is no call), flops (None: unknown), bytes, dtype, time_us (GPU time of its
  kernels, or its CPU time in a trace without GPU events), assumed (what the problem takes
  for granted that the trace does not record, "" when nothing), written (a memory-bound
  call: the bytes it writes, of ``bytes``; NaN where unknown), mask (an attention call given
  an explicit mask or bias: its dims, else "").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.base.devices import name_from_properties
from primus_perf.problems import GROUPED_TRACE_OP
from primus_perf.tracelens import load as L
from primus_perf.tracelens.arrays import unique, unique_pairs
from primus_perf.tracelens.categories import COMMUNICATION, ELEMENTWISE, NORMALIZATION, classify
from primus_perf.tracelens.device_arch import Inferred, infer_device
from primus_perf.tracelens.link import Linked
from primus_perf.tracelens.micro_batches import backward_passes, micro_batch_of_events
from primus_perf.tracelens.perf_models import OpModel, model_bytes, model_op

KIND_NAMES = {L.KIND_KERNEL: "kernel", L.KIND_MEMCPY: "memcpy", L.KIND_MEMSET: "memset"}
_STEP_NAME = re.compile(r"^ProfilerStep#\d+$")
_DTYPE_SHORT = {"c10::BFloat16": "bf16", "c10::Half": "f16", "float": "f32", "double": "f64",
                "long int": "i64", "int": "i32", "bool": "bool", "signed char": "i8", "unsigned char": "u8",
                "short": "i16", "c10::Float8_e4m3fn": "f8e4m3", "c10::Float8_e5m2": "f8e5m2"}
# ``Input type`` values of arguments that are not tensors (an int list written as ``GenericList``)
_NOT_TENSOR_TYPES = frozenset({"Scalar", "GenericList", "ScalarList", "TensorList", "Device", "Layout",
                               "ScalarType", "MemoryFormat", "String", "None"})
CALL_COLUMNS = ["rank", "step", "row", "kind", "key", "problem", "direction", "flops", "bytes", "dtype",
                "time_us", "assumed", "written", "mask"]


def op_label(name: str) -> str:
    """An op name as the tables show it: ``ProfilerStep#7`` becomes ``ProfilerStep``, a
    grouped GEMM call's annotation (its problem and tokens) ``GROUPED_TRACE_OP``."""
    if name.startswith(GROUPED_TRACE_OP + " "):
        return GROUPED_TRACE_OP
    return _STEP_NAME.sub("ProfilerStep", name)


@dataclass
class TraceTables:
    kernels: pd.DataFrame
    calls: pd.DataFrame
    device_name: str | None
    steps: list[int]
    has_shapes: bool
    has_cpu_ops: bool
    inferred_device: Inferred | None = None  # from kernel names, when ``device_name`` is None


def shape_label(args: L.ShapeArgs | None) -> str:
    """``1024x4096, 4096x14336 bf16``: the tensor inputs' dims and the first tensor dtype."""
    if args is None:
        return ""
    dims = [d for d in args.dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    text = ", ".join("x".join(map(str, d)) for d in dims)
    dtype = next((t for t, d in zip(args.types, args.dims, strict=False) if t and isinstance(d, list) and d
                  and t not in _NOT_TENSOR_TYPES), "")
    return f"{text} {_DTYPE_SHORT.get(dtype, dtype)}".strip()


def _device_name(rt: L.RawTrace, devices: np.ndarray) -> str | None:
    props = rt.device_properties
    if not props:
        return None
    used = int(np.bincount(devices[devices >= 0]).argmax()) if (devices >= 0).any() else 0
    p = next((p for p in props if p.get("id") == used), props[0])
    name = str(p.get("name") or "").strip()
    return name or name_from_properties(p)


def _categories(rt: L.RawTrace, lk: Linked) -> np.ndarray:
    """The category of each GPU event, classified once per distinct combination of kind,
    kernel name, modeled op, leaf op and optimizer flag."""
    gpu = lk.gpu
    if not len(gpu):
        return np.zeros(0, dtype=object)
    names = rt.names
    nonames = len(names)
    model_name = np.where(lk.model_op >= 0, rt.name[np.clip(lk.model_op, 0, None)], nonames)
    leaf_name = np.where(lk.leaf_op >= 0, rt.name[np.clip(lk.leaf_op, 0, None)], nonames)
    cols = [rt.kind[gpu].astype(np.int64), rt.name[gpu].astype(np.int64), model_name, leaf_name,
            lk.in_optimizer.astype(np.int64), lk.in_sharding.astype(np.int64)]
    code = np.zeros(len(gpu), dtype=np.int64)
    for c in cols:  # the combination's code, one column at a time (hashing, not sorting)
        code = pd.factorize(code * (int(c.max()) + 1) + c)[0]
    first = np.full(int(code.max()) + 1, -1, dtype=np.int64)
    first[code[::-1]] = np.arange(len(code))[::-1]  # a GPU event of each combination
    nm = [*names, ""]
    training = bool(lk.op_backward.any() or lk.in_optimizer.any())  # a _foreach_ op is an optimizer's
    cats = [classify(KIND_NAMES[int(k)], nm[int(n)], nm[int(m)] or None, nm[int(lf)] or None, bool(o), training,
                     bool(sh)) for k, n, m, lf, o, sh in zip(*(c[first].tolist() for c in cols), strict=True)]
    return np.array(cats, dtype=object)[code]


def kernel_table(rt: L.RawTrace, lk: Linked, rank: int) -> pd.DataFrame:
    names = rt.names
    gpu = lk.gpu
    name = rt.name[gpu]
    # the row each GPU event is attributed to: its modeled op, else its launching op
    attr = np.where(lk.model_op >= 0, lk.model_op, lk.leaf_op)
    attr_name = np.where(attr >= 0, rt.name[np.clip(attr, 0, None)], -1)
    attr_shape = np.where(attr >= 0, rt.shape[np.clip(attr, 0, None)], -1)
    op_labels = np.array([op_label(nm) for nm in names] + [""], dtype=object)
    all_names = np.array([*names, ""], dtype=object)
    op_col = np.where(attr_name >= 0, op_labels[attr_name], all_names[name])
    codes, inverse = np.unique(attr_shape, return_inverse=True)
    shapes = np.array([shape_label(rt.shape_args(int(c))) if c >= 0 else "" for c in codes], dtype=object)

    def names_of(rows: np.ndarray) -> pd.Categorical:
        return pd.Categorical(all_names[np.where(rows >= 0, rt.name[np.clip(rows, 0, None)], -1)])

    return pd.DataFrame({
        "rank": np.full(len(gpu), rank, dtype=np.int64),
        "step": lk.step,
        "device": rt.device[gpu],
        "stream": rt.stream[gpu],
        "ts_us": rt.ts[gpu],
        "dur_us": rt.dur[gpu],
        "name": pd.Categorical.from_codes(name, categories=pd.Index(names)) if len(names) else pd.Categorical([]),
        "kind": pd.Categorical(np.array([KIND_NAMES.get(k, "") for k in range(9)], dtype=object)[rt.kind[gpu]]),
        "category": pd.Categorical(_categories(rt, lk)),
        "op": pd.Categorical(op_col),
        "shape": pd.Categorical(shapes[inverse.ravel()] if len(gpu) else []),
        "leaf_op": names_of(lk.leaf_op),
        "fwd_op": names_of(lk.fwd_op),
        "call": attr,
    })


def call_table(rt: L.RawTrace, lk: Linked, kernels: pd.DataFrame, rank: int) -> pd.DataFrame:
    """The modeled op calls (see the module docstring), then the memory-bound calls: the ops
    that launched normalization or elementwise kernels, with a bytes model
    (:func:`~.perf_models.model_bytes`)."""
    modeled = np.flatnonzero(lk.op_model == np.arange(len(lk.op_model)))
    modeled = modeled[~lk.shadowed[modeled]]
    if lk.steps:
        modeled = modeled[lk.op_step[modeled] >= 0]
    called = kernels[kernels["call"] >= 0]
    gpu_time = called.groupby("call")["dur_us"].sum()
    # a modeled call's time: its kernels, less the casts inside it (autocast's weight cast under a linear)
    own_time = called[called["category"] != ELEMENTWISE].groupby("call")["dur_us"].sum()
    cpu_only = len(kernels) == 0
    times = rt.dur[modeled] if cpu_only else own_time.reindex(modeled, fill_value=0.0).to_numpy(dtype=np.float64)
    models: dict[tuple[int, int, bool], tuple[OpModel | None, str]] = {}
    rows = []
    for r, name, shape, bwd, t in zip(modeled.tolist(), rt.name[modeled].tolist(), rt.shape[modeled].tolist(),
                                      (lk.op_backward & ~lk.op_recomputed)[modeled].tolist(), times.tolist(),
                                      strict=True):  # a forward op run again in the backward is a forward call
        if not cpu_only and t == 0 and lk.op_recomputed[r]:
            continue  # a forward run again that stopped before this op's kernels (checkpoint's early stop)
        key = (name, shape, bwd)
        if key not in models:
            m = model_op(rt.names[name], rt.shape_args(shape), bwd)
            models[key] = (m, m.key() if m is not None else "")
        m, problem_key = models[key]
        if m is None:
            continue
        rows.append((rank, int(lk.op_step[r]), r, m.kind, problem_key, m.problem, m.direction,
                     m.flops, m.bytes, m.dtype, t, m.assumed, m.written, m.mask))
    calls = pd.DataFrame(rows, columns=CALL_COLUMNS)
    memory = _memory_calls(rt, lk, kernels, rank, gpu_time)
    return pd.concat([calls, memory], ignore_index=True) if len(memory) else calls


# ops whose recorded inputs do not say what their kernels read and write, so no bytes model:
# regions (autograd nodes, compiled graphs: their kernels run partly under ops of their own)
# and names without a namespace (an Inductor kernel's launch lists its outputs among its inputs)
_REGION = re.compile(r"^torch::autograd::|^Compiled\w*Function|^[^:]*$")


def _memory_calls(rt: L.RawTrace, lk: Linked, kernels: pd.DataFrame, rank: int, gpu_time: pd.Series
                  ) -> pd.DataFrame:
    """One row per call of an op (with recorded shapes) whose kernels are normalization or
    elementwise, except the regions of :data:`_REGION`: vectorized over calls, modeled once
    per (op name, shapes)."""
    k = kernels[kernels["category"].isin((NORMALIZATION, ELEMENTWISE)) & (kernels["call"] >= 0)]
    if lk.steps:
        k = k[k["step"] >= 0]
    rows = unique(k["call"].to_numpy(dtype=np.int64))
    rows = rows[(rt.shape[rows] >= 0) & (lk.op_model[rows] != rows)]
    region = np.array([bool(_REGION.search(nm)) for nm in rt.names] + [False], dtype=bool)
    rows = rows[~region[rt.name[rows]]]
    if not len(rows):
        return pd.DataFrame(columns=CALL_COLUMNS)
    u_name, u_shape, inverse = unique_pairs(rt.name[rows], rt.shape[rows])
    ms = [model_bytes(rt.shape_args(int(c)), rt.names[int(n)]) for n, c in zip(u_name, u_shape, strict=True)]
    ok = np.array([m is not None for m in ms], dtype=bool)[inverse]
    rows, inverse = rows[ok], inverse[ok]
    if not len(rows):
        return pd.DataFrame(columns=CALL_COLUMNS)
    keys = np.array([f"{rt.names[int(n)]} {m.label}" if m else "" for n, m in zip(u_name, ms, strict=True)],
                    dtype=object)
    nbytes = np.array([m.bytes if m else 0 for m in ms], dtype=np.float64)
    written = np.array([m.written if m and m.written is not None else np.nan for m in ms], dtype=np.float64)
    dtypes = np.array([m.dtype if m else "" for m in ms], dtype=object)
    n = len(rows)
    return pd.DataFrame({
        "rank": np.full(n, rank, dtype=np.int64), "step": lk.op_step[rows].astype(np.int64), "row": rows,
        "kind": "memory", "key": keys[inverse], "problem": None, "direction": "fwd",
        "flops": np.full(n, np.nan), "bytes": nbytes[inverse], "dtype": dtypes[inverse],
        "time_us": gpu_time.reindex(rows, fill_value=0.0).to_numpy(dtype=np.float64), "assumed": "",
        "written": written[inverse], "mask": "",
    })


MIN_PARAM_ELEMENTS = 1 << 16  # smaller parameters (norm weights, biases) share shapes with per-token tensors


def _tensor_dims(d: Any) -> Iterator[tuple[int, ...]]:
    """The tensor shapes in one recorded input: a tensor's dims, or a tensor list's."""
    if L.int_dims(d):
        yield tuple(d)
    elif isinstance(d, list):
        for x in d:
            if isinstance(x, list):
                yield from _tensor_dims(x)


def _first_input(rt: L.RawTrace, code: int) -> tuple[int, ...] | None:
    args = rt.shape_args(code)
    first = args.dims[0] if args is not None and args.dims else None
    return tuple(first) if L.int_dims(first) else None


# ops whose input ``index`` is a parameter: their weights are the parameters as the forward
# sees them (FSDP2's all-gathered, unsharded ones, where the optimizer steps shards of them)
WEIGHT_INPUTS = {"aten::linear": 1, "aten::embedding": 0}
# FSDP2's all-gather copy-out: once per layer and micro-batch, on the flat all-gathered buffer
PER_PARAMETER_OPS = frozenset({"aten::split_with_sizes_copy"})


def _parameter_shapes(rt: L.RawTrace, opt: np.ndarray) -> set[tuple[int, ...]]:
    """The shapes of the parameters (of at least :data:`MIN_PARAM_ELEMENTS` elements): the
    optimizer step's first inputs, the weights of linear and embedding ops, and a 2-D
    weight's transpose (a gradient laid out as the GEMM wrote it)."""
    params: set[tuple[int, ...]] = set()
    for code in unique(rt.shape[opt]).tolist():
        args = rt.shape_args(int(code))
        if args is not None and args.dims:
            params.update(t for t in _tensor_dims(args.dims[0]) if math.prod(t) >= MIN_PARAM_ELEMENTS)
    index = {i: WEIGHT_INPUTS[n] for i, n in enumerate(rt.names) if n in WEIGHT_INPUTS}
    if index:
        rows = np.flatnonzero(np.isin(rt.name, np.fromiter(index, dtype=np.int64)) & (rt.shape >= 0))
        for name, code in zip(*unique_pairs(rt.name[rows], rt.shape[rows])[:2], strict=True):
            args = rt.shape_args(int(code))
            at = index[int(name)]
            dims = args.dims[at] if args is not None and len(args.dims) > at else None
            if L.int_dims(dims) and math.prod(dims) >= MIN_PARAM_ELEMENTS:
                params.add(tuple(dims))
    params.update(t[::-1] for t in list(params) if len(t) == 2)
    return params


def param_shaped(rt: L.RawTrace, lk: Linked) -> np.ndarray:
    """Per GPU event: launched outside the optimizer step by an op whose first input has a
    parameter's shape (:func:`_parameter_shapes`), or by FSDP2's all-gather copy-out: work
    done per parameter once per micro-batch (see the module docstring)."""
    leaf = lk.leaf_op
    out = np.zeros(len(leaf), dtype=bool)
    opt = unique(leaf[lk.in_optimizer & (leaf >= 0)])
    params = _parameter_shapes(rt, opt)
    per_param = {i for i, n in enumerate(rt.names) if n in PER_PARAMETER_OPS}
    if not params and not per_param:
        return out
    rows = np.flatnonzero(~lk.in_optimizer & (leaf >= 0))
    codes = rt.shape[leaf[rows]]
    uniq, inverse = np.unique(codes, return_inverse=True)
    hit = np.array([c >= 0 and _first_input(rt, int(c)) in params for c in uniq.tolist()], dtype=bool)
    out[rows] = hit[inverse.ravel()]
    if per_param:
        out[rows] |= np.isin(rt.name[leaf[rows]], np.fromiter(per_param, dtype=np.int64))
    return out


SCORES_MIN = 128  # an attention's scores: a [..., s, s] tensor of at least this many positions


def _scores_dims(args: L.ShapeArgs | None) -> bool:
    """An op on an attention's scores, materialized (the math path: ``softmax(q @ k^T) @ v`` in
    several kernels): an input of 3 or 4 dims whose last two are equal and at least
    :data:`SCORES_MIN` (the scores, their mask, their gradient), or a batched product of two
    such operands that makes one (``q @ k^T``: ``[..., s, d] @ [..., d, s]``, d < s)."""
    if args is None:
        return False
    dims = [d for d in args.dims if L.int_dims(d)]
    if any(len(d) in (3, 4) and d[-1] == d[-2] >= SCORES_MIN for d in dims):
        return True
    if len(dims) >= 2 and len(dims[0]) in (3, 4) and len(dims[1]) == len(dims[0]):
        a, b = dims[0], dims[1]
        return a[-2] == b[-1] >= SCORES_MIN and a[-1] == b[-2] < a[-2]
    return False


def scores_ops(rt: L.RawTrace, attributed: np.ndarray) -> np.ndarray:
    """Per GPU event (``attributed``: the op row each is attributed to, -1 none): its op works
    on an attention's materialized scores (:func:`_scores_dims`), one check per recorded
    shape."""
    out = np.zeros(len(attributed), dtype=bool)
    has = attributed >= 0
    codes = rt.shape[attributed[has]]
    if not len(codes):
        return out
    uniq = unique(codes)
    hit = np.array([c >= 0 and _scores_dims(rt.shape_args(int(c))) for c in uniq.tolist()], dtype=bool)
    if hit.any():
        out[has] = hit[np.searchsorted(uniq, codes)]
    return out


def trace_tables(rt: L.RawTrace, lk: Linked, rank: int, kernels: pd.DataFrame) -> TraceTables:
    """One trace's tables around its :func:`kernel_table` (made first: the host tables are
    forked off once it is known)."""
    kernels["param_shaped"] = param_shaped(rt, lk) | (lk.in_sharding & (kernels["category"] != COMMUNICATION).to_numpy())
    kernels["in_optimizer"] = lk.in_optimizer
    kernels["recomputed"] = (lk.leaf_op >= 0) & lk.op_recomputed[np.clip(lk.leaf_op, 0, None)]
    kernels["micro_batch"] = micro_batch_of_events(rt, lk, backward_passes(rt, lk))
    kernels["scores"] = scores_ops(rt, kernels["call"].to_numpy())
    name = _device_name(rt, rt.device[lk.gpu])
    inferred = None
    if name is None:
        ran = unique(rt.name[lk.gpu[rt.kind[lk.gpu] == L.KIND_KERNEL]])
        inferred = infer_device(rt.names[c] for c in ran.tolist())
    return TraceTables(
        kernels=kernels,
        calls=call_table(rt, lk, kernels, rank),
        device_name=name,
        steps=lk.steps,
        has_shapes=rt.has_shapes,
        has_cpu_ops=bool((rt.kind == L.KIND_CPU_OP).any()),
        inferred_device=inferred,
    )
