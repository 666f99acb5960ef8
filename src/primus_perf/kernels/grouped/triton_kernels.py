"""The Triton grouped GEMM: persistent kernels for the forward/input-gradient product and for
the weight gradient.

Both use a fixed grid of programs (one per SM/CU on a GPU) that walk the work items
``(group, output tile)`` in a fixed order: work item ``t`` belongs to program
``t % programs``. Groups are visited in the config's order ("natural", or "largest_first"
so that the big groups' tiles are spread over all programs first and the small ones fill
the tail). Tile offsets come from the group offsets on the device: no host work per tile.
The group tables (starts, visit order) are built from host counts (:func:`grouped_mm`,
:func:`grouped_mm_wgrad`) or, with no host read, from an ``aten::_grouped_mm`` call's device
``offs`` (:func:`grouped_mm_offs`, :func:`grouped_mm_wgrad_offs`: the starts are the ends
shifted by one, clamped to the rows and made non-decreasing, so no ``offs`` sends a program
out of bounds; "largest_first" is a stable descending argsort of the counts, the host
order's). Rows past the last group are left unwritten, as torch's kernel leaves them.

- :func:`grouped_mm`: ``y[T, N] = x_g[c_g, K] @ W_g[K, N]`` for every group, ``w`` of any
  strides (so the input gradient passes ``w.transpose(1, 2)``). A group's tiles are
  ``ceil(c_g / BLOCK_M) * ceil(N / BLOCK_N)``; an empty group has none.
- :func:`grouped_mm_wgrad`: ``dW_g[K, N] = x_g^T @ dy_g``, the contraction over the group's
  ``c_g`` tokens (a different K per group). Every group has ``ceil(K / BLOCK_M) *
  ceil(N / BLOCK_N)`` tiles; an empty group's tiles store zeros.

Inside a group, work items walk ``GROUP_M`` row tiles together across the column tiles
(the config's ``group_m``), so that the programs running side by side share weight and
token tiles in L2. Operands load through plain pointers with masks (no TMA descriptors:
group boundaries fall on any row, which a descriptor per group would need building on the
device); when the contraction is a multiple of ``BLOCK_K`` (forward and input gradient
with K resp. N divisible) the inner loop loads without a contraction mask. Accumulation in
fp32 (``tl.dot`` on the bf16/f16 tiles); fp32 inputs use IEEE products (no TF32), so the
kernel matches an fp32 reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from primus_perf.base.devices import gpu_vendor
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.offsets import derived
from primus_perf.kernels.triton_launch import launch_options

INTERPRETER_PROGRAMS = 4  # grid on the CPU interpreter: every program walks several tiles


@triton.jit
def _first_item(base, pid, PROGRAMS: tl.constexpr):
    """The first work item >= ``base`` that belongs to program ``pid`` (no negative modulo:
    the interpreter and the compiler disagree on its sign)."""
    return base + (pid - base % PROGRAMS + PROGRAMS) % PROGRAMS


@triton.jit
def _tile_of(local, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a group's ``local``-th work item: ``GROUP_M`` row tiles
    at a time walk the column tiles together, so the programs running side by side share
    their column (weight) tiles and row tiles in L2 (``GROUP_M=1``: row by row)."""
    per_band = GROUP_M * n_tiles
    first_m = (local // per_band) * GROUP_M
    band = tl.minimum(m_tiles - first_m, GROUP_M)
    in_band = local % per_band
    return first_m + in_band % band, in_band // band


@triton.jit
def _tile_product(
    a_ptrs,
    b_ptrs,
    a_rows_ok,
    b_cols_ok,
    depth,
    a_step,
    b_step,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """fp32 ``A[BLOCK_M, depth] @ B[depth, BLOCK_N]``, ``BLOCK_K`` at a time: ``a_ptrs`` and
    ``b_ptrs`` address the first step's tiles and advance by ``a_step`` / ``b_step``.
    ``EVEN_K``: ``depth`` is a multiple of ``BLOCK_K``, so the contraction needs no mask
    (the loads keep only the row / column masks)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(depth, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_rows_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=b_cols_ok[None, :], other=0.0)
        else:
            left = depth - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=a_rows_ok[:, None] & (rk[None, :] < left), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < left) & b_cols_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    return acc


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    starts_ptr,  # int32 [G + 1]: group g owns rows [starts[g], starts[g + 1])
    order_ptr,  # int32 [G]: the order groups are visited in
    G,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wg,
    stride_wk,
    stride_wn,
    stride_ym,
    stride_yn,
    PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    base = 0
    for i in range(G):
        g = tl.load(order_ptr + i)
        start = tl.load(starts_ptr + g)
        rows = tl.load(starts_ptr + g + 1) - start
        m_tiles = tl.cdiv(rows, BLOCK_M)
        items = m_tiles * n_tiles
        for t in range(_first_item(base, pid, PROGRAMS), base + items, PROGRAMS):
            tile_m, tile_n = _tile_of(t - base, m_tiles, n_tiles, GROUP_M)
            rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rk = tl.arange(0, BLOCK_K)
            row = (start + rm).to(tl.int64)
            acc = _tile_product(
                x_ptr + row[:, None] * stride_xm + rk[None, :] * stride_xk,
                w_ptr + g.to(tl.int64) * stride_wg + rk[:, None] * stride_wk + rn[None, :] * stride_wn,
                rm < rows, rn < N, K, BLOCK_K * stride_xk, BLOCK_K * stride_wk,
                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, EVEN_K,
            )  # fmt: skip
            y_ptrs = y_ptr + row[:, None] * stride_ym + rn[None, :] * stride_yn
            mask = (rm[:, None] < rows) & (rn[None, :] < N)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        base += items


@triton.jit
def _grouped_mm_wgrad_kernel(
    x_ptr,
    dy_ptr,
    dw_ptr,
    starts_ptr,
    order_ptr,
    G,
    K,
    N,
    stride_xm,
    stride_xk,
    stride_dym,
    stride_dyn,
    stride_dwg,
    stride_dwk,
    stride_dwn,
    PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(K, BLOCK_M)
    n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = m_tiles * n_tiles
    for t in range(pid, G * per_group, PROGRAMS):
        g = tl.load(order_ptr + t // per_group)
        tile_m, tile_n = _tile_of(t % per_group, m_tiles, n_tiles, GROUP_M)
        start = tl.load(starts_ptr + g)
        rows = tl.load(starts_ptr + g + 1) - start
        rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of dW: features of x
        rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        token = start.to(tl.int64) + tl.arange(0, BLOCK_K)  # the group's tokens
        acc = _tile_product(
            x_ptr + token[None, :] * stride_xm + rm[:, None] * stride_xk,
            dy_ptr + token[:, None] * stride_dym + rn[None, :] * stride_dyn,
            rm < K, rn < N, rows, BLOCK_K * stride_xm, BLOCK_K * stride_dym,
            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, False,
        )  # fmt: skip
        dw_ptrs = (
            dw_ptr
            + g.to(tl.int64) * stride_dwg
            + rm[:, None] * stride_dwk
            + rn[None, :] * stride_dwn
        )
        tl.store(
            dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(rm[:, None] < K) & (rn[None, :] < N)
        )


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def _group_tables(
    counts: Sequence[int], order: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + int(c))
    if order == "largest_first":
        visit = sorted(range(len(counts)), key=lambda g: -int(counts[g]))
    else:
        visit = list(range(len(counts)))
    as_tensor = torch.tensor(starts + visit, dtype=torch.int32, device=device)
    return as_tensor[: len(starts)], as_tensor[len(starts) :]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _device_tables(ends: torch.Tensor, rows: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_group_tables` from the device ends (int32 ``[G]``), on the device; once per
    ``ends`` tensor, version, rows and order (a layer's three passes share its ``offs``)."""

    def make(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        G = e.shape[0]
        starts = torch.zeros(G + 1, dtype=torch.int32, device=e.device)
        if G:
            starts[1:] = torch.cummax(e.to(torch.int32).clamp(0, rows), 0).values
        if order == "largest_first":
            visit = torch.argsort(starts[1:] - starts[:-1], descending=True, stable=True).to(torch.int32)
        else:
            visit = torch.arange(G, dtype=torch.int32, device=e.device)
        return starts, visit

    return derived(ends, f"triton-tables:{rows}:{order}", make)


def _launch_mm(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, visit: torch.Tensor,
               cfg: GroupedGemmConfig) -> torch.Tensor:
    T, K = x.shape
    G, _, N = w.shape
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0 or G == 0:
        return y
    programs = _programs(x.device)
    _grouped_mm_kernel[(programs,)](
        x, w, y, starts, visit, G, N, K,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        PROGRAMS=programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PRECISION=_precision(x.dtype), EVEN_K=K % cfg.block_k == 0,
        **launch_options(cfg, gpu_vendor()),
    )  # fmt: skip
    return y


def _launch_wgrad(x: torch.Tensor, dy: torch.Tensor, G: int, starts: torch.Tensor, visit: torch.Tensor,
                  cfg: GroupedGemmConfig) -> torch.Tensor:
    K = x.shape[1]
    N = dy.shape[1]
    dw = torch.empty(G, K, N, dtype=x.dtype, device=x.device)
    if G == 0:
        return dw
    programs = _programs(x.device)
    _grouped_mm_wgrad_kernel[(programs,)](
        x, dy, dw, starts, visit, G, K, N,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        PROGRAMS=programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PRECISION=_precision(x.dtype), **launch_options(cfg, gpu_vendor()),
    )  # fmt: skip
    return dw


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, counts: Sequence[int], cfg: GroupedGemmConfig
) -> torch.Tensor:
    """``y[T, N]``: rows of group g are ``x_g @ w[g]``; ``w`` is ``[G, K, N]`` of any strides."""
    if x.shape[0] == 0:
        return torch.empty(0, w.shape[2], dtype=x.dtype, device=x.device)
    starts, visit = _group_tables(counts, cfg.group_order, x.device)
    return _launch_mm(x, w, starts, visit, cfg)


def grouped_mm_offs(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, cfg: GroupedGemmConfig) -> torch.Tensor:
    """:func:`grouped_mm` with the groups as the device ``ends`` of ``aten::_grouped_mm``
    (``offs``): no host read; rows of ``x`` past the last group give unwritten rows of ``y``."""
    if x.shape[0] == 0:
        return torch.empty(0, w.shape[2], dtype=x.dtype, device=x.device)
    starts, visit = _device_tables(ends, x.shape[0], cfg.group_order)
    return _launch_mm(x, w, starts, visit, cfg)


def grouped_mm_wgrad(
    x: torch.Tensor, dy: torch.Tensor, counts: Sequence[int], cfg: GroupedGemmConfig
) -> torch.Tensor:
    """``dw[G, K, N]`` with ``dw[g] = x_g^T @ dy_g`` (zeros for an empty group)."""
    if not counts:
        return torch.empty(0, x.shape[1], dy.shape[1], dtype=x.dtype, device=x.device)
    starts, visit = _group_tables(counts, cfg.group_order, x.device)
    return _launch_wgrad(x, dy, len(counts), starts, visit, cfg)


def grouped_mm_wgrad_offs(
    x: torch.Tensor, dy: torch.Tensor, ends: torch.Tensor, cfg: GroupedGemmConfig
) -> torch.Tensor:
    """:func:`grouped_mm_wgrad` with the groups as the device ``ends`` (``offs``): no host
    read; each group contracts over its own rows; rows past the last group are no group's."""
    starts, visit = _device_tables(ends, x.shape[0], cfg.group_order)
    return _launch_wgrad(x, dy, ends.shape[0], starts, visit, cfg)
