"""Perf models: the problem, FLOPs and bytes of a GEMM or attention op from its recorded inputs.

Every function takes an op's recorded inputs (``Input Dims``, ``Input type``,
``Input Strides``, ``Concrete Inputs``; see :class:`~primus_perf.tracelens.load.ShapeArgs`)
and returns a :class:`OpModel`, or None when the inputs do not describe a problem this
module can count (then the op's FLOPs are unknown, never guessed).

GEMM ops give a :class:`~primus_perf.problems.GemmProblem` in the column-major convention
of ``problems/gemm.py``; torch's transposition of each operand is read from its strides, the
same way the trainer's routing points read it, so a trace of the trainer yields exactly the
problems ``trainer.flops.model_gemms`` lists. Attention ops give an
:class:`~primus_perf.problems.AttentionProblem` (forward) with a direction; backward FLOPs
are 2.5x the forward (five matmuls instead of two).

Grouped GEMMs (MoE experts) give a :class:`~primus_perf.problems.GroupedGemmProblem` (its
kind's name). A call of ``kernels.grouped.run`` is an annotation whose name is
the problem and the call's exact tokens (:func:`grouped_annotation`): exact problem, FLOPs
and bytes, whatever ran inside it. Another program's ``aten::_grouped_mm`` records only
its operands' shapes: groups, K, N and the tokens come from them, the split of the tokens
over the groups does not, so the problem takes them as balanced (skew 1) and says so
(``OpModel.assumed``).
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from primus_perf import kinds
from primus_perf.problems import (
    DTYPE_BYTES,
    AttentionProblem,
    GemmProblem,
    GroupedGemmProblem,
    Operand,
    dtype_name,
    grouped_mm_call,
    operand_layout,
    parse_grouped_trace_name,
)
from primus_perf.tracelens.categories import ATTENTION_BWD, ATTENTION_FWD, GEMM
from primus_perf.tracelens.load import ShapeArgs, int_dims


@dataclass(frozen=True)
class OpModel:
    """What one call of a modeled op computes. ``problem`` is None for the ops no problem
    type describes (convolutions, memory-bound ops); ``flops`` is None where the recorded
    inputs do not determine it (never a guessed 0); ``assumed`` says what the problem takes
    for granted that the trace does not record ("" when nothing)."""

    kind: str  # a name of ``primus_perf.kinds``, "convolution" or "memory" (bytes only)
    problem: GemmProblem | GroupedGemmProblem | AttentionProblem | None
    direction: str  # "fwd"; "bwd" for attention and convolution backward; a grouped GEMM's pass
    flops: int | None
    bytes: int | None
    input_dtype: str = ""
    label: str = ""
    assumed: str = ""
    written: int | None = None  # a memory-bound op: the bytes it writes (of ``bytes``)
    mask: str = ""  # an attention op given an explicit mask: its dims (``2x1x2048x2048``)

    @property
    def dtype(self) -> str:
        """The input dtype (what the peak table is looked up by)."""
        p = self.problem
        if p is None:
            return self.input_dtype
        return p.dtype_a if isinstance(p, GemmProblem) else p.dtype

    def key(self) -> str:
        """The problem's key, or ``kind:label`` for an op without a problem type."""
        return self.problem.key() if self.problem is not None else f"{self.kind}:{self.label}"


# ---------------------------------------------------------------------------- GEMM


def _matrix(dims: Any, strides: Any) -> Operand | None:
    """The layout of a recorded row-major 2-D operand (``problems.operand_layout``); an
    operand no BLAS layout describes is taken as packed, because torch copies it to a
    packed matrix before the GEMM. None when the dims are not two integers."""
    if not (isinstance(dims, list) and len(dims) == 2 and all(isinstance(d, int) for d in dims)):
        return None
    rows, cols = dims
    s0, s1 = (strides if isinstance(strides, list) and len(strides) == 2 else (cols, 1))
    if not (isinstance(s0, int) and isinstance(s1, int)):
        s0, s1 = cols, 1
    return operand_layout(rows, cols, s0, s1) or Operand(rows, cols, False, cols)


def _dtype(types: list[Any], i: int) -> str | None:
    try:
        return dtype_name(types[i])
    except (IndexError, ValueError):
        return None


def gemm_problem(a: Operand, b: Operand, dtype: str, out_dtype: str | None = None, batch: int = 1,
                 epilogue: str = "none") -> GemmProblem | None:
    """The problem of a row-major ``a[M, K] @ b[K, N]``, or None for mismatched or empty sizes."""
    if min(a.rows, a.cols, b.cols, batch) <= 0:
        return None
    try:
        return GemmProblem.from_operands(a, b, dtype, out_dtype=out_dtype, batch=batch, epilogue=epilogue)
    except ValueError:
        return None


def _gemm_model(prob: GemmProblem | None) -> OpModel | None:
    if prob is None:
        return None
    return OpModel("gemm", prob, "fwd", prob.flops, prob.bytes_moved)


