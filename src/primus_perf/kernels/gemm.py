"""The GEMM router: operands -> problem -> the cached cuBLASLt/hipBLASLt algorithm.

Each call ``router(a, b)`` looks its operands' (shape, strides, dtype) up in a small table;
a cached algorithm runs on torch's current stream with one shared workspace per device, a
"torch" choice or an unknown problem returns None (torch runs it). A tuned call that
fails falls back to torch for that problem and says so once (``routing.Router``).

While torch.profiler records, a tuned call goes through the operator ``primus_perf::gemm``
(a torch custom op), so the trace shows it like ``aten::mm``: with its operands' shapes
and strides, which the trace analyzer models exactly as it models ``aten::mm``. Outside
the profiler the launch is called directly (no dispatcher overhead). The op's arguments
name the router (a small id; the registry holds routers weakly, so it holds only live
ones) and the slot of the algorithm in that router's own table.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from primus_perf.kernels.blaslt.binding import BlasLt, load
from primus_perf.kernels.routing import CachedChoice, Router
from primus_perf.problems import GemmProblem, dtype_name, operand_layout

WORKSPACE_BYTES = 32 * 2**20
TRACED_OP = "primus_perf::gemm"
TORCH_CHOICE = -1  # slot of a problem whose cached choice is torch's own

_live_routers: weakref.WeakValueDictionary[int, GemmRouter] = weakref.WeakValueDictionary()
_router_ids = itertools.count()
_traced_op: Any = None


def library_versions(lt: BlasLt | None = None) -> dict[str, str]:
    """The BLAS-Lt library identity a GEMM cache entry must match: ``{"cublasLt": "13.1.0"}``
    (of ``lt``, or of the library :func:`~primus_perf.kernels.blaslt.binding.load` finds)."""
    lt = lt or load()
    return {lt.library_name(): lt.version()}


def problem_of(a: Any, b: Any) -> GemmProblem:
    """The GemmProblem of ``a @ b`` for 2-D operands whose rows or columns are contiguous
    (``problems.operand_layout``); ValueError for any other operands."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"problem_of needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    la = operand_layout(*a.shape, *a.stride())
    lb = operand_layout(*b.shape, *b.stride())
    if la is None or lb is None:
        raise ValueError(f"operand strides {a.stride()} / {b.stride()} have no BLAS layout")
    if a.dtype != b.dtype:
        raise ValueError(f"operand dtypes differ: {a.dtype} and {b.dtype}")
    return GemmProblem.from_operands(la, lb, dtype_name(a.dtype))


def traced_gemm_op() -> Any:
    """``torch.ops.primus_perf.gemm(a, b, router, slot)``: slot ``slot`` of live router ``router``."""
    global _traced_op
    if _traced_op is None:
        import torch

        @torch.library.custom_op(TRACED_OP, mutates_args=(), schema="(Tensor a, Tensor b, int router, int slot) -> Tensor")
        def gemm(a, b, router, slot):
            return _live_routers[router].launch(slot, a, b)

        @gemm.register_fake
        def _(a, b, router, slot):
            return a.new_empty((a.shape[0], b.shape[1]))

        _traced_op = gemm
    return _traced_op


def _profiler_on() -> bool:
    import torch

    return bool(torch.autograd.profiler._is_profiler_enabled)


class GemmRouter(Router):
    """Callable ``(a, b) -> Tensor | None`` over the cached GEMM entries of this device."""

    def __init__(self, entries: list[CachedChoice]) -> None:
        super().__init__()
        self.entries = {e.problem_key: e for e in entries}
        self.id = next(_router_ids)
        _live_routers[self.id] = self
        # operand signature -> (key, slot in _slots | TORCH_CHOICE | None: no usable entry)
        self._memo: dict[tuple, tuple[str, int | None]] = {}
        self._slots: list[tuple[Any, bytes]] = []  # (plan, algo) of each routed problem
        self._ws: dict[int, Any] = {}

    @classmethod
    def from_entries(cls, entries: list[CachedChoice]) -> GemmRouter | None:
        return cls(entries) if entries else None

    def _resolve(self, a, b) -> tuple[str, int | None]:
        try:
            p = problem_of(a, b)
        except ValueError:
            return "unsupported", None
        key = p.key()
        entry = self.entries.get(key)
        if entry is not None and not entry.solution.get("blob"):
            return key, TORCH_CHOICE
        if entry is None or not a.is_cuda:
            return key, None
        self._slots.append((load().plan(GemmProblem.from_dict(entry.problem)), bytes(entry.solution["blob"])))
        return key, len(self._slots) - 1

    def __call__(self, a, b):
        sig = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device)
        hit = self._memo.get(sig)
        if hit is None:
            hit = self._memo[sig] = self._resolve(a, b)
        key, slot = hit
        if slot == TORCH_CHOICE:
            self.routed[key] += 1
            return None
        if slot is None:
            self._fall_back(key)
            return None
        if _profiler_on():
            return self._run(key, lambda: traced_gemm_op()(a, b, self.id, slot))
        return self._run(key, lambda: self.launch(slot, a, b))

    def launch(self, slot: int, a, b):
        """``a @ b`` with the algorithm of ``slot`` (no checks: the slot was resolved for them)."""
        import torch

        plan, algo = self._slots[slot]
        dev = a.device.index or 0
        ws = self._ws.get(dev)
        if ws is None:
            ws = self._ws[dev] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=a.device)
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        plan.run(algo, b.data_ptr(), a.data_ptr(), out.data_ptr(), ws.data_ptr(), WORKSPACE_BYTES,
                 torch.cuda.current_stream(a.device).cuda_stream)
        return out

    def close(self) -> None:
        """Destroy the plans; the router routes nothing after."""
        for plan, _ in self._slots:
            plan.close()
        self._slots.clear()
        self._memo.clear()
        self.entries.clear()
        _live_routers.pop(self.id, None)
