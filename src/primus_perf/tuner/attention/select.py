"""Backend selection: time every candidate forward and backward, interleaved, and pick
the fastest sum. Candidates are ``fn(q, k, v, causal)`` in the trainer layout; the ones
that cannot run the problem (an SDPA backend that rejects it) are reported, not timed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from primus_perf.problems import AttentionProblem, torch_dtype
from primus_perf.tuner.attention.backends import AttentionFn
from primus_perf.tuner.attention.reference import random_qkv
from primus_perf.tuner.attention.timing import median, spread, time_calls


@dataclass
class BackendTiming:
    backend: str
    fwd_ms: float = math.inf
    bwd_ms: float = math.inf
    fwd_samples: list[float] = field(default_factory=list, repr=False)
    bwd_samples: list[float] = field(default_factory=list, repr=False)
    status: str = "ok"  # "ok" or "unavailable"
    reason: str = ""

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms

    def to_dict(self, problem: AttentionProblem) -> dict:
        fl, fh = spread(self.fwd_samples)
        bl, bh = spread(self.bwd_samples)
        return {
            "backend": self.backend,
            "status": self.status,
            "reason": self.reason,
            "fwd_ms": self.fwd_ms,
            "bwd_ms": self.bwd_ms,
            "fwd_ms_min_max": [fl, fh],
            "bwd_ms_min_max": [bl, bh],
            "fwd_tflops": tflops(problem.forward_flops, self.fwd_ms),
            "bwd_tflops": tflops(problem.backward_flops, self.bwd_ms),
        }


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) else 0.0


def time_backends(
    problem: AttentionProblem,
    candidates: dict[str, AttentionFn],
    *,
    rounds: int = 5,
    reps: int = 10,
    device: str = "cuda",
    seed: int = 1234,
) -> dict[str, BackendTiming]:
    """Median forward and backward times per candidate, over ``rounds`` interleaved rounds
    of ``reps`` calls each (the backward is timed as ``autograd.grad`` of one graph)."""
    p = problem
    dtype = torch_dtype(p.dtype)
    q, k, v = random_qkv(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, p.head_dim, dtype, device, seed)
    do = torch.randn_like(q)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    results: dict[str, BackendTiming] = {}
    runners = {}
    for name, fn in candidates.items():
        try:
            with torch.no_grad():
                fn(q, k, v, p.causal)
            out = fn(qg, kg, vg, p.causal)
            torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)
        except Exception as exc:  # the backend cannot run this problem
            text = str(exc).strip().splitlines()
            results[name] = BackendTiming(name, status="unavailable", reason=(text[0] if text else type(exc).__name__)[:200])
            continue

        def fwd(fn=fn):
            with torch.no_grad():
                fn(q, k, v, p.causal)

        def bwd(out=out):
            torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

        runners[name] = (fwd, bwd)
        results[name] = BackendTiming(name)
    names = list(runners)
    for r in range(rounds):
        # rotate the order each round so no candidate always runs first or last
        for name in names[r % len(names) :] + names[: r % len(names)] if names else []:
            fwd, bwd = runners[name]
            results[name].fwd_samples += time_calls(fwd, reps, warmup=1)
            results[name].bwd_samples += time_calls(bwd, reps, warmup=1)
    for name in runners:
        r = results[name]
        r.fwd_ms, r.bwd_ms = median(r.fwd_samples), median(r.bwd_samples)
    return results


def fastest(timings: dict[str, BackendTiming], exclude: tuple[str, ...] = ()) -> str | None:
    """The candidate with the smallest forward + backward median."""
    ok = [t for t in timings.values() if t.status == "ok" and t.backend not in exclude]
    return min(ok, key=lambda t: t.total_ms).backend if ok else None