def model_mm(s: ShapeArgs, first: int = 0, epilogue: str = "none") -> OpModel | None:
    """``aten::mm(a, b)`` (``first`` skips leading inputs, e.g. addmm's bias)."""
    if len(s.dims) < first + 2:
        return None
    strides = s.strides if len(s.strides) >= first + 2 else [None] * (first + 2)
    a = _matrix(s.dims[first], strides[first])
    b = _matrix(s.dims[first + 1], strides[first + 1])
    dtype = _dtype(s.types, first)
    if a is None or b is None or dtype is None:
        return None
    return _gemm_model(gemm_problem(a, b, dtype, epilogue=epilogue))


def model_addmm(s: ShapeArgs) -> OpModel | None:
    """``aten::addmm(bias, a, b)``: a bias vector is the bias epilogue."""
    bias = s.dims[0] if s.dims else None
    return model_mm(s, first=1, epilogue="bias" if isinstance(bias, list) and len(bias) == 1 else "none")


def model_bmm(s: ShapeArgs, first: int = 0) -> OpModel | None:
    """``aten::bmm(a[B, M, K], b[B, K, N])`` and ``baddbmm(c, a, b)``."""
    if len(s.dims) < first + 2:
        return None
    da, db = s.dims[first], s.dims[first + 1]
    if not (isinstance(da, list) and isinstance(db, list) and len(da) == 3 and len(db) == 3):
        return None
    strides = s.strides if len(s.strides) >= first + 2 else [None] * (first + 2)
    sa = strides[first][1:] if isinstance(strides[first], list) and len(strides[first]) == 3 else None
    sb = strides[first + 1][1:] if isinstance(strides[first + 1], list) and len(strides[first + 1]) == 3 else None
    a, b = _matrix(da[1:], sa), _matrix(db[1:], sb)
    dtype = _dtype(s.types, first)
    if a is None or b is None or dtype is None or da[0] != db[0]:
        return None
    return _gemm_model(gemm_problem(a, b, dtype, batch=da[0]))


def model_linear(s: ShapeArgs) -> OpModel | None:
    """``aten::linear(x[..., K], W[N, K], bias?)``: ``x @ W.T`` over the flattened rows."""
    if len(s.dims) < 2 or not s.dims[0] or not isinstance(s.dims[1], list) or len(s.dims[1]) != 2:
        return None
    x, w = s.dims[0], s.dims[1]
    K, (N, K2) = x[-1], w
    dtype = _dtype(s.types, 0)
    if K != K2 or dtype is None:
        return None
    M = math.prod(x[:-1])
    has_bias = len(s.dims) > 2 and isinstance(s.dims[2], list) and len(s.dims[2]) == 1
    return _gemm_model(GemmProblem.from_row_major(M, N, K, b_transposed=True, dtype=dtype,
                                                  epilogue="bias" if has_bias else "none"))


def model_matmul(s: ShapeArgs) -> OpModel | None:
    """``aten::matmul``: 2-D @ 2-D as mm, N-D @ 2-D with the rows flattened, else bmm."""
    if len(s.dims) < 2:
        return None
    da, db = s.dims[0], s.dims[1]
    if not (isinstance(da, list) and isinstance(db, list)) or len(da) < 2 or len(db) < 2:
        return None
    if len(da) == 2 and len(db) == 2:
        return model_mm(s)
    dtype = _dtype(s.types, 0)
    if dtype is None:
        return None
    if len(db) == 2:
        M, K = math.prod(da[:-1]), da[-1]
        b = _matrix(db, s.strides[1] if len(s.strides) > 1 else None)
        return _gemm_model(gemm_problem(Operand(M, K, False, K), b, dtype) if b else None)
    batch = math.prod(da[:-2])
    if math.prod(db[:-2]) != batch:
        return None
    return _gemm_model(gemm_problem(Operand(da[-2], da[-1], False, da[-1]),
                                    Operand(db[-2], db[-1], False, db[-1]), dtype, batch=batch))


def model_scaled_mm(s: ShapeArgs, first: int = 0) -> OpModel | None:
    """``aten::_scaled_mm(a, b, scale_a, scale_b, bias?, scale_result?, out_dtype?, ...)``: fp8
    inputs; the output dtype is recorded only as an enum code, so it is taken as bf16."""
    m = model_mm(s, first=first)
    if m is None:
        return None
    p = m.problem
    assert isinstance(p, GemmProblem)
    prob = GemmProblem(**{**p.to_dict(), "dtype_c": "bf16", "dtype_d": "bf16"})
    return _gemm_model(prob)


SKEW_UNKNOWN = "skew unknown: balanced assumed"


def _grouped_model(problem: GroupedGemmProblem, tokens: int, assumed: str = "") -> OpModel:
    return OpModel(problem.kind, problem, problem.phase, problem.flops_of(tokens), problem.bytes_of(tokens),
                   assumed=assumed)


def grouped_annotation(name: str) -> OpModel | None:
    """The grouped GEMM call an annotation of ``kernels.grouped.run`` names
    (``problems.grouped_trace_name``): its problem, exact FLOPs and bytes; None for any
    other name."""
    parsed = parse_grouped_trace_name(name)
    return None if parsed is None else _grouped_model(*parsed)


