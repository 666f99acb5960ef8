# ruff: noqa: SIM108, E741  (Triton kernels: constexpr branches, BLAS-style names)
"""Triton flash attention (FlashAttention-2 scheme), forward and backward.

Tensors are in the trainer's layout ``(batch, seq, heads, head_dim)`` with a contiguous
last dimension; any other strides are passed through. Grouped-query attention maps query
head ``h`` to key/value head ``h // (heads_q // heads_kv)``.

- forward: one program per (BLOCK_M query rows, batch x head); online softmax over key
  blocks; stores O and the row log-sum-exp (base 2, of the scaled scores) for backward.
  Key blocks that need no mask (fully visible, inside the sequence) run a loop without
  any masking; the diagonal (causal) and ragged tail blocks run a masked loop.
- backward: ``delta = rowsum(dO * O)``; dK/dV: one program per (BLOCK_N1 keys, batch x kv
  head) that walks the query blocks of every query head of its group (no atomics);
  dQ: one program per (BLOCK_M2 query rows, batch x head) that walks the key blocks.

Causal masking is top-left aligned (key j visible to query i iff j <= i), as torch's
``is_causal``; causal problems need ``seq_q == seq_kv``.

Tile sizes, warps and stages are arguments (``FwdConfig``, ``BwdConfig``); on ROCm the
vendor's own options (``kernels.triton_launch``) are passed through as launch options.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from primus_perf.base.devices import gpu_vendor
from primus_perf.kernels.attention.configs import (
    BwdConfig,
    FwdConfig,
    check_head_dim,
)
from primus_perf.kernels.triton_launch import launch_options


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs,
    offs_m, offs_d, lo, hi, qk_scale, SEQ_KV,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n0
        k_ptrs = k_base + cols[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_base + cols[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            kt = tl.load(k_ptrs, mask=cols[None, :] < SEQ_KV, other=0.0)
        else:
            kt = tl.load(k_ptrs)
        qk = tl.dot(q, kt) * qk_scale
        if MASKED:
            ok = cols[None, :] < SEQ_KV
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(ok, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < SEQ_KV, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    H, GROUP, SEQ_Q, SEQ_KV,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    row_ok = offs_m < SEQ_Q
    q = tl.load(q_base + offs_m[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if CAUSAL:
        full_hi = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((start_m + 1) * BLOCK_M, SEQ_KV)
    else:
        full_hi = SEQ_KV // BLOCK_N * BLOCK_N
        hi = SEQ_KV
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
        0, full_hi, qk_scale, SEQ_KV, BLOCK_N, False, CAUSAL,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
        full_hi, hi, qk_scale, SEQ_KV, BLOCK_N, True, CAUSAL,
    )
    acc = acc / l_i[:, None]
    tl.store(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)
    o_base = O + b * stride_ob + h * stride_oh
    o_ptrs = o_base + offs_m[:, None] * stride_os + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _bwd_preprocess(
    O, DO, Delta,
    stride_ob, stride_os, stride_oh,
    stride_db, stride_ds, stride_dh,
    H, SEQ_Q,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < SEQ_Q
    o = tl.load(
        O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
        mask=ok[:, None], other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
        mask=ok[:, None], other=0.0,
    ).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * SEQ_Q + offs_m, tl.sum(o * do, 1), mask=ok)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos,
    offs_n, offs_d, lo, hi, qk_scale, SEQ_Q,
    BLOCK_M1: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    offs_m0 = tl.arange(0, BLOCK_M1)
    for start_m in range(lo, hi, BLOCK_M1):
        offs_m = start_m + offs_m0
        q_ptrs = q_base + offs_m[:, None] * stride_qs + offs_d[None, :]
        do_ptrs = do_base + offs_m[:, None] * stride_dos + offs_d[None, :]
        if MASKED:
            row_ok = offs_m < SEQ_Q
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            lse = tl.load(lse_base + offs_m)
        qkT = tl.dot(k, tl.trans(q))
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])
        if MASKED:
            ok = row_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(ok, pT, 0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        else:
            do = tl.load(do_ptrs)
            delta = tl.load(delta_base + offs_m)
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, Delta, DK, DV, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    H, GROUP, SEQ_Q, SEQ_KV,
    HEAD_DIM: tl.constexpr, BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, CAUSAL: tl.constexpr,
):
    start_n = tl.program_id(0)
    bhk = tl.program_id(1)
    H_KV = H // GROUP
    b = (bhk // H_KV).to(tl.int64)
    hk = bhk % H_KV
    offs_n = start_n * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < SEQ_KV
    k = tl.load(
        K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
        mask=col_ok[:, None], other=0.0,
    )
    v = tl.load(
        V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
        mask=col_ok[:, None], other=0.0,
    )
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    full_end = SEQ_Q // BLOCK_M1 * BLOCK_M1
    if CAUSAL:
        lo = (start_n * BLOCK_N1) // BLOCK_M1 * BLOCK_M1
        mid = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N1, BLOCK_M1) * BLOCK_M1, full_end)
        mid = tl.maximum(mid, lo)
    else:
        lo = 0
        mid = 0
    tail = tl.maximum(mid, full_end)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_db + h * stride_dh
        lse_base = LSE + bh * SEQ_Q
        delta_base = Delta + bh * SEQ_Q
        if CAUSAL:
            dk, dv = _dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds,
                offs_n, offs_d, lo, mid, qk_scale, SEQ_Q, BLOCK_M1, True, CAUSAL,
            )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds,
            offs_n, offs_d, mid, full_end, qk_scale, SEQ_Q, BLOCK_M1, False, CAUSAL,
        )
        dk, dv = _dkdv_inner(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_ds,
            offs_n, offs_d, tail, SEQ_Q, qk_scale, SEQ_Q, BLOCK_M1, True, CAUSAL,
        )
    dk = dk * sm_scale
    tl.store(
        DK + b * stride_dkb + hk * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
        dk.to(DK.dtype.element_ty), mask=col_ok[:, None],
    )
    tl.store(
        DV + b * stride_dvb + hk * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
        dv.to(DV.dtype.element_ty), mask=col_ok[:, None],
    )


@triton.jit
def _dq_inner(
    dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs,
    offs_m, offs_d, lo, hi, qk_scale, SEQ_KV,
    BLOCK_N2: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N2)
    for start_n in range(lo, hi, BLOCK_N2):
        cols = start_n + offs_n0
        k_ptrs = k_base + cols[:, None] * stride_ks + offs_d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            col_ok = cols < SEQ_KV
            k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            ok = col_ok[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None])
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, Delta, DQ, sm_scale,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_db, stride_ds, stride_dh,
    stride_dqb, stride_dqs, stride_dqh,
    H, GROUP, SEQ_Q, SEQ_KV,
    HEAD_DIM: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    hk = h // GROUP
    offs_m = start_m * BLOCK_M2 + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < SEQ_Q
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )
    do = tl.load(
        DO + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
        mask=row_ok[:, None], other=0.0,
    )
    lse = tl.load(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + bh.to(tl.int64) * SEQ_Q + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M2, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    if CAUSAL:
        full_hi = (start_m * BLOCK_M2) // BLOCK_N2 * BLOCK_N2
        hi = tl.minimum((start_m + 1) * BLOCK_M2, SEQ_KV)
    else:
        full_hi = SEQ_KV // BLOCK_N2 * BLOCK_N2
        hi = SEQ_KV
    dq = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
        0, full_hi, qk_scale, SEQ_KV, BLOCK_N2, False, CAUSAL,
    )
    dq = _dq_inner(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, offs_m, offs_d,
        full_hi, hi, qk_scale, SEQ_KV, BLOCK_N2, True, CAUSAL,
    )
    dq = dq * sm_scale
    tl.store(
        DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), mask=row_ok[:, None],
    )


# ---- launchers -------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[int, ...]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-d (batch, seq, heads, head_dim)")
    b, sq, hq, d = q.shape
    bk, skv, hkv, dk = k.shape
    if tuple(v.shape) != tuple(k.shape) or bk != b or dk != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"Triton attention takes bf16 or fp16 tensors, got {q.dtype}")
    if causal and sq != skv:
        raise ValueError("causal Triton attention needs seq_q == seq_kv")
    check_head_dim(d)
    return b, sq, hq, skv, hkv, d


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    cfg: FwdConfig,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)`` for q/k/v in (batch, seq, heads, head_dim)."""
    b, sq, hq, skv, hkv, d = _check(q, k, v, causal)
    q, k, v = (_last_contiguous(t) for t in (q, k, v))
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    o = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(sq, cfg.block_m), b * hq)
    _attn_fwd[grid](
        q, k, v, o, lse, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        hq, hq // hkv, sq, skv,
        HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=causal,
        **launch_options(cfg, gpu_vendor()),
    )
    return o, lse


