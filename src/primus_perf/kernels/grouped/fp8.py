"""An FP8 grouped-GEMM backend, of the shape of ``backends.Backend``: ``fp8_rowwise``.

Forward and input-gradient GEMMs in FP8 (e4m3) through torchao's
``_to_fp8_rowwise_then_scaled_grouped_mm``: rowwise scales of the tokens, per-expert column
scales of the weight, power-of-2 scales, ``torch._scaled_grouped_mm``. The weight gradient
stays bf16 (``grouped_mm``'s): a contraction over each group's own tokens would need
per-group scales of both operands. Groups start at multiples of 16 rows (padded as for
``grouped_mm``). It runs on CUDA with ``torch._scaled_grouped_mm`` (Hopper), bf16 operands,
K and N multiples of 16; torch has no CPU kernel for it.

It is kept out of ``backends.BACKENDS``: those backends are exact to the fp32 reference
within bf16 rounding, and FP8 is not. ``FP8_BACKENDS`` is the grouped kind's FP8 candidate
family (its validation needs an FP8 tolerance).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from primus_perf.kernels.grouped.backends import (
    Backend,
    _aligned_layout,
    _grouped_mm_wgrad,
    _offs,
    _padded,
    _scatter_index,
    _starts,
)

FP8_ALIGN = 16  # rows of each group start, and K and N
TOLERANCE = 6e-2  # relative Frobenius error of an FP8 (e4m3) GEMM against fp32, for validation


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """``w[G, K, N]`` with K contiguous in each group (what the right operand needs)."""
    return w if w.stride(1) == 1 else w.transpose(1, 2).contiguous().transpose(1, 2)


def _fp8_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    def run(a: torch.Tensor, ends: Sequence[int]) -> torch.Tensor:
        return _to_fp8_rowwise_then_scaled_grouped_mm(a, _column_major(w), _offs(ends, x.device), out_dtype=x.dtype,
                                                      pad_token_groups_for_grouped_mm=False)

    if sum(int(c) for c in counts) == 0:
        return x.new_empty(0, w.shape[2])
    layout = _aligned_layout(counts, FP8_ALIGN)
    if layout is None:
        return run(x, _starts(counts)[1:])
    index = _scatter_index(counts, layout, x.device)
    return run(_padded(x, index, layout[-1]), layout[1:])[index]


def _fp8_unsupported(device: torch.device, dtype: torch.dtype, k: int, n: int) -> str | None:
    if device.type != "cuda":
        return f"torch {torch.__version__} has no {device.type.upper()} kernel for _scaled_grouped_mm"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no _scaled_grouped_mm"
    if torch.version.hip is None and torch.cuda.get_device_capability(device) != (9, 0):
        return "torch._scaled_grouped_mm with rowwise scales runs on Hopper (SM 9.0)"
    if dtype != torch.bfloat16:
        return "the FP8 grouped GEMM takes bf16 operands"
    if k % FP8_ALIGN or n % FP8_ALIGN:
        return f"the FP8 grouped GEMM needs K and N multiples of {FP8_ALIGN}"
    try:
        import torchao.prototype.moe_training.fp8_grouped_mm  # noqa: F401
    except ImportError:
        return "the FP8 grouped GEMM needs torchao"
    return None


FP8_BACKENDS: dict[str, Backend] = {"fp8_rowwise": Backend("fp8_rowwise", _fp8_mm, _grouped_mm_wgrad, _fp8_unsupported)}
