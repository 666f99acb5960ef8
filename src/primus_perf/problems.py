"""The shared vocabulary: ``GemmProblem`` and ``AttentionProblem``.

tracelens emits them from a trace, the tuners search them, the cache stores results by
their ``key()``, and the trainer's dispatch looks them up. Both are frozen dataclasses with
a canonical string key and a plain-dict form for JSON.

GEMM convention (column-major, BLAS/cuBLASLt/hipBLASLt)
-------------------------------------------------------
A ``GemmProblem`` describes ``D = alpha * op(A) @ op(B) + beta * C`` with every matrix in
column-major storage: ``op(A)`` is m x k, ``op(B)`` is k x n, ``C``/``D`` are m x n.
``trans_a`` means A is stored k x m (leading dimension ``lda`` >= k) and used transposed.

PyTorch tensors are row-major. A row-major r x c matrix is, byte for byte, a
column-major c x r matrix. So the row-major product ``Y[M, N] = A'[M, K] @ B'[K, N]`` is
computed as the column-major product ``Y^T[N, M] = B'^T[N, K] @ A'^T[K, M]``: the operands
swap places and

    m = N,  n = M,  k = K,
    BLAS A = torch's B',  trans_a = (B' is a transposed view of a contiguous tensor),
    BLAS B = torch's A',  trans_b = (A' is a transposed view of a contiguous tensor).

For ``torch.nn.functional.linear(x, W)`` with ``x[M, K]`` and ``W[N, K]`` (``Y = x @ W.T``):
``m=N, n=M, k=K, trans_a=True, trans_b=False, lda=K, ldb=K, ldd=N`` -- the "TN" layout
that PyTorch TunableOp also reports for linear layers. ``from_row_major`` does this
mapping; ``row_major_shapes`` inverts it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

# Canonical dtype names, their element sizes, and the torch dtype they come from.
DTYPE_BYTES: dict[str, float] = {
    "f64": 8,
    "f32": 4,
    "tf32": 4,
    "bf16": 2,
    "f16": 2,
    "f8e4m3": 1,
    "f8e5m2": 1,
}

# Other spellings users type (``--dtype fp16``, ``"dtype": "float16"``): alias -> canonical.
DTYPE_ALIASES: dict[str, str] = {
    "fp64": "f64", "float64": "f64", "double": "f64",
    "fp32": "f32", "float32": "f32", "float": "f32",
    "bfloat16": "bf16",
    "fp16": "f16", "float16": "f16", "half": "f16",
    "fp8e4m3": "f8e4m3", "fp8e5m2": "f8e5m2",
}


def canonical_dtype(name: Any) -> str:
    """``"fp16"`` -> ``"f16"``; a canonical name as is; ValueError listing the names."""
    text = str(name).strip().lower()
    if text in DTYPE_BYTES:
        return text
    if text in DTYPE_ALIASES:
        return DTYPE_ALIASES[text]
    raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPE_BYTES)}; or fp16, float16, fp32, bfloat16)")


_TORCH_DTYPE_NAMES: dict[str, str] = {
    "torch.float64": "f64",
    "torch.float32": "f32",
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float8_e4m3fn": "f8e4m3",
    "torch.float8_e4m3fnuz": "f8e4m3",
    "torch.float8_e5m2": "f8e5m2",
    "torch.float8_e5m2fnuz": "f8e5m2",
    # names as the profiler writes them in "Input type"
    "double": "f64",
    "float": "f32",
    "c10::BFloat16": "bf16",
    "c10::Half": "f16",
    "c10::Float8_e4m3fn": "f8e4m3",
    "c10::Float8_e4m3fnuz": "f8e4m3",
    "c10::Float8_e5m2": "f8e5m2",
    "c10::Float8_e5m2fnuz": "f8e5m2",
}


def dtype_name(dtype: Any) -> str:
    """Canonical name ("bf16", "f32", ...) of a torch dtype or a profiler type string."""
    text = str(dtype)
    if text in DTYPE_BYTES:
        return text
    try:
        return _TORCH_DTYPE_NAMES[text]
    except KeyError:
        raise ValueError(f"unsupported dtype {text!r}") from None


def torch_dtype(name: str):
    """The torch dtype for a canonical name ("tf32" maps to float32 storage)."""
    import torch

    table = {
        "f64": torch.float64,
        "f32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "f16": torch.float16,
        "f8e4m3": torch.float8_e4m3fn,
        "f8e5m2": torch.float8_e5m2,
    }
    return table[name]


def default_compute(dtype: str) -> str:
    """Compute type PyTorch uses by default: fp32 accumulation for all float GEMMs."""
    return "f64" if dtype == "f64" else "f32"


@dataclass(frozen=True)
class Operand:
    """A row-major 2-D GEMM operand as torch holds it: ``rows x cols``, either row-contiguous
    (``transposed=False``, element ``[i, j]`` at ``i * ld + j``) or a transposed view of a
    row-contiguous matrix (``transposed=True``, element ``[i, j]`` at ``j * ld + i``)."""

    rows: int
    cols: int
    transposed: bool
    ld: int


def operand_layout(rows: int, cols: int, stride_rows: int, stride_cols: int) -> Operand | None:
    """The layout of a ``rows x cols`` matrix with strides ``(stride_rows, stride_cols)``:
    packed (``(cols, 1)``), a transposed view of a packed matrix (``(1, rows)``), or either
    with a larger leading dimension. None when neither the rows nor the columns are
    contiguous: no BLAS layout describes it (torch copies such an operand before a GEMM).
    This is the one place where strides become transposes."""
    if stride_cols == 1 and (stride_rows == cols or rows == 1):
        return Operand(rows, cols, False, cols)
    if stride_rows == 1 and (stride_cols == rows or cols == 1):
        return Operand(rows, cols, True, rows)
    if stride_cols == 1 and stride_rows >= cols:
        return Operand(rows, cols, False, stride_rows)
    if stride_rows == 1 and stride_cols >= rows:
        return Operand(rows, cols, True, stride_cols)
    return None


@dataclass(frozen=True)
class GemmProblem:
    """One GEMM, in column-major BLAS terms (see the module docstring)."""

    m: int
    n: int
    k: int
    trans_a: bool = False
    trans_b: bool = False
    dtype_a: str = "bf16"
    dtype_b: str = "bf16"
    dtype_c: str = "bf16"
    dtype_d: str = "bf16"
    compute: str = "f32"  # "f32", "tf32" (fp32 inputs on tensor cores), "f64", "f16"
    lda: int = 0  # 0 means "packed": the smallest valid leading dimension
    ldb: int = 0
    ldc: int = 0
    ldd: int = 0
    batch: int = 1
    stride_a: int = 0  # 0 means "packed" for batch > 1 (and unused for batch == 1)
    stride_b: int = 0
    stride_c: int = 0
    stride_d: int = 0
    epilogue: str = "none"  # "none", "bias", "gelu", "gelu_bias", "relu", "relu_bias"

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GemmProblem.{name} must be a positive int, got {value!r}")
        for name in ("dtype_a", "dtype_b", "dtype_c", "dtype_d", "compute"):
            try:
                object.__setattr__(self, name, canonical_dtype(getattr(self, name)))
            except ValueError as exc:
                raise ValueError(f"GemmProblem.{name}: {exc}") from None
        # Fill packed leading dimensions and batch strides so that equal problems compare
        # (and key) equal whether or not the caller spelled the defaults out.
        rows_a = self.k if self.trans_a else self.m
        rows_b = self.n if self.trans_b else self.k
        cols_a = self.m if self.trans_a else self.k
        cols_b = self.k if self.trans_b else self.n
        fill = {
            "lda": self.lda or rows_a,
            "ldb": self.ldb or rows_b,
            "ldc": self.ldc or self.m,
            "ldd": self.ldd or self.m,
        }
        for name, value in fill.items():
            object.__setattr__(self, name, int(value))
        if self.lda < rows_a or self.ldb < rows_b or self.ldc < self.m or self.ldd < self.m:
            raise ValueError(f"leading dimension too small in {self}")
        if self.batch > 1:
            strides = {
                "stride_a": self.stride_a or self.lda * cols_a,
                "stride_b": self.stride_b or self.ldb * cols_b,
                "stride_c": self.stride_c or self.ldc * self.n,
                "stride_d": self.stride_d or self.ldd * self.n,
            }
            for name, value in strides.items():
                object.__setattr__(self, name, int(value))
        else:
            for name in ("stride_a", "stride_b", "stride_c", "stride_d"):
                object.__setattr__(self, name, 0)

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_row_major(
        cls,
        M: int,
        N: int,
        K: int,
        *,
        a_transposed: bool = False,
        b_transposed: bool = False,
        dtype: str = "bf16",
        out_dtype: str | None = None,
        compute: str | None = None,
        batch: int = 1,
        epilogue: str = "none",
    ) -> GemmProblem:
        """The problem for a row-major ``Y[M, N] = A'[M, K] @ B'[K, N]`` with packed inputs.

        ``a_transposed`` says A' is ``A.T`` of a contiguous ``A[K, M]``; likewise for B'.
        ``torch.nn.functional.linear(x[M,K], W[N,K])`` is ``b_transposed=True``.
        """
        out = out_dtype or dtype
        return cls(
            m=N,
            n=M,
            k=K,
            trans_a=b_transposed,
            trans_b=a_transposed,
            dtype_a=dtype,
            dtype_b=dtype,
            dtype_c=out,
            dtype_d=out,
            compute=compute or default_compute(dtype),
            lda=K if b_transposed else N,
            ldb=M if a_transposed else K,
            ldc=N,
            ldd=N,
            batch=batch,
            epilogue=epilogue,
        )

    @classmethod
    def from_operands(
        cls,
        a: Operand,
        b: Operand,
        dtype: str,
        *,
        out_dtype: str | None = None,
        batch: int = 1,
        epilogue: str = "none",
    ) -> GemmProblem:
        """The problem of the row-major ``a[M, K] @ b[K, N]`` with the operands' own leading
        dimensions (see :func:`operand_layout`); ValueError when the inner sizes differ."""
        if a.cols != b.rows:
            raise ValueError(f"inner dimensions differ: {a.rows}x{a.cols} @ {b.rows}x{b.cols}")
        out = out_dtype or dtype
        return cls(
            m=b.cols,
            n=a.rows,
            k=a.cols,
            trans_a=b.transposed,
            trans_b=a.transposed,
            dtype_a=dtype,
            dtype_b=dtype,
            dtype_c=out,
            dtype_d=out,
            compute=default_compute(dtype),
            lda=b.ld,
            ldb=a.ld,
            ldc=b.cols,
            ldd=b.cols,
            batch=batch,
            epilogue=epilogue,
        )

    def row_major_shapes(self) -> tuple[int, int, int, bool, bool]:
        """``(M, N, K, a_transposed, b_transposed)`` of the row-major torch product."""
        return self.n, self.m, self.k, self.trans_b, self.trans_a

    # ---- identity -----------------------------------------------------------------------

    def key(self) -> str:
        """Canonical key: every field, in a fixed order; equal problems give equal keys."""
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        parts = [
            f"gemm:{t}",
            f"m{self.m}",
            f"n{self.n}",
            f"k{self.k}",
            f"{self.dtype_a}.{self.dtype_b}.{self.dtype_c}.{self.dtype_d}.{self.compute}",
            f"ld{self.lda}.{self.ldb}.{self.ldc}.{self.ldd}",
            f"b{self.batch}",
        ]
        if self.batch > 1:
            parts.append(f"s{self.stride_a}.{self.stride_b}.{self.stride_c}.{self.stride_d}")
        parts.append(f"e{self.epilogue}")
        return "|".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GemmProblem:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown GemmProblem field(s): {sorted(unknown)}")
        return cls(**data)

    # ---- performance model ----------------------------------------------------------------

    @property
    def flops(self) -> int:
        """Multiply-adds counted as two FLOPs; epilogues are not counted."""
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes through memory: A and B read once, D written once (C if beta != 0
        is not modelled: the trainer's GEMMs use beta = 0)."""
        a = self.m * self.k * DTYPE_BYTES[self.dtype_a]
        b = self.k * self.n * DTYPE_BYTES[self.dtype_b]
        d = self.m * self.n * DTYPE_BYTES[self.dtype_d]
        return int((a + b + d) * self.batch)

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes_moved

    def __str__(self) -> str:
        M, N, K, _, _ = self.row_major_shapes()
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        batch = f"{self.batch}x " if self.batch > 1 else ""
        return f"{batch}{M}x{N}x{K} {self.dtype_a} {t}" + ("" if self.epilogue == "none" else f" +{self.epilogue}")