def flash_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    cfg: BwdConfig,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: ``(dq, dk, dv)`` from the forward's output and log-sum-exp."""
    b, sq, hq, skv, hkv, d = _check(q, k, v, causal)
    q, k, v, o, do = (_last_contiguous(t) for t in (q, k, v, o, do))
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    group = hq // hkv
    delta = torch.empty_like(lse)
    pre_m = 64
    _bwd_preprocess[(triton.cdiv(sq, pre_m), b * hq)](
        o, do, delta,
        o.stride(0), o.stride(1), o.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        hq, sq, HEAD_DIM=d, BLOCK_M=pre_m,
    )
    dq = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, skv, hkv, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, skv, hkv, d), dtype=v.dtype, device=v.device)
    opts = launch_options(cfg, gpu_vendor())
    _attn_bwd_dkdv[(triton.cdiv(skv, cfg.block_n1), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2),
        hq, group, sq, skv,
        HEAD_DIM=d, BLOCK_M1=cfg.block_m1, BLOCK_N1=cfg.block_n1, CAUSAL=causal,
        **opts,
    )
    _attn_bwd_dq[(triton.cdiv(sq, cfg.block_m2), b * hq)](
        q, k, v, do, lse, delta, dq, scale,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        hq, group, sq, skv,
        HEAD_DIM=d, BLOCK_M2=cfg.block_m2, BLOCK_N2=cfg.block_n2, CAUSAL=causal,
        **opts,
    )
    return dq, dk, dv
