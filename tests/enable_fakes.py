"""Fakes shared by the enable and online tests: a kernel table whose one row ("fakeblas")
computes the product in float64 and counts its calls, a kind table that uses it (so GEMM
routing runs on the CPU), an attention router whose every cached choice runs the fp32
reference as a kernel counting its forward and backward launches, one whose choices lose only
in their backward (``slow_backward_kinds``), a device clock that
advances only when a fake kernel runs, and the model these tests run (plain nn.Linear and
F.scaled_dot_product_attention, not the trainer's)."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from primus_perf.base.devices import DeviceIdentity
from primus_perf.cache.store import CacheEntry
from primus_perf.kernels.attention.reference import reference_attention
from primus_perf.kernels.attention.router import (
    AttentionChoice,
    AttentionRouter,
    library_versions,
    problem_of,
)
from primus_perf.kernels.gemm import GemmRouter, torch_mm
from primus_perf.kinds import ATTENTION, RouterPart
from primus_perf.problems import AttentionProblem, GemmProblem
from primus_perf.runtime.attention import torch_attention

FAKE_SOURCE = "fakeblas"
FAKE_VERSIONS = {"fakeblas": "1.0"}
H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132)
SLOW_REPEAT = 16  # the extra work of a slow fake choice
launched: Counter[str] = Counter()  # problem key -> calls of the fake kernel
attention_launched: Counter[tuple[str, str]] = Counter()  # (problem key, "forward"/"backward") -> launches


class FakeKernel:
    def __init__(self, problem: GemmProblem) -> None:
        self.key = problem.key()

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        launched[self.key] += 1
        return torch_mm(a.double(), b.double()).to(a.dtype)  # past the overrides, as a library kernel

    def close(self) -> None:
        pass


def fake_factory(problem, solution, device):
    return FakeKernel(problem)


FAKE_TABLE = {FAKE_SOURCE: fake_factory}
FAKE_KINDS = {
    "gemm": RouterPart(lambda es: GemmRouter.from_entries(list(es), FAKE_TABLE), lambda: dict(FAKE_VERSIONS)),
    "attention": ATTENTION.part("router"),
}


def gemm_entry(problem: GemmProblem, device: DeviceIdentity, source: str = FAKE_SOURCE,
               versions: dict | None = None) -> CacheEntry:
    return CacheEntry(kind="gemm", problem_key=problem.key(), problem=problem.to_dict(), device=device.to_dict(),
                      versions=dict(FAKE_VERSIONS if versions is None else versions),
                      solution={"config": {"name": "fake", "source": source}, "blob": b""},
                      times={"tuned_ms": 1.0, "default_ms": 1.1}, tuner_version="test")


def attention_entry(problem: AttentionProblem, device: DeviceIdentity, versions: dict | None = None,
                    choice: AttentionChoice = AttentionChoice("sdpa:math")) -> CacheEntry:
    return CacheEntry(kind="attention", problem_key=problem.key(), problem=problem.to_dict(), device=device.to_dict(),
                      versions=library_versions() if versions is None else versions,
                      solution={"config": choice.to_solution(), "blob": b""})


class CountedAttention(torch.autograd.Function):
    """The fp32 reference attention as a tuned kernel: its forward and its backward count
    their launches in ``attention_launched``."""

    @staticmethod
    def forward(ctx, q, k, v, causal, key):  # type: ignore[override]
        attention_launched[key, "forward"] += 1
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.key = causal, key
        return reference_attention(q, k, v, causal=causal).to(q.dtype)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        attention_launched[ctx.key, "backward"] += 1
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = reference_attention(*leaves, causal=ctx.causal)
        return (*torch.autograd.grad(out, leaves, do.to(out.dtype)), None, None)


class CountingAttentionRouter(AttentionRouter):
    """The attention router, every cached choice running :class:`CountedAttention`."""

    def implementation(self, choice):
        return lambda q, k, v, causal: CountedAttention.apply(q, k, v, causal, problem_of(q, k, v, causal).key())


COUNTED_KINDS = {
    **FAKE_KINDS,
    "attention": RouterPart(lambda es: CountingAttentionRouter.from_entries(list(es)), library_versions),
}


class FakeClock:
    """Time advances only when a fake candidate runs; a mark completes ``lag`` marks later
    (events read later, never waited for)."""

    def __init__(self, lag: int = 2) -> None:
        self.now = 0.0
        self.count = 0
        self.lag = lag

    def mark(self) -> tuple[int, float]:
        self.count += 1
        return (self.count, self.now)

    def elapsed(self, start, end) -> float | None:
        if self.count - end[0] < self.lag:
            return None
        return end[1] - start[1]


class StepClock:
    """Every mark one microsecond after the last: each timed call takes the same time."""

    def __init__(self) -> None:
        self.t = 0

    def mark(self) -> int:
        self.t += 1
        return self.t

    def elapsed(self, start: int, end: int) -> float:
        return (end - start) * 1e-6


class Block(nn.Module):
    """Grouped-query attention and an MLP with plain nn.Linear and F.scaled_dot_product_attention."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, dim + 2 * kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split([d, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.silu(self.up(x)))


BLOCK_ATTENTION = AttentionProblem(2, 4, 2, 8, 8, 8, "f32", True, "bshd")  # Block's on a (2, 8, 32) input


def run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step's forward and backward: the output and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()]


class SlowBackwardAttention(torch.autograd.Function):
    """torch's attention whose backward does the work ``SLOW_REPEAT`` times: a choice that loses only
    in its backward (confirming its forward alone would keep it)."""

    @staticmethod
    def forward(ctx, q, k, v, causal):  # type: ignore[override]
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return torch_attention(q, k, v, causal)

    @staticmethod
    def backward(ctx, do):  # type: ignore[override]
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        for _ in range(SLOW_REPEAT):
            with torch.enable_grad():
                grads = torch.autograd.grad(torch_attention(*leaves, ctx.causal), leaves, do)
        return (*grads, None)


def slow_backward_kinds():
    """Router kinds whose attention choices all run :class:`SlowBackwardAttention`."""

    class SlowBackwardRouter(AttentionRouter):
        def implementation(self, choice):
            return lambda q, k, v, causal: SlowBackwardAttention.apply(q, k, v, causal)

    return {"attention": RouterPart(lambda es: SlowBackwardRouter.from_entries(list(es)), library_versions)}