@dataclass(frozen=True)
class AttentionProblem:
    """One scaled-dot-product attention call (forward; backward is derived from it).

    ``layout`` names the order of the four tensor dimensions as the caller holds them:
    "bshd" (batch, sequence, heads, head dim; the trainer's and flash-attn's layout) or
    "bhsd" (torch SDPA's). GQA when ``heads_kv < heads_q``; ``heads_q % heads_kv == 0``.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    dtype: str = "bf16"
    causal: bool = True
    layout: str = "bshd"

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionProblem.{name} must be a positive int, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})"
            )
        try:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        except ValueError as exc:
            raise ValueError(f"AttentionProblem.dtype: {exc}") from None
        if self.layout not in ("bshd", "bhsd"):
            raise ValueError(f"AttentionProblem.layout must be 'bshd' or 'bhsd', got {self.layout!r}")

    def key(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"attn|b{self.batch}|hq{self.heads_q}|hkv{self.heads_kv}|sq{self.seq_q}"
            f"|skv{self.seq_kv}|d{self.head_dim}|{self.dtype}|{mask}|{self.layout}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionProblem:
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown AttentionProblem field(s): {sorted(unknown)}")
        return cls(**data)

    # ---- performance model ----------------------------------------------------------------

    @property
    def score_pairs(self) -> int:
        """Number of (query, key) pairs computed per head: all of them, or under a causal
        mask aligned to the bottom right (torch and flash-attn convention when
        seq_q != seq_kv) only those with key index <= query index + (seq_kv - seq_q)."""
        sq, skv = self.seq_q, self.seq_kv
        if not self.causal:
            return sq * skv
        offset = skv - sq
        total = 0
        # rows i in [0, sq): keys j in [0, min(skv, i + offset + 1))
        # closed form over the rows where the bound is inside [0, skv]
        first_full = max(0, skv - offset)  # rows from here on see every key
        lo = max(0, -offset)  # rows before lo see no key
        hi = min(sq, first_full)
        if hi > lo:
            # sum_{i=lo}^{hi-1} (i + offset + 1)
            n = hi - lo
            total += n * (offset + 1) + (lo + hi - 1) * n // 2
        if sq > max(hi, lo):
            total += (sq - max(hi, lo)) * skv
        return total

    @property
    def forward_flops(self) -> int:
        """Two matmuls (Q K^T and P V), two FLOPs per multiply-add, over the computed pairs."""
        return 4 * self.batch * self.heads_q * self.score_pairs * self.head_dim

    @property
    def backward_flops(self) -> int:
        """Five matmuls (dV, dP, dQ, dK and the recomputed S): 2.5x the forward."""
        return self.forward_flops * 5 // 2

    @property
    def bytes_moved(self) -> int:
        """Forward: read Q, K, V once, write O once."""
        elem = DTYPE_BYTES[self.dtype]
        q = self.batch * self.heads_q * self.seq_q * self.head_dim
        kv = 2 * self.batch * self.heads_kv * self.seq_kv * self.head_dim
        return int((2 * q + kv) * elem)

    @property
    def arithmetic_intensity(self) -> float:
        return self.forward_flops / self.bytes_moved

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        gqa = f"/{self.heads_kv}" if self.heads_kv != self.heads_q else ""
        seq = f"{self.seq_q}" if self.seq_q == self.seq_kv else f"{self.seq_q}x{self.seq_kv}"
        return f"b{self.batch} h{self.heads_q}{gqa} s{seq} d{self.head_dim} {self.dtype} {mask}"


def geomean(values: list[float]) -> float:
    """Geometric mean of positive values (speedups); nan for an empty list."""
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---- problems files ------------------------------------------------------------------

PROBLEMS_SCHEMA = "primus-perf-problems/1"
MAX_PROBLEMS_BYTES = 256 << 20

Problem = "GemmProblem | AttentionProblem | GroupedGemmProblem"  # (the last is defined below)


def problem_from_item(item: Any) -> Problem:
    """One item of a problems file: ``{"kind": "gemm"|"attention"|"grouped_gemm", "problem":
    {...}}`` (what ``primus-profile shapes`` writes; a grouped GEMM's fields are those of
    :class:`GroupedGemmProblem`, e.g. ``{"groups": 32, "k": 7168, "n": 4096, "tokens":
    8192, "skew": 2, "phase": "fwd"}``, or ``counts`` (tokens per group) in place of
    ``groups``/``tokens``/``skew``), a bare ``GemmProblem`` dict, or the row-major GEMM
    spelling ``{"M": 4096, "N": 6144, "K": 4096, "b_transposed": true, "dtype": "bf16"}``.
    ValueError (naming the field) for anything else."""
    if not isinstance(item, dict):
        raise ValueError(f"expected a mapping, got {type(item).__name__}")
    kind = item.get("kind", "gemm")
    data = item.get("problem", item)
    if not isinstance(data, dict):
        raise ValueError(f"'problem' must be a mapping, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in ("kind", "count", "label", "time_s", "name")}
    try:
        if kind == "attention":
            return AttentionProblem.from_dict(data)
        if kind == "grouped_gemm":
            return _grouped_from_item(data)
        if kind != "gemm":
            raise ValueError(f"unknown kind {kind!r} (gemm, grouped_gemm or attention)")
        if "M" in data:
            for name in ("M", "N", "K"):
                value = data.get(name)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"{name} must be a positive int, got {value!r}")
            return GemmProblem.from_row_major(**data)
        return GemmProblem.from_dict(data)
    except TypeError as exc:  # missing or unexpected keyword
        raise ValueError(str(exc).replace("__init__() ", "").replace("from_row_major() ", "")) from None


def _grouped_from_item(data: dict[str, Any]) -> GroupedGemmProblem:
    if "counts" not in data:
        return GroupedGemmProblem.from_dict(data)
    counts = data.pop("counts")
    if not isinstance(counts, list) or not counts or any(
        isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts
    ):
        raise ValueError(f"counts must be a non-empty list of token counts >= 0, got {counts!r}")
    if sum(counts) == 0:
        raise ValueError("counts must route at least one token")
    clash = sorted({"groups", "tokens", "skew"} & set(data))
    if clash:
        raise ValueError(f"give counts or {', '.join(clash)}, not both")
    return GroupedGemmProblem.from_counts(counts, **data)


def load_problems(path: str | os.PathLike) -> list[Problem]:
    """The problems of a JSON or YAML problems file, in file order: a list, or a mapping with
    a ``problems`` list (``primus-profile shapes`` output, ranked by time); each item as
    :func:`problem_from_item` reads it. A problem listed twice is kept once. The one reader
    of problems files: every error is a one-line :class:`~primus_perf.errors.ConfigError`
    naming the file and the item."""
    from primus_perf.errors import ConfigError, UserError
    from primus_perf.files import check_input_file

    try:
        p = check_input_file(path, what="problems file", max_bytes=MAX_PROBLEMS_BYTES, text=True)
    except UserError as exc:
        raise ConfigError(str(exc)) from None
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{p}: cannot read the problems file: {str(exc).splitlines()[0]}") from None
    except Exception as exc:  # yaml.YAMLError and its subclasses
        raise ConfigError(f"{p}: cannot parse the problems file: {str(exc).splitlines()[0]}") from None
    items = data.get("problems") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(f"{p}: expected a list of problems or {{'problems': [...]}}")
    out: dict[str, Problem] = {}
    for i, item in enumerate(items):
        try:
            prob = problem_from_item(item)
        except ValueError as exc:
            raise ConfigError(f"{p} item {i}: {exc}") from None
        out.setdefault(prob.key(), prob)
    return list(out.values())


# ---- grouped GEMM (MoE expert layers) ---------------------------------------------------


def dataclass_from_dict(cls: Any, data: dict[str, Any]) -> Any:
    """``cls(**data)`` for a dataclass; ValueError naming any field ``cls`` does not have."""
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {sorted(unknown)}")
    return cls(**data)


GROUPED_PASSES = ("fwd", "dgrad", "wgrad")


def tokens_bucket(total: int) -> int:
    """Total tokens rounded up to a power of two (0 stays 0)."""
    return 0 if total <= 0 else 1 << (int(total) - 1).bit_length()


def skew_buckets(limit: float) -> list[float]:
    """The skew bucket edges up to ``limit``: 1, 1.25, 1.5, then 2^j and 1.5 * 2^j."""
    edges = [1.0, 1.25, 1.5]
    j = 1
    while edges[-1] < limit:
        edges += [float(2**j), 1.5 * 2**j]
        j += 1
    return edges


def skew_bucket(counts: list[int] | tuple[int, ...]) -> float:
    """max / mean tokens per group, rounded up to a bucket edge (:func:`skew_buckets`); 1.0
    for a uniform split (or no tokens). Rounding up keeps small step-to-step movement inside
    one bucket; a routing collapse onto a few experts moves to another one."""
    total = sum(counts)
    if total <= 0:
        return 1.0
    skew = max(counts) * len(counts) / total
    for edge in skew_buckets(skew):
        if edge >= skew - 1e-9:
            return edge
    raise AssertionError("unreachable: skew_buckets reaches the skew")  # pragma: no cover


_GROUPED_KEY = re.compile(
    r"ggemm:(\w+)\|g(\d+)\|k(\d+)\|n(\d+)\|t(\d+)\|s(\d+(?:\.\d+)?)\|(\w+)\|w([NT])"
)


@dataclass(frozen=True)
class GroupedGemmProblem:
    """One grouped GEMM of an MoE expert layer: ``groups`` experts, each with weight
    ``W_g[k, n]``, applied to the tokens routed to it.

    Convention (row-major, as torch holds the tensors): the tokens are sorted by group, so
    group g owns rows ``[o_g, o_g + c_g)`` of ``x[T, k]`` (``c_g`` may be 0). The weights
    are ``w[groups, k, n]`` (``trans_w=False``) or ``w[groups, n, k]`` used transposed
    (``trans_w=True``, the ``nn.Linear`` layout). ``k`` and ``n`` are always the *forward*
    layer's input and output features, and ``phase`` picks one of its three GEMMs:

    - ``fwd``:   ``y_g[c_g, n] = x_g[c_g, k] @ W_g``           (contraction over k)
    - ``dgrad``: ``dx_g[c_g, k] = dy_g[c_g, n] @ W_g^T``       (contraction over n)
    - ``wgrad``: ``dW_g[k, n] = x_g^T @ dy_g``                 (contraction over the group's
      c_g tokens: a different K per group; an empty group gives a zero ``dW_g``)

    The token distribution is part of the problem only as buckets, so that the key holds
    while per-step counts move a little: ``tokens`` is the total rounded up to a power of
    two (:func:`tokens_bucket`), ``skew`` is max/mean tokens per group rounded up to a
    bucket edge (:func:`skew_bucket`). :meth:`from_counts` builds both from real counts;
    :meth:`example_counts` gives counts of the bucket (for a tuner or a benchmark).
    """

    groups: int
    k: int
    n: int
    tokens: int
    skew: float = 1.0
    dtype: str = "bf16"
    trans_w: bool = False
    phase: str = "fwd"

    def __post_init__(self) -> None:
        for name in ("groups", "k", "n", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedGemmProblem.{name} must be a positive int, got {value!r}")
        if self.tokens & (self.tokens - 1):
            raise ValueError(
                f"GroupedGemmProblem.tokens must be a power of two (a bucket), got {self.tokens}"
            )
        skew = self.skew
        if isinstance(skew, bool) or not isinstance(skew, (int, float)):
            raise ValueError(f"GroupedGemmProblem.skew must be a number, got {skew!r}")
        if float(skew) not in skew_buckets(max(1.0, float(skew))):
            raise ValueError(f"GroupedGemmProblem.skew must be a bucket edge, got {skew!r}")
        if skew > self.groups:
            raise ValueError(f"GroupedGemmProblem.skew ({skew}) exceeds groups ({self.groups})")
        object.__setattr__(self, "skew", float(skew))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"GroupedGemmProblem.dtype: unknown dtype {self.dtype!r}")
        if not isinstance(self.trans_w, bool):
            raise ValueError(f"GroupedGemmProblem.trans_w must be a bool, got {self.trans_w!r}")
        if self.phase not in GROUPED_PASSES:
            raise ValueError(
                f"GroupedGemmProblem.phase must be one of {', '.join(GROUPED_PASSES)}, got {self.phase!r}"
            )

    @classmethod
    def from_counts(
        cls,
        counts: list[int] | tuple[int, ...],
        k: int,
        n: int,
        *,
        dtype: str = "bf16",
        trans_w: bool = False,
        phase: str = "fwd",
    ) -> GroupedGemmProblem:
        """The problem of a call with these tokens per group (buckets computed here)."""
        counts = [int(c) for c in counts]
        if any(c < 0 for c in counts):
            raise ValueError(f"negative token count in {counts}")
        return cls(
            groups=len(counts),
            k=k,
            n=n,
            tokens=max(1, tokens_bucket(sum(counts))),
            skew=skew_bucket(counts),
            dtype=dtype,
            trans_w=trans_w,
            phase=phase,
        )

    def example_counts(self) -> list[int]:
        """Deterministic counts inside this problem's buckets: ``tokens`` in all, the first
        group holding ``skew`` x the mean, the rest spread evenly (earlier groups get the
        remainder)."""
        g, total = self.groups, self.tokens
        big = min(total, round(self.skew * total / g)) if g > 1 else total
        rest, extra = divmod(total - big, g - 1) if g > 1 else (0, 0)
        return [big] + [rest + (1 if i < extra else 0) for i in range(g - 1)]

    def with_phase(self, phase: str) -> GroupedGemmProblem:
        return GroupedGemmProblem(**{**self.to_dict(), "phase": phase})

    def key(self) -> str:
        w = "T" if self.trans_w else "N"
        return (
            f"ggemm:{self.phase}|g{self.groups}|k{self.k}|n{self.n}|t{self.tokens}"
            f"|s{self.skew:g}|{self.dtype}|w{w}"
        )

    @classmethod
    def from_key(cls, key: str) -> GroupedGemmProblem:
        """The problem whose :meth:`key` is ``key``; ValueError for any other string."""
        m = _GROUPED_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a grouped GEMM problem key: {key!r}")
        phase, groups, k, n, tokens, skew, dtype, w = m.groups()
        return cls(groups=int(groups), k=int(k), n=int(n), tokens=int(tokens), skew=float(skew),
                   dtype=dtype, trans_w=w == "T", phase=phase)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupedGemmProblem:
        return dataclass_from_dict(cls, data)

    # ---- performance model ----------------------------------------------------------------

    @property
    def flops(self) -> int:
        """``2 * tokens * k * n`` for each of the three passes (multiply-add = 2 FLOPs), at the
        bucket's ``tokens`` (:meth:`flops_of` for a call's exact total)."""
        return self.flops_of(self.tokens)

    def flops_of(self, tokens: int) -> int:
        """FLOPs of one call of this problem with ``tokens`` tokens in all."""
        return 2 * tokens * self.k * self.n

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes: the two token-sized operands and the weights once each (the same
        sum in every pass: fwd reads x and W, writes y; dgrad reads dy and W, writes dx;
        wgrad reads x and dy, writes dW), at the bucket's ``tokens``."""
        return self.bytes_of(self.tokens)

    def bytes_of(self, tokens: int) -> int:
        """Fewest bytes of one call with ``tokens`` tokens in all (see :attr:`bytes_moved`)."""
        elems = tokens * (self.k + self.n) + self.groups * self.k * self.n
        return int(elems * DTYPE_BYTES[self.dtype])

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes_moved

    def __str__(self) -> str:
        w = " wT" if self.trans_w else ""
        return (
            f"{self.phase} {self.groups}x[{self.k}x{self.n}] t{self.tokens} skew{self.skew:g}"
            f" {self.dtype}{w}"
        )


