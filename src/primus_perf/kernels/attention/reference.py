"""fp32 reference attention and the numerical check every candidate config must pass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from primus_perf.problems import AttentionProblem

# Max |error| allowed relative to the reference's max |value|, per dtype (output, grads).
TOLERANCE: dict[torch.dtype, float] = {torch.bfloat16: 2.5e-2, torch.float16: 5e-3}


def tolerance(dtype: torch.dtype) -> float:
    """The largest :func:`relative_error` a result in ``dtype`` may have."""
    return TOLERANCE.get(dtype, 1e-3)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, sm_scale: float | None = None
) -> torch.Tensor:
    """Plain fp32 attention in the trainer layout (batch, seq, heads, head_dim)."""
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # b h s d
    group = qf.shape[1] // kf.shape[1]
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
        vf = vf.repeat_interleave(group, dim=1)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        sq, skv = scores.shape[-2:]
        mask = torch.ones(sq, skv, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(1, 2)


@dataclass(frozen=True)
class NumericsReport:
    """Worst relative error of output and each gradient against the fp32 reference."""

    out: float
    dq: float
    dk: float
    dv: float
    tolerance: float

    @property
    def worst(self) -> float:
        return max(self.out, self.dq, self.dk, self.dv)

    @property
    def ok(self) -> bool:
        return math.isfinite(self.worst) and self.worst <= self.tolerance


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max |got - ref| over the reference's max |value| (inf where it is not finite)."""
    denom = ref.abs().max().item()
    value = (got.float() - ref).abs().max().item() / max(denom, 1e-6)
    return value if math.isfinite(value) else float("inf")


def check_numerics(fn, q, k, v, *, causal: bool, seed: int = 0) -> NumericsReport:
    """Run ``fn(q, k, v, causal)`` forward and backward against the fp32 reference, on
    copies of the inputs: also when the caller runs under ``no_grad`` or inference mode (a
    program's evaluation step meeting a new problem while it tunes online)."""
    with torch.inference_mode(False), torch.enable_grad():
        return _check_numerics(fn, q, k, v, causal=causal, seed=seed)


def _check_numerics(fn, q, k, v, *, causal: bool, seed: int) -> NumericsReport:
    gen = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(q.shape, generator=gen, device=q.device, dtype=q.dtype)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qq, kk, vv, causal)
    out.backward(do)
    qr, kr, vr = (t.detach().to(torch.float32, copy=True).requires_grad_(True) for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal=causal)
    ref.backward(do.float())
    return NumericsReport(
        out=relative_error(out.detach(), ref.detach()),
        dq=relative_error(qq.grad, qr.grad),
        dk=relative_error(kk.grad, kr.grad),
        dv=relative_error(vv.grad, vr.grad),
        tolerance=tolerance(q.dtype),
    )


def random_qkv(
    batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_kv: int, head_dim: int,
    dtype: torch.dtype, device: str | torch.device, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random inputs in the trainer layout."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def make(s: int, h: int) -> torch.Tensor:
        return torch.randn((batch, s, h, head_dim), generator=gen, device=device, dtype=dtype)

    return make(seq_q, heads_q), make(seq_kv, heads_kv), make(seq_kv, heads_kv)


def validation_shape(problem: AttentionProblem) -> tuple[int, int, int, int]:
    """(batch, heads_q, heads_kv, seq) of the small problem each config is checked on:
    the same group size, head dim, mask and sequence divisibility, affordable in fp32."""
    group = problem.heads_q // problem.heads_kv
    hkv = min(problem.heads_kv, 2)
    seq = problem.seq_q
    if seq > 512:
        seq = 512 + (seq % 16)  # keep the ragged tail, and the divisibility, of the real one
    return 1, group * hkv, hkv, seq
