"""``GemmProblem``: one (batched) GEMM, the problem type of the ``gemm`` kind.

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

import re
from dataclasses import dataclass
from typing import Any

from primus_perf.problems.base import MAX_SIZE, ProblemType
from primus_perf.problems.dtypes import DTYPE_BYTES, canonical_dtype, default_compute


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
class GemmProblem(ProblemType, kind="gemm"):
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
        a = Operand(M, K, a_transposed, M if a_transposed else K)
        b = Operand(K, N, b_transposed, K if b_transposed else N)
        return cls.from_operands(a, b, dtype, out_dtype=out_dtype, compute=compute, batch=batch, epilogue=epilogue)

    @classmethod
    def from_operands(
        cls,
        a: Operand,
        b: Operand,
        dtype: str,
        *,
        out_dtype: str | None = None,
        compute: str | None = None,
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
            compute=compute or default_compute(dtype),
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

    @classmethod
    def from_item(cls, data: dict[str, Any]) -> GemmProblem:
        """A problems-file item's fields: a ``GemmProblem`` dict, or the row-major spelling
        ``{"M": .., "N": .., "K": .., "b_transposed": .., "dtype": ..}``."""
        if "M" in data:
            for name in ("M", "N", "K"):
                value = data.get(name)
                if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SIZE:
                    raise ValueError(f"{name} must be a positive int of at most {MAX_SIZE}, got {value!r}")
            return cls.from_row_major(**data)
        return cls.from_dict(data)

    @classmethod
    def from_spec(cls, spec: str) -> GemmProblem:
        """The problem a command line names: ``M,N,K[,layout,dtype]`` (the row-major torch
        product ``[M, K] @ [K, N]``; layout: the BLAS transposes of the label, TN by default,
        the layout of ``nn.Linear``'s forward; dtype bf16 by default), or the label itself
        (``str(problem)``: ``"8192x4096x14336 bf16 TN"``). ValueError naming what is wrong."""
        parts = [x for x in re.split(r"[\s,]+", spec.strip()) if x]
        if parts and "x" in parts[0]:
            parts[:1] = parts[0].split("x")
        sizes, rest = parts[:3], parts[3:]
        if len(sizes) != 3 or not all(x.isdigit() for x in sizes) or len(rest) > 2:
            raise ValueError(f"{spec!r} is not M,N,K[,layout,dtype] (e.g. 8192,4096,14336,TN,bf16)")
        layout = next((x.upper() for x in rest if re.fullmatch(r"[NTnt]{2}", x)), "TN")
        dtypes = [x for x in rest if not re.fullmatch(r"[NTnt]{2}", x)]
        if len(dtypes) > 1:
            raise ValueError(f"{spec!r}: one layout (NN, NT, TN, TT) and one dtype, got {' '.join(rest)}")
        M, N, K = (int(x) for x in sizes)
        return cls.from_item({"M": M, "N": N, "K": K, "a_transposed": layout[1] == "T",
                              "b_transposed": layout[0] == "T", "dtype": canonical_dtype(dtypes[0] if dtypes else "bf16")})

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

    def __str__(self) -> str:
        """The one label every command prints (``primus-tune gemm --problem`` reads it
        back): the torch product's M x N x K, the dtype, the BLAS layout (trans_a, trans_b)."""
        M, N, K, _, _ = self.row_major_shapes()
        t = ("T" if self.trans_a else "N") + ("T" if self.trans_b else "N")
        batch = f"{self.batch}x " if self.batch > 1 else ""
        return f"{batch}{M}x{N}x{K} {self.dtype_a} {t}" + ("" if self.epilogue == "none" else f" +{self.epilogue}")