# ---- grouped GEMM calls in profiler traces --------------------------------------------

GROUPED_TRACE_OP = "primus_perf::grouped_gemm"


def grouped_trace_name(problem: GroupedGemmProblem, tokens: int) -> str:
    """The name a grouped GEMM call has in a profiler trace (``kernels.grouped_gemm.run``
    records it around the call): ``primus_perf::grouped_gemm <problem key> tokens=<T>``,
    e.g. ``primus_perf::grouped_gemm ggemm:fwd|g8|k128|n256|t2048|s1.5|bf16|wN tokens=1843``:
    the problem exactly and the call's exact total tokens (its exact FLOPs and bytes)."""
    return f"{GROUPED_TRACE_OP} {problem.key()} tokens={int(tokens)}"


def parse_grouped_trace_name(name: str) -> tuple[GroupedGemmProblem, int] | None:
    """``(problem, tokens)`` of a :func:`grouped_trace_name`, or None for any other name."""
    if not name.startswith(GROUPED_TRACE_OP + " "):
        return None
    key, sep, tokens = name[len(GROUPED_TRACE_OP) + 1:].rpartition(" tokens=")
    if not sep or not tokens.isdigit():
        return None
    try:
        return GroupedGemmProblem.from_key(key), int(tokens)
    except ValueError:
        return None