def model_grouped_mm(s: ShapeArgs, backward: bool = False) -> OpModel | None:
    """``aten::_grouped_mm(a, b, offs, ...)`` and ``_scaled_grouped_mm``: MoE expert GEMMs
    (2*T*K*N FLOPs whatever the split), read by ``problems.grouped_mm_call`` as the runtime's
    override reads them (``backward``: it runs in a backward pass):

    - 2-D ``a[T, K]`` with 3-D ``b[G, K, N]`` (T tokens split over G groups by ``offs``): a
      forward, or in a backward pass the input gradient; the split is not recorded, so the
      problem takes it as balanced (``assumed``);
    - 2-D ``a[K, T]`` with 2-D ``b[T, N]`` (``offs`` over T, ``[G]``): a weight gradient
      ``dW[G, K, N]``, balanced assumed likewise;
    - 3-D with 3-D: G equal groups (balanced, known); with ``a`` used transposed
      (``x^T[G, K, T/G] @ dy[G, T/G, N]``, recorded strides) the weight gradient
      ``dW[G, K, N]``."""
    if len(s.dims) < 2 or not (int_dims(s.dims[0]) and int_dims(s.dims[1])):
        return None
    dtype = _dtype(s.types, 0)
    if dtype is None:
        return None
    a_strides = s.strides[0] if s.strides else None
    b_strides = s.strides[1] if len(s.strides) > 1 else None
    offs = s.dims[2] if len(s.dims) > 2 and int_dims(s.dims[2]) and len(s.dims[2]) == 1 else None
    call = grouped_mm_call(s.dims[0], a_strides, s.dims[1], b_strides, offs[0] if offs else None, backward)
    if call is None:
        return None
    try:
        prob = call.problem(dtype)
    except ValueError:
        return None
    return _grouped_model(prob, call.tokens, SKEW_UNKNOWN if offs else "")


def model_linear_like(s: ShapeArgs, first: int = 0) -> OpModel | None:
    """``x[..., K] @ W[N, K].T`` of fused FP8 GEMM ops (``fbgemm::f8f8bf16_rowwise``): bf16 out."""
    if len(s.dims) < first + 2:
        return None
    x, w = s.dims[first], s.dims[first + 1]
    dtype = _dtype(s.types, first)
    if not (int_dims(x) and int_dims(w)) or len(w) != 2 or x[-1] != w[1] or dtype is None:
        return None
    try:
        prob = GemmProblem.from_row_major(math.prod(x[:-1]), w[0], w[1], b_transposed=True, dtype=dtype)
        prob = GemmProblem(**{**prob.to_dict(), "dtype_c": "bf16", "dtype_d": "bf16"})
    except ValueError:
        return None
    return _gemm_model(prob)


def _ints_arg(concrete: list[Any], i: int, n: int) -> list[int] | None:
    """An int-list argument of ``Concrete Inputs`` (a list, or a string ``"[1, 1]"``; one int
    repeated for every spatial dim), or None when it was not recorded."""
    if i >= len(concrete):
        return None
    v = concrete[i]
    if isinstance(v, str):
        text = v.strip().strip("[]()")
        if not text:
            return None
        try:
            v = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            return None
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    if not (isinstance(v, list) and v and all(isinstance(x, int) for x in v)):
        return None
    return v * n if len(v) == 1 else (v if len(v) == n else None)


