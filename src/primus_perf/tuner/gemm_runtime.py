"""The trainer-side GEMM router built from cached entries.

Each call ``router(a, b)`` looks its operands' (shape, strides, dtype) up in a small table;
a cached cuBLASLt/hipBLASLt algorithm runs on torch's current stream with one shared
workspace, a "torch" choice or an unknown problem returns None (torch runs it). A tuned
call that fails falls back to torch for that problem and says so once.

While torch.profiler records, a tuned call goes through the operator ``primus_perf::gemm``
(a torch custom op), so the trace shows it like ``aten::mm``: with its operands' shapes
and strides, which the trace analyzer models exactly as it models ``aten::mm``. Outside
the profiler the launch is called directly (no dispatcher overhead).
"""

from __future__ import annotations

import sys
from typing import Any

from primus_perf.cache.store import CacheEntry
from primus_perf.problems import GemmProblem

WORKSPACE_BYTES = 32 * 2**20
TRACED_OP = "primus_perf::gemm"

# launches of tuned GEMMs, indexed by the ``slot`` argument of the traced op
_LAUNCHES: list[Any] = []
_traced_op: Any = None


def _traced_gemm_op() -> Any:
    """``torch.ops.primus_perf.gemm(a, b, slot)``: runs ``_LAUNCHES[slot](a, b)``."""
    global _traced_op
    if _traced_op is None:
        import torch

        @torch.library.custom_op(TRACED_OP, mutates_args=(), schema="(Tensor a, Tensor b, int slot) -> Tensor")
        def gemm(a, b, slot):
            return _LAUNCHES[slot](a, b)

        _traced_op = gemm
    return _traced_op


def _profiler_on() -> bool:
    import torch

    return bool(torch.autograd.profiler._is_profiler_enabled)


class GemmRouter:
    def __init__(self, entries: list[CacheEntry]) -> None:
        self.entries = {e.problem_key: e for e in entries}
        self.fast: dict[tuple, Any] = {}  # operand signature -> (plan, algo) | None
        self.routed: dict[str, int] = {}
        self.default: dict[str, int] = {}
        self.failed: set[str] = set()
        self._plans: dict[str, Any] = {}
        self._ws: dict[int, Any] = {}

    def _resolve(self, a, b) -> tuple[str, Any]:
        from primus_perf.trainer.dispatch import problem_of

        try:
            p = problem_of(a, b)
        except ValueError:
            return "unsupported", None
        key = p.key()
        entry = self.entries.get(key)
        if entry is None or not entry.solution.get("blob") or not a.is_cuda:
            return key, None
        from primus_perf.tuner.blaslt.binding import load

        plan = self._plans.get(key) or load().plan(GemmProblem.from_dict(entry.problem))
        self._plans[key] = plan
        algo = bytes(entry.solution["blob"])
        _LAUNCHES.append(lambda x, y: self._launch(plan, algo, x, y))
        return key, (plan, algo, len(_LAUNCHES) - 1)

    def __call__(self, a, b):
        sig = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device)
        hit = self.fast.get(sig)
        if hit is None:
            hit = self._resolve(a, b)
            self.fast[sig] = hit
        key, choice = hit
        if choice is None or key in self.failed:
            self.default[key] = self.default.get(key, 0) + 1
            return None
        plan, algo, slot = choice
        try:
            out = _traced_gemm_op()(a, b, slot) if _profiler_on() else self._launch(plan, algo, a, b)
        except Exception as exc:
            self.failed.add(key)
            print(f"tuning cache: tuned GEMM {key} failed ({exc}); using torch for it", file=sys.stderr)
            self.default[key] = self.default.get(key, 0) + 1
            return None
        self.routed[key] = self.routed.get(key, 0) + 1
        return out

    def _launch(self, plan, algo, a, b):
        import torch

        dev = a.device.index or 0
        ws = self._ws.get(dev)
        if ws is None:
            ws = self._ws[dev] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=a.device)
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        plan.run(algo, b.data_ptr(), a.data_ptr(), out.data_ptr(), ws.data_ptr(), WORKSPACE_BYTES,
                 torch.cuda.current_stream(a.device).cuda_stream)
        return out

    def summary(self) -> dict[str, Any]:
        return {"routed": dict(self.routed), "default": dict(self.default), "failed": sorted(self.failed)}


def _factory(entries: list[CacheEntry]) -> GemmRouter | None:
    return GemmRouter(entries) if entries else None


def _versions() -> dict[str, str]:
    from primus_perf.tuner.gemm import library_versions

    return library_versions()


def register() -> None:
    from primus_perf.cache.runtime import register_router_factory

    register_router_factory("gemm", _factory, _versions)