# ---- aten::_grouped_mm calls -------------------------------------------------------------


@dataclass(frozen=True)
class GroupedMmCall:
    """What one ``aten::_grouped_mm(a, b, offs)`` call is, in :class:`GroupedGemmProblem`
    terms: its pass, ``groups``, ``tokens`` (all rows of the jagged or batched dimension),
    the forward layer's ``k`` and ``n`` and the forward weight's storage (``trans_w``)."""

    phase: str
    groups: int
    tokens: int
    k: int
    n: int
    trans_w: bool

    def problem(self, dtype: str, counts: list[int] | tuple[int, ...] | None = None) -> GroupedGemmProblem:
        """The problem with these tokens per group (None: ``tokens`` split evenly, as a trace
        that does not record ``offs`` leaves it)."""
        if counts is None:
            return GroupedGemmProblem(groups=self.groups, k=self.k, n=self.n,
                                      tokens=max(1, tokens_bucket(self.tokens)), dtype=dtype,
                                      trans_w=self.trans_w, phase=self.phase)
        return GroupedGemmProblem.from_counts(counts, self.k, self.n, dtype=dtype, trans_w=self.trans_w,
                                              phase=self.phase)


def _strides_or_packed(shape: Any, strides: Any) -> list[int]:
    """``strides`` when given as ints of ``shape``'s rank, else those of a packed tensor."""
    if isinstance(strides, (list, tuple)) and len(strides) == len(shape) and all(type(s) is int for s in strides):
        return list(strides)
    out, step = [], 1
    for size in reversed(list(shape)):
        out.append(step)
        step *= max(1, int(size))
    return out[::-1]