def _conv_model(inp: list[int], weight: list[int], out: list[int], dtype: str, direction: str, passes: int,
                transposed: bool = False) -> OpModel | None:
    """2 x (output elements) x (weight elements per output channel) FLOPs per pass."""
    # transposed: every input element meets C_out/g x kernel weights
    flops = 2 * math.prod(inp if transposed else out) * (math.prod(weight) // max(1, weight[0])) * passes
    elem = DTYPE_BYTES[dtype]
    nbytes = int((math.prod(inp) + math.prod(weight) + math.prod(out)) * elem * (1 if passes <= 1 else 2))
    label = f"conv {'x'.join(map(str, inp))} * {'x'.join(map(str, weight))}{' T' if transposed else ''} {dtype}"
    return OpModel("convolution", None, direction, flops, nbytes, dtype, label)


def model_conv_forward(s: ShapeArgs, at: dict[str, int]) -> OpModel | None:
    """A forward convolution: input[N, C, *spatial] and weight[K, C/g, *kernel]; the output
    size needs stride, padding and dilation from ``Concrete Inputs`` (unknown without them)."""
    if len(s.dims) < 2 or not (int_dims(s.dims[0]) and int_dims(s.dims[1])):
        return None
    inp, w = s.dims[0], s.dims[1]
    nsp = len(inp) - 2
    dtype = _dtype(s.types, 0)
    if nsp < 1 or len(w) != len(inp) or dtype is None:
        return None
    transposed = "transposed" in at and _truthy(s.concrete, at["transposed"], default=False)
    if transposed:
        return _conv_model(inp, w, inp, dtype, "fwd", 1, transposed=True)
    stride = _ints_arg(s.concrete, at["stride"], nsp)
    pad = _ints_arg(s.concrete, at["padding"], nsp)
    dil = _ints_arg(s.concrete, at["dilation"], nsp) or [1] * nsp
    if stride is None or pad is None:
        return None
    spatial = [(i + 2 * p - d * (k - 1) - 1) // st + 1
               for i, p, d, k, st in zip(inp[2:], pad, dil, w[2:], stride, strict=True)]
    if min(spatial) <= 0:
        return None
    return _conv_model(inp, w, [inp[0], w[0], *spatial], dtype, "fwd", 1)


def model_conv_backward(s: ShapeArgs, grad_at: int, input_at: int | None, weight_at: int | None,
                        mask_at: int | None = None, passes: int = 2) -> OpModel | None:
    """A convolution backward from ``grad_output[N, K, *out]`` and the weight (or the input,
    when only the weight gradient is computed): one forward's FLOPs per gradient computed
    (input and weight gradients: ``output_mask``, else ``passes``)."""
    d = s.dims
    if len(d) <= grad_at or not int_dims(d[grad_at]):
        return None
    go = d[grad_at]
    dtype = _dtype(s.types, grad_at)
    w = d[weight_at] if weight_at is not None and weight_at < len(d) and int_dims(d[weight_at]) else None
    x = d[input_at] if input_at is not None and input_at < len(d) and int_dims(d[input_at]) else None
    if w is None or dtype is None or len(w) != len(go):
        return None  # the kernel size is not recorded: FLOPs unknown
    if mask_at is not None and mask_at < len(s.concrete) and isinstance(s.concrete[mask_at], str):
        flags = [f.strip().lower() for f in s.concrete[mask_at].strip("[]()").split(",")]
        if len(flags) >= 2:
            passes = max(1, sum(f in ("true", "1") for f in flags[:2]))
    inp = x if x is not None else [go[0], w[1], *go[2:]]
    return _conv_model(inp, w, go, dtype, "bwd", passes)


# ops that overwrite their first argument without reading it (a dtype-converting copy_ reads
# its source in the source's dtype and writes ``self`` in its own)
OVERWRITES_SELF = frozenset({"aten::copy_", "aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_",
                             "aten::random_", "aten::bernoulli_", "aten::exponential_", "aten::masked_fill_"})
# ops that read only the rows their index selects from the source: op -> (source, index) argument positions
INDEXING = {"aten::index_select": (0, 2), "aten::embedding": (0, 1), "aten::gather": (0, 2)}


def _schema_writes(op_name: str, n_args: int) -> frozenset[int] | None:
    """Positions of the arguments an aten op writes (``Tensor(a!)``: ``self`` of an in-place
    op, ``out`` of an out= form), from the schema of its overload with ``n_args`` arguments
    (the profiler records every argument, keyword-only ``out`` last); None when the schemas
    are not found or the overloads with that many disagree. The schemas are read from
    ``native_functions.yaml`` as torchgen packages it beside torch (no torch import);
    without it, an in-place op (``name_``) writes ``self``."""
    found = _aten_writes().get((op_name, n_args))
    if found is None:
        return frozenset({0}) if op_name.endswith("_") and not op_name.endswith("__") and not _SCHEMAS else None
    return next(iter(found)) if len(found) == 1 else None


_SCHEMAS: dict[tuple[str, int], set[frozenset[int]]] = {}
_FUNC = re.compile(r"^- func: (\w+)(?:\.\w+)?\((.*)\) ->", re.M)


def _aten_writes() -> dict[tuple[str, int], set[frozenset[int]]]:
    """(``aten::name``, argument count) -> the sets of written positions of its overloads."""
    if not _SCHEMAS:
        spec = importlib.util.find_spec("torchgen")
        path = Path(spec.origin).parent / "packaged" / "ATen" / "native" / "native_functions.yaml" \
            if spec is not None and spec.origin else None
        try:
            text = path.read_text() if path is not None else ""
        except OSError:
            text = ""
        for name, args in _FUNC.findall(text):
            parts = [a for a in args.split(", ") if a and a != "*"]
            writes = frozenset(i for i, a in enumerate(parts) if "!)" in a)
            _SCHEMAS.setdefault((f"aten::{name}", len(parts)), set()).add(writes)
    return _SCHEMAS


def _indexed_bytes(name: str, s: ShapeArgs) -> int | None:
    """Bytes of an indexing op: the index read, the selected rows read, the output written."""
    src_at, idx_at = INDEXING[name]
    if len(s.dims) <= max(src_at, idx_at) or not (int_dims(s.dims[src_at]) and isinstance(s.dims[idx_at], list)):
        return None
    src, idx = s.dims[src_at], s.dims[idx_at]
    st, it = _dtype(s.types, src_at), s.types[idx_at] if idx_at < len(s.types) else ""
    if st is None:
        return None
    n_idx = math.prod(idx) if idx else 1
    if name == "aten::index_select":
        dim = _ints_arg(s.concrete, 1, 1)
        d = dim[0] % len(src) if dim else 0
        out = n_idx * (math.prod(src) // max(1, src[d]))
    elif name == "aten::embedding":
        out = n_idx * src[-1]
    else:
        out = n_idx
    return int(2 * out * DTYPE_BYTES[st] + n_idx * (8 if it in ("long", "long int") else 4))


_INDEX_TYPES = {"long int": 8, "long": 8, "int": 4}  # the element types of index tensors
_BYTE_TYPES = {"unsigned char": 1, "signed char": 1, "bool": 1}  # data types dtype_name does not name (an fp8 KV cache)
TABLE_GAP = 8  # a tensor this many times larger than every smaller one is a table, read or written by rows


def _table_bytes(s: ShapeArgs) -> int | None:
    """An op that reads or writes rows of tables selected by an index tensor (vLLM's
    ``reshape_and_cache_flash`` writing keys and values into the paged KV cache at their
    slots, a rotary embedding reading its cos/sin cache at the positions, a scatter into a
    buffer): the other tensors read, the index read, and of each table only the rows the
    index selects (a row: the trailing dims it shares with a smaller tensor, else all but the
    first), never the whole table. None when no index tensor or no table."""
    idx = [math.prod(d) * _INDEX_TYPES[t] for d, t in zip(s.dims, s.types, strict=False)
           if t in _INDEX_TYPES and int_dims(d)]
    data = []
    for i, d in enumerate(s.dims):
        t = s.types[i] if i < len(s.types) else ""
        size = _BYTE_TYPES.get(t) or (DTYPE_BYTES[dt] if (dt := _dtype(s.types, i)) else 0)
        if size and int_dims(d) and t not in _INDEX_TYPES:
            data.append((d, size))
    if not idx or len(data) < 2:
        return None
    data.sort(key=lambda x: -math.prod(x[0]))
    cut = next((i for i in range(1, len(data)) if math.prod(data[i - 1][0]) >= TABLE_GAP * math.prod(data[i][0])), None)
    if cut is None:
        return None
    rows = max(math.prod(d) for d, t in zip(s.dims, s.types, strict=False) if t in _INDEX_TYPES and int_dims(d))
    total = sum(idx) + sum(math.prod(d) * e for d, e in data[cut:])
    for d, e in data[:cut]:
        row = next((math.prod(r[1:]) for r, _ in data[cut:] if 1 < len(r) <= len(d) and d[len(d) - len(r) + 1:] == r[1:]),
                   math.prod(d[1:]))
        total += min(rows * row, math.prod(d)) * e
    return int(total)


def model_bytes(s: ShapeArgs, name: str = "") -> OpModel | None:
    """A memory-bound op (norms, elementwise): bytes read and written; FLOPs not counted.

    Read: every tensor input except the ones the op only writes (an ``out=`` argument, the
    ``self`` of :data:`OVERWRITES_SELF`); an indexing op (:data:`INDEXING`) only the rows it
    selects; an op on rows of a table picked by an index tensor (:func:`_table_bytes`: a
    paged KV cache, a cos/sin cache, a scatter's buffer) only those rows. Written: the
    arguments the op writes (its schema's ``Tensor(a!)``, each in its own dtype), else one
    output the size of the largest input, in its dtype."""
    tensors = [(i, d, _dtype(s.types, i)) for i, d in enumerate(s.dims) if int_dims(d) or d == []]
    tensors = [(i, d, t) for i, d, t in tensors if t is not None and (d or len(tensors) == 1)]
    if not tensors:
        return None
    label = ", ".join("x".join(map(str, d)) for _, d, _ in tensors if int_dims(d)) + f" {tensors[0][2]}"
    if name in INDEXING:
        nbytes = _indexed_bytes(name, s)
        if nbytes is not None:
            return OpModel("memory", None, "fwd", None, nbytes, tensors[0][2], label)
    table = _table_bytes(s)
    if table is not None:
        return OpModel("memory", None, "fwd", None, table, tensors[0][2], label)
    writes = _schema_writes(name, len(s.dims)) if name.startswith("aten::") else None
    written_args = [(i, d, t) for i, d, t in tensors if writes and i in writes]
    if written_args:
        in_place = name.endswith("_") and name not in OVERWRITES_SELF  # self read, then written
        read = sum(math.prod(d) * DTYPE_BYTES[t] for i, d, t in tensors if i not in writes or (in_place and i == 0))
        written = sum(math.prod(d) * DTYPE_BYTES[t] for _, d, t in written_args)
    else:
        read = sum(math.prod(d) * DTYPE_BYTES[t] for _, d, t in tensors)
        _, big, bt = max(tensors, key=lambda dt: math.prod(dt[1]))
        written = math.prod(big) * DTYPE_BYTES[bt]
    return OpModel("memory", None, "fwd", None, int(read + written), tensors[0][2], label, written=int(written))


# ---------------------------------------------------------------------------- attention


def _truthy(concrete: list[Any], i: int | None, default: bool) -> bool:
    if i is None or i >= len(concrete) or concrete[i] in ("", None):
        return default
    return str(concrete[i]).strip().lower() in ("true", "1")


@dataclass(frozen=True)
class Varlen:
    """Where a variable-length (packed sequences) attention op records its sequences: the
    positions of ``cu_seqlens_q`` and ``cu_seqlens_k`` (1-D, one more entry than sequences)
    and of the ``max_seqlen_q``/``max_seqlen_k`` ints, in its schema."""

    cu_q: int
    cu_k: int
    max_q: int
    max_k: int


def _concrete_int(concrete: list[Any], i: int) -> int | None:
    v = concrete[i] if i < len(concrete) else None
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return int(v) if isinstance(v, str) and v.strip().isdigit() else None


def _varlen_problem(s: ShapeArgs, q: list[int], k: list[int], at: Varlen, dtype: str, causal: bool
                    ) -> tuple[AttentionProblem, str] | None:
    """The problem of a packed call, ``q[total_q, h, d]`` and ``k[total_k, h_kv, d]``: its
    sequences counted by ``cu_seqlens_q``, taken as equal lengths (the split is a tensor's
    values, which the trace does not record), and what was assumed; None when the
    sequences are not recorded (no ``cu_seqlens``: a paged cache or a decode step)."""
    cu = s.dims[at.cu_q] if at.cu_q < len(s.dims) else None
    if not (int_dims(cu) and len(cu) == 1 and cu[0] >= 2 and len(k) == 3):
        return None
    n = cu[0] - 1
    (total_q, hq, d), (total_k, hkv, _) = q, k
    sq, skv = max(1, round(total_q / n)), max(1, round(total_k / n))
    most = _concrete_int(s.concrete, at.max_q)
    bound = f", at most {total_q:,} x {most:,} pairs per head with the longest {most:,}" if most else ""
    prob = AttentionProblem(batch=n, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d, dtype=dtype,
                            causal=causal, layout="bshd")
    return prob, (f"varlen: {n} packed sequences (cu_seqlens) of {total_q:,} query tokens taken as equal lengths of "
                  f"{sq:,}: the fewest FLOPs those totals allow (unequal lengths do more{bound})")


def attention_model(s: ShapeArgs, q_at: int, causal_at: int | None, layout: str, direction: str,
                    varlen: Varlen | None = None, mask_at: int | None = None) -> OpModel | None:
    """An attention op whose q, k, v are inputs ``q_at .. q_at+2``; ``layout`` is the
    recorded one ("bhsd": torch SDPA, "bshd": flash-attn and torch's inner flash ops);
    ``varlen``: where the op records packed sequences, whose q, k and v are 3-D
    (``total, heads, head dim``; :func:`_varlen_problem`); ``mask_at``: where the op takes an
    explicit mask or bias (recorded when one was given)."""
    if len(s.dims) < q_at + 3:
        return None
    q, k = s.dims[q_at], s.dims[q_at + 1]
    dtype = _dtype(s.types, q_at)
    if not (int_dims(q) and int_dims(k)) or dtype is None:
        return None
    causal = _truthy(s.concrete, causal_at, default=False)
    assumed = ""
    try:
        if len(q) == 3 and varlen is not None:
            packed = _varlen_problem(s, q, k, varlen, dtype, causal)
            if packed is None:
                return None
            prob, assumed = packed
        elif len(q) == 4 and len(k) == 4:
            if layout == "bhsd":
                (b, hq, sq, d), (_, hkv, skv, _) = q, k
            else:
                (b, sq, hq, d), (_, skv, hkv, _) = q, k
            prob = AttentionProblem(batch=b, heads_q=hq, heads_kv=hkv, seq_q=sq, seq_kv=skv, head_dim=d,
                                    dtype=dtype, causal=causal, layout="bshd")
        else:
            return None
    except ValueError:
        return None
    m = s.dims[mask_at] if mask_at is not None and mask_at < len(s.dims) else None
    mask = "x".join(map(str, m)) if int_dims(m) and len(m) >= 2 else ""
    if direction == "fwd":
        return OpModel("attention", prob, "fwd", prob.forward_flops, prob.bytes_moved, assumed=assumed, mask=mask)
    return OpModel("attention", prob, "bwd", prob.backward_flops, attention_backward_bytes(prob), assumed=assumed,
                   mask=mask)


def attention_backward_bytes(p: AttentionProblem) -> int:
    """Fewest bytes of a backward pass: read q, k, v, o, dO; write dq, dk, dv."""
    elem = DTYPE_BYTES[p.dtype]
    q = p.batch * p.heads_q * p.seq_q * p.head_dim
    kv = p.batch * p.heads_kv * p.seq_kv * p.head_dim
    return int((4 * q + 4 * kv) * elem)


def _attn(q_at: int, causal_at: int | None, layout: str, direction: str, varlen: Varlen | None = None,
          mask_at: int | None = None) -> Callable[[ShapeArgs], OpModel | None]:
    return lambda s: attention_model(s, q_at, causal_at, layout, direction, varlen, mask_at)


# Attention op name -> model. Argument positions follow torch's native_functions.yaml signatures
# (checked against H100 traces of torch 2.11: is_causal's position in Concrete Inputs), and
# the libraries' op schemas: flash-attn 2's custom ops (flash_attn_interface.py) and its
# varlen forms; FlashAttention-3's C++ ops (``flash_attn_3::fwd``/``bwd``, hopper/flash_api.cpp)
# and their Python custom ops (``flash_attn_3::_flash_attn_forward``/``_backward``), which take
# packed sequences in the same call (cu_seqlens, max_seqlen) when q is 3-D.
# attention ops: what runs inside one (the math path's bmm and softmax) is part of its call
ATTENTION_MODELS: dict[str, Callable[[ShapeArgs], OpModel | None]] = {
    "aten::scaled_dot_product_attention": _attn(0, 5, "bhsd", "fwd", mask_at=3),
    "aten::_scaled_dot_product_flash_attention": _attn(0, 4, "bhsd", "fwd"),
    "aten::_scaled_dot_product_flash_attention_for_cpu": _attn(0, 4, "bhsd", "fwd", mask_at=5),
    "aten::_scaled_dot_product_cudnn_attention": _attn(0, 6, "bhsd", "fwd", mask_at=3),
    "aten::_scaled_dot_product_efficient_attention": _attn(0, 6, "bhsd", "fwd", mask_at=3),
    "aten::_scaled_dot_product_flash_attention_backward": _attn(1, 11, "bhsd", "bwd"),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _attn(1, 7, "bhsd", "bwd", mask_at=8),
    "aten::_scaled_dot_product_cudnn_attention_backward": _attn(1, 14, "bhsd", "bwd", mask_at=8),
    "aten::_scaled_dot_product_efficient_attention_backward": _attn(1, 11, "bhsd", "bwd", mask_at=4),
    "flash_attn::_flash_attn_forward": _attn(0, 5, "bshd", "fwd"),
    "flash_attn::_flash_attn_backward": _attn(1, 11, "bshd", "bwd"),
    "flash_attn::_flash_attn_varlen_forward": _attn(0, 9, "bshd", "fwd", Varlen(3, 4, 5, 6)),
    "flash_attn::_flash_attn_varlen_backward": _attn(1, 15, "bshd", "bwd", Varlen(9, 10, 11, 12)),
    "flash_attn_3::fwd": _attn(0, 24, "bshd", "fwd", Varlen(7, 8, 12, 13)),
    "flash_attn_3::_flash_attn_forward": _attn(0, 24, "bshd", "fwd", Varlen(7, 8, 12, 13)),
    "flash_attn_3::bwd": _attn(1, 16, "bshd", "bwd", Varlen(9, 10, 13, 14)),
    "flash_attn_3::_flash_attn_backward": _attn(1, 16, "bshd", "bwd", Varlen(6, 7, 10, 11)),
    "aiter::mha_fwd": _attn(0, 5, "bshd", "fwd"),
    "aiter::mha_bwd": _attn(1, 8, "bshd", "bwd"),
}

GEMM_MODELS: dict[str, Callable[[ShapeArgs], OpModel | None]] = {
    "aten::mm": model_mm,
    "primus_perf::gemm": model_mm,  # a tuned GEMM routed by kernels/gemm.py
    "aten::addmm": model_addmm,
    "aten::_addmm_activation": model_addmm,
    "aten::bmm": model_bmm,
    "aten::baddbmm": lambda s: model_bmm(s, first=1),
    "aten::matmul": model_matmul,
    "aten::linear": model_linear,
    "aten::_scaled_mm": model_scaled_mm,
    "_C::cutlass_scaled_mm": lambda s: model_scaled_mm(s, first=1),
    "fbgemm::f8f8bf16_rowwise": model_linear_like,
    "fbgemm::f8f8bf16": model_linear_like,
    "fbgemm::f8f8bf16_tensorwise": model_linear_like,
}
# convolution (argument positions of native_functions.yaml): no kind of the registry
_CONV_AT = {"stride": 3, "padding": 4, "dilation": 5}
CONVOLUTION_MODELS: dict[str, Callable[[ShapeArgs], OpModel | None]] = {
    "aten::convolution": lambda s: model_conv_forward(s, {**_CONV_AT, "transposed": 6}),
    "aten::_convolution": lambda s: model_conv_forward(s, {**_CONV_AT, "transposed": 6}),
    "aten::conv2d": lambda s: model_conv_forward(s, _CONV_AT),
    "aten::conv1d": lambda s: model_conv_forward(s, _CONV_AT),
    "aten::conv3d": lambda s: model_conv_forward(s, _CONV_AT),
    "aten::cudnn_convolution": lambda s: model_conv_forward(s, {"padding": 2, "stride": 3, "dilation": 4}),
    "aten::miopen_convolution": lambda s: model_conv_forward(s, {"padding": 3, "stride": 4, "dilation": 5}),
    "aten::convolution_backward": lambda s: model_conv_backward(s, 0, 1, 2, mask_at=10),
    "aten::cudnn_convolution_backward": lambda s: model_conv_backward(s, 1, 0, 2),
    "aten::cudnn_convolution_backward_input": lambda s: model_conv_backward(s, 1, None, 2, passes=1),
    "aten::miopen_convolution_backward": lambda s: model_conv_backward(s, 1, 0, 2),
    "aten::miopen_convolution_backward_input": lambda s: model_conv_backward(s, 1, None, 2, passes=1),
}


@dataclass(frozen=True)
class TracePart:
    """A kind's trace part (its record's ``trace``, see ``primus_perf.kinds``): what the analyzer reads of it."""

    ops: Mapping[str, Callable[[ShapeArgs], OpModel | None]]  # the op names that make its problems -> perf model
    attainable: float  # the fraction of the roofline the best available kernels reach (recommendations)
    by_pass: Mapping[str, float] = field(default_factory=dict)  # ... where a pass (direction) reaches another
    categories: tuple[str, ...] = ()  # kernel categories: no op modeled while they ran, its FLOPs per step unknown
    owns_inside: bool = False  # its ops own the modeled ops inside them (link)
    takes_over: bool = False  # and an op of it inside another of it is the model (a dispatch)
    annotation: Callable[[str], OpModel | None] | None = None  # an annotation's name -> the call it names
    in_backward: Callable[[ShapeArgs, OpModel], OpModel | None] | None = None  # a forward op called in a backward
    directions: Any = None  # calls -> their pass (analyses.problems), "module:attribute"
    item: Callable[[Any], dict[str, Any]] | None = None  # a problem's shortest problems-file item (tune_next)
    spec: Callable[[Any], str | None] | None = None  # the primus-tune options naming a problem without a file


def gemm_item(problem: GemmProblem) -> dict[str, Any]:
    """A GEMM's row-major spelling when it gives the same key (packed operands), else every field."""
    M, N, K, a_t, b_t = problem.row_major_shapes()
    optional = {"out_dtype": (problem.dtype_d, problem.dtype_a), "batch": (problem.batch, 1),
                "epilogue": (problem.epilogue, "none")}  # given where not the default
    short = {"M": M, "N": N, "K": K, "a_transposed": a_t, "b_transposed": b_t, "dtype": problem.dtype_a,
             **{name: value for name, (value, default) in optional.items() if value != default}}
    try:
        if GemmProblem.from_row_major(**short).key() == problem.key():
            return short
    except (TypeError, ValueError):
        pass
    return {"kind": problem.kind, "problem": problem.to_dict()}


def attention_spec(p: AttentionProblem) -> str | None:
    """``--problem b,hq,hkv,s,d,causal|full --dtype D`` (self-attention in the bshd layout only)."""
    if p.seq_q != p.seq_kv or p.layout != "bshd":
        return None
    return f"--problem {p.batch},{p.heads_q},{p.heads_kv},{p.seq_q},{p.head_dim},{'causal' if p.causal else 'full'}" \
           f" --dtype {p.dtype}"


# fractions of the datasheet peak the best available kernels reach (H100: the best cuBLASLt candidate
# for dense bf16 GEMMs runs at ~0.75-0.82 of it; cuDNN attention, the fastest backend measured, 0.56
# forward and 0.50 backward; grouped GEMMs between)
GEMM_TRACE = TracePart(GEMM_MODELS, 0.8, categories=(GEMM,), in_backward=lambda s, m: replace(m, direction="bwd"),
                       directions="primus_perf.tracelens.analyses.problems:gemm_directions", item=gemm_item)
GROUPED_TRACE = TracePart({"aten::_grouped_mm": model_grouped_mm, "aten::_scaled_grouped_mm": model_grouped_mm}, 0.7, owns_inside=True,
                          annotation=grouped_annotation, in_backward=lambda s, m: model_grouped_mm(s, backward=True))
ATTENTION_TRACE = TracePart(ATTENTION_MODELS, 0.55, {"fwd": 0.56, "bwd": 0.50}, (ATTENTION_FWD, ATTENTION_BWD),
                            owns_inside=True, takes_over=True, spec=attention_spec)


@lru_cache(maxsize=1)
def _read(registered: tuple[kinds.Kind, ...]) -> tuple[dict[str, Callable[[ShapeArgs], OpModel | None]], list[Any]]:
    """The registered kinds' trace parts as the analyzer reads them: op -> model, annotation readers."""
    parts = [k.part("trace") for k in registered if "trace" in k.parts]
    return ({**CONVOLUTION_MODELS, **{op: fn for p in parts for op, fn in p.ops.items()}},
            [p.annotation for p in parts if p.annotation is not None])


def models() -> dict[str, Callable[[ShapeArgs], OpModel | None]]:
    """Op name -> model: the convolutions and the ops of every kind's trace part."""
    return _read(tuple(kinds.all_kinds()))[0]


def ops_where(flag: str) -> frozenset[str]:
    """The ops of the kinds whose trace part sets ``flag`` (``owns_inside``, ``takes_over``)."""
    return frozenset(op for p in kinds.with_part("trace").values() if getattr(p, flag) for op in p.ops)


def annotation_model(name: str) -> OpModel | None:
    """The call an annotation names (a kind's trace part's ``annotation``), None for any other name."""
    return next((m for read in _read(tuple(kinds.all_kinds()))[1] if (m := read(name)) is not None), None)


def model_op(name: str, args: ShapeArgs | None, in_backward: bool = False) -> OpModel | None:
    """The model of one op call (``in_backward``: it runs in a backward pass, where its kind's
    ``in_backward`` remodels a forward call), or None (not a modeled op, or inputs not
    recorded). An annotation that names its problem (:func:`annotation_model`) needs no inputs."""
    fn = models().get(name)
    if fn is None:
        return annotation_model(name)
    if args is None:
        return None
    try:
        m = fn(args)
    except (TypeError, ValueError, IndexError):
        return None  # malformed recorded inputs: FLOPs unknown
    if in_backward and m is not None and m.direction == "fwd" and m.kind in kinds.names():
        back = kinds.get(m.kind).part("trace").in_backward
        return m if back is None else back(args, m)
    return m
