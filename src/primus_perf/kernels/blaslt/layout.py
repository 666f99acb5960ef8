"""The memory a GemmProblem's matrices span, and which layouts a BLAS-Lt call may be given.

A BLAS-Lt plan describes each matrix (A, B, C, D; column-major, BLAS terms) by rows, cols,
leading dimension, batch count and batch stride. Element ``(i, j)`` of batch ``b`` lies at
``b * stride + j * ld + i`` elements from the matrix's pointer, so the matrix spans
:meth:`MatrixLayout.extent` elements. :func:`layouts` is the one description: the binding
builds its descriptors from it and the tuner sizes its buffers from it, so the tuner's
operands cover exactly what every candidate may touch.

:func:`refusal` says why a problem must not be run by a BLAS-Lt kernel (None: it may):

- a leading dimension smaller than the rows (columns would overlap);
- with a batch: a batch stride that is zero (an expanded batch), negative, or smaller than
  one matrix's extent (batches would overlap: for the output, batches would write over
  each other; for inputs, the layout is one no BLAS-Lt descriptor documents);
- a batch stride whose byte size is not a multiple of the pointer alignment the heuristic
  assumed (every batch's matrix starts at ``pointer + b * stride``);
- C laid out unlike D (the kernels pass D's pointer for C, with beta 0).

Pointers are checked per call by the kernel (a bit mask, ``kernels.gemm``): the heuristic was asked for
algorithms for pointers aligned to the vendor table's ``pointer_alignment`` (cuBLASLt's
default of 256 bytes, set explicitly); a call whose pointer is less aligned runs torch's
own GEMM instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from primus_perf.problems import DTYPE_BYTES, GemmProblem

ALIGNMENT = 256  # bytes: cuBLASLt's MIN_ALIGNMENT_*_BYTES default, which the binding sets explicitly


@dataclass(frozen=True)
class MatrixLayout:
    """One matrix of a BLAS-Lt call, column-major: ``rows x cols`` with leading dimension
    ``ld`` (elements between columns), ``batch`` matrices ``stride`` elements apart."""

    name: str  # "a", "b", "c", "d"
    dtype: str
    rows: int
    cols: int
    ld: int
    batch: int
    stride: int

    @property
    def itemsize(self) -> int:
        return int(DTYPE_BYTES[self.dtype])

    def matrix_extent(self) -> int:
        """Elements from one matrix's first element to one past its last."""
        return (self.cols - 1) * self.ld + self.rows

    def extent(self) -> int:
        """Elements from the first batch's first element to one past the last batch's last."""
        return (self.batch - 1) * self.stride + self.matrix_extent()

    def extent_bytes(self) -> int:
        return self.extent() * self.itemsize


def layouts(p: GemmProblem) -> tuple[MatrixLayout, MatrixLayout, MatrixLayout, MatrixLayout]:
    """A, B, C, D of ``p`` as the BLAS-Lt descriptors describe them."""
    ra, ca = (p.k, p.m) if p.trans_a else (p.m, p.k)
    rb, cb = (p.n, p.k) if p.trans_b else (p.k, p.n)
    return (
        MatrixLayout("a", p.dtype_a, ra, ca, p.lda, p.batch, p.stride_a),
        MatrixLayout("b", p.dtype_b, rb, cb, p.ldb, p.batch, p.stride_b),
        MatrixLayout("c", p.dtype_c, p.m, p.n, p.ldc, p.batch, p.stride_c),
        MatrixLayout("d", p.dtype_d, p.m, p.n, p.ldd, p.batch, p.stride_d),
    )


def refusal(p: GemmProblem, alignment: int = ALIGNMENT) -> str | None:
    """Why ``p``'s layout must not be given to a BLAS-Lt kernel (module docstring), or None."""
    mats = layouts(p)
    for m in mats:
        if m.ld < m.rows:
            return f"{m.name}: leading dimension {m.ld} < rows {m.rows}"
        if p.batch == 1:
            continue
        if m.stride <= 0:
            return f"{m.name}: batch stride {m.stride} (an expanded or reversed batch)"
        if m.stride < m.matrix_extent():
            return f"{m.name}: batch stride {m.stride} < one matrix's extent {m.matrix_extent()} (batches overlap)"
        if (m.stride * m.itemsize) % alignment:
            return f"{m.name}: batch stride of {m.stride * m.itemsize} bytes is not a multiple of {alignment}"
    c, d = mats[2], mats[3]
    if (c.dtype, c.ld, c.stride) != (d.dtype, d.ld, d.stride):
        return "C is laid out unlike D (the kernel writes D in place of C)"
    return None