def grouped_mm_call(a_shape: Any, a_strides: Any, b_shape: Any, b_strides: Any, offs_groups: int | None,
                    backward: bool) -> GroupedMmCall | None:
    """The :class:`GroupedMmCall` of ``aten::_grouped_mm(a, b, offs)`` from its operands'
    shapes and strides (None: packed), the length of ``offs`` (None: no offs) and whether
    it runs in a backward pass; None for a layout that is no grouped GEMM problem. The one
    reading of such a call: the seam (``kernels.grouped_gemm.problem_of``), the dispatcher
    override of ``aten::_grouped_mm`` and the trace analyzer all derive their problem here.

    - ``a[T, K] @ b[G, K, N]`` with offs: forward (``trans_w``: ``b`` is a transposed view,
      the ``nn.Linear`` storage ``[G, N, K]``); in a backward pass the input gradient
      ``dy[T, N] @ W^T`` (``b`` is the forward weight transposed: K and N swap);
    - ``a[K, T] @ b[T, N]`` with offs over T: the weight gradient ``dW[G, K, N]``
      (``a`` is ``x^T``);
    - ``a[G, M, K] @ b[G, K, N]``: G equal groups of M tokens; ``a`` used transposed (a
      view of ``x[G, M', K]``, stride 1 not last) is the weight gradient
      ``x^T @ dy``, else forward (input gradient in a backward pass).
    """
    a, b = [int(x) for x in a_shape], [int(x) for x in b_shape]
    sa, sb = _strides_or_packed(a, a_strides), _strides_or_packed(b, b_strides)
    if len(a) == 2 and len(b) == 3 and offs_groups == b[0] and a[1] == b[1]:
        groups, tokens = b[0], a[0]
    elif len(a) == 2 and len(b) == 2 and offs_groups and a[1] == b[0]:
        return GroupedMmCall("wgrad", offs_groups, a[1], a[0], b[1], False)
    elif len(a) == 3 and len(b) == 3 and offs_groups is None and a[0] == b[0] and a[2] == b[1] and a[0] > 0:
        if sa[2] != 1 and a[2] > 1:  # x^T @ dy over each group's M tokens
            return GroupedMmCall("wgrad", a[0], a[0] * a[2], a[1], b[2], False)
        groups, tokens = a[0], a[0] * a[1]
    else:
        return None
    if backward:  # b is the forward weight transposed: [G, N, K] of its [G, K, N]
        return GroupedMmCall("dgrad", groups, tokens, b[2], b[1], sb[1] != 1 and b[1] > 1)
    return GroupedMmCall("fwd", groups, tokens, b[1], b[2], sb[2] != 1 and b[2] > 1)
