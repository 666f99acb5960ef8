"""Online tuning of GEMMs: the calls of the GEMM dispatch ``(a, b, bias)``, raced in the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from primus_perf.cache.store import ONLINE_SUFFIX
from primus_perf.kernels import gemm
from primus_perf.tuner.gemm.plugin import TUNER_VERSION, GemmTuner
from primus_perf.tuner.online import Adapter, Pooled, validated


class GemmOnline(Adapter):
    """GEMM calls ``(a, b, bias)``: the problem with ``kernels.gemm.problem_of``; the pool of
    the GEMM plugin (one input set, for validation); kernels from the router's table. A racing
    call runs both sides of a pair on its operands, one after the other (``shadow``), and the
    program gets the default's product: a problem called once a step (the output layer's)
    locks in half the steps."""

    kind = GemmTuner.kind
    tuner_version = TUNER_VERSION + ONLINE_SUFFIX
    shadow = True  # a pair's two calls on one program call: a GEMM's output is a new tensor

    def __init__(self, kernels: Mapping[str, gemm.KernelFactory] | None = None, limit: int = 8) -> None:
        self.kernels = gemm.KERNELS if kernels is None else kernels
        self.limit = limit
        self._memo: dict[tuple, tuple[str, Any] | None] = {}

    def key(self, a: Any, b: Any, bias: Any = None) -> tuple[str, Any] | None:
        """The problem of a call, memoized per signature; None (torch's kernel, which says what
        is wrong) for operands on different devices or a bias of another device or dtype: a
        library kernel must never be handed a pointer of another device."""
        if a.device != b.device or (bias is not None and (bias.device != a.device or bias.dtype != a.dtype)):
            return None
        sig = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, bias is not None)
        if sig not in self._memo:
            try:
                p = gemm.problem_of(a, b)
            except ValueError:
                self._memo[sig] = None
            else:
                p = dataclasses.replace(p, epilogue="bias") if bias is not None else p
                self._memo[sig] = (p.key(), p)
        return self._memo[sig]

    def pool(self, problem: Any, a: Any, b: Any, bias: Any = None) -> list[Pooled]:
        plain = dataclasses.replace(problem, epilogue="none")
        found = validated(GemmTuner(device=a.device.type, sets=1), plain, self.limit)
        out = []
        for c in found:  # the program's calls run the router's kernels of the same solutions
            source = gemm.solution_source(c.solution)
            factory = gemm.torch_kernel if source == gemm.TORCH_SOURCE else self.kernels.get(source)
            kernel = factory(plain, c.solution, a.device) if factory is not None else None
            if kernel is not None:
                out.append(Pooled(c.name, c.solution, c.error, kernel))
        return out

    def cached(self, solution: Mapping[str, Any], problem: Any, a: Any, b: Any, bias: Any = None) -> list[Pooled]:
        """torch's kernel and a cached choice (validated when it was tuned), to race in the step."""
        plain = dataclasses.replace(problem, epilogue="none")
        source = gemm.solution_source(solution)
        factory = self.kernels.get(source)
        if factory is None:
            raise ValueError(f"no kernel of source {source!r} here")
        torch_solution = {"config": {"name": "torch", "source": gemm.TORCH_SOURCE}, "blob": b""}
        return [Pooled("torch", torch_solution, 0.0, gemm.torch_kernel(plain, torch_solution, a.device)),
                Pooled(str(solution["config"].get("name") or source), dict(solution), 0.0,
                       factory(plain, solution, a.device))]

    def run(self, cand: Pooled, a: Any, b: Any, bias: Any = None) -> Any:
        if bias is not None and cand.solution["config"].get("source") == gemm.TORCH_SOURCE:
            return gemm.torch_mm(a, b, bias)  # torch's own addmm, as the program would run it
        out = cand.run(a, b)
        return out if bias is None else out.add_(bias)


def adapter(router: Any) -> GemmOnline:
    """The adapter of an installed GEMM router (its kernel table)."""
    return GemmOnline(getattr(router, "kernels", None))
