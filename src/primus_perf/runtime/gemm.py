"""The GEMM kind's dispatch: ``aten::mm``, ``bmm`` and ``addmm`` of any program, eager and compiled.

:class:`GemmDispatch` owns the signature table (a call's shapes, strides, dtypes, devices and
bias dtype -> what it runs, resolved once by the router's pure ``resolve``), the counts and the
failures. Its overrides are the native ones (``native.py``: the table in C++, the dispatch
attached as its owner) where they build, else Python functions calling :meth:`GemmDispatch.gemm`.
Calls the table must not answer run that Python route: an online router's (per call), a
confirmation's, a grouped GEMM's own GEMMs (torch's: ``kernels.grouped.in_grouped``), calls
while the profiler records (the routed call shows as ``primus_perf::gemm``) and tensor
subclasses. A call left to torch goes through the ``out=`` overloads, the same kernels.

Why the dispatcher: it sees every GEMM of a step (``F.linear``, ``matmul``, ``@``, ``einsum``,
autograd's backward formulas, DDP's and FSDP2's local shards), costs nothing for other
operators, and ``torch.compile`` traces through it (fake tensors go to torch's own kernels).
Under Inductor the pass :func:`rewrite_gemms` swaps the graphs' GEMM nodes for
``primus_perf::routed_gemm``, which calls the dispatch at run time.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from primus_perf.kernels.gemm import (
    NATIVE_FALLBACK,
    NATIVE_LAUNCH,
    NATIVE_PYTHON,
    NATIVE_TORCH,
    TORCH_CHOICE,
    TORCH_SOURCE,
    torch_mm,
    traced_gemm_op,
)
from primus_perf.kernels.grouped.passes import in_grouped
from primus_perf.kernels.routing import OWN
from primus_perf.kernels.tracing import autograd_profiler
from primus_perf.kinds import GEMM
from primus_perf.runtime import native
from primus_perf.runtime.dispatch import Dispatch, InductorPass, of, replace_node


class GemmDispatch(Dispatch):
    """The GEMM kind's routing (module docstring)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self._memo: dict[tuple, tuple[str, int | None, Any]] = {}  # signature -> (key, slot, run)
        self._profiler = autograd_profiler()

    def install(self, router: Any) -> None:
        self._add_native_counts(native.attach(None))  # the old router's routes out of the table, counted as its
        super().install(router)

    def changed(self) -> None:
        """The table follows: its routes are dropped, and it answers again only for a router it
        may resolve once per signature (not an online router's, nor while a confirmation runs)."""
        self._memo.clear()
        self._add_native_counts(native.attach(None))
        if self.router is not None and hasattr(self.router, "resolve") and self.interposer is None:
            native.attach(self)

    def _add_native_counts(self, counts: list) -> None:
        """The native table's ``(key, slot, routed, fallback, unaligned)`` counts, taken in
        (``routed`` holds the ``unaligned`` calls: torch ran them)."""
        for key, slot, routed, fallback, unaligned in counts:
            if routed:
                self.routed[key] += routed
            if fallback:
                self.fallback[key] += fallback
            add = getattr(self.router, "add_unaligned", None)
            if unaligned and add is not None:
                add(slot, unaligned)

    def summary(self) -> dict[str, Any]:
        self._add_native_counts(native.take_counts())
        return super().summary()

    def fail(self, key: str, exc: BaseException | str) -> None:
        super().fail(key, exc)
        native.mark_failed(key)
        for sig, (k, _, _) in list(self._memo.items()):
            if k == key:
                self._memo[sig] = (key, None, None)

    def _resolve(self, a: Any, b: Any, bias: Any) -> tuple[str, int | None, Any]:
        sig = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
               None if bias is None else bias.dtype)
        hit = self._memo.get(sig)
        if hit is None:
            hit = self.router.resolve(a, b, bias)
            if hit[0] in self.failed:
                hit = (hit[0], None, None)
            self._memo[sig] = hit
        return hit

    # ---- the Python route --------------------------------------------------------------

    def gemm(self, a: Any, b: Any, bias: Any = None) -> Any:
        """``a @ b`` (``torch.bmm`` for 3-D operands; ``+ bias`` when given): the routed choice,
        else torch's own kernel."""
        router = self.router
        if router is None or in_grouped():  # a grouped GEMM's own GEMMs are torch's
            return torch_mm(a, b, bias)
        if not hasattr(router, "resolve"):  # a router that answers per call (online tuning)
            key, run = router.route(a, b, bias)
            return self.answer(key, run, lambda: torch_mm(a, b, bias))
        key, slot, run = self._resolve(a, b, bias)
        if run is None:
            return self.answer(key, None if slot is None else OWN, lambda: torch_mm(a, b, bias))
        traced = self._profiler._is_profiler_enabled  # tracing.profiler_on, inline

        def routed() -> Any:
            out = traced_gemm_op()(a, b, router.id, slot) if traced else run(a, b)
            return out if out is None or bias is None else out.add_(bias)  # None: the kernel declined

        return self.answer(key, routed, lambda: torch_mm(a, b, bias))

    def addmm(self, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> Any:
        if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[-1]:  # the bias epilogue
            return self.gemm(a, b, bias)
        out = a.new_empty((a.shape[0], b.shape[1]))
        return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)

    # ---- the native table's owner ---------------------------------------------------------

    def native_route(self, a: Any, b: Any, bias: Any = None) -> tuple[str, int, int, Any]:
        """``(key, kind, slot, payload)`` the native table holds for this call's signature
        (kinds ``TORCH_ROUTED``, ``FALLBACK``, ``LAUNCH`` with the kernel's launch record,
        ``PYTHON`` with its ``run``)."""
        key, slot, run = self._resolve(a, b, bias)
        if run is None:
            return key, NATIVE_TORCH if slot == TORCH_CHOICE else NATIVE_FALLBACK, -1, None
        record = self.router.launch_record(slot, a)
        if record is not None:
            return key, NATIVE_LAUNCH, slot, record
        return key, NATIVE_PYTHON, slot, run

    def baseline_solution(self, name: str) -> dict[str, Any]:
        return {"config": {"name": name, "source": TORCH_SOURCE}, "blob": b""}

    def cost_probe(self) -> tuple[Any, Any]:
        return torch.mm, torch_mm

    def native_failed(self, key: str, why: str) -> None:
        """A tuned kernel the native table ran failed (the call runs torch's kernel)."""
        self.fail(key, RuntimeError(why))
        self.fallback[key] += 1

    # ---- overrides -------------------------------------------------------------------------

    def prepare(self, log: Any) -> None:
        native.load(log)  # built on first use (said in the log), before the overrides take it

    def path(self) -> str:
        if native.installed():
            return "routed calls go through the native dispatch (a C++ table of call signatures)"
        return f"routed calls go through Python ({native.why_not()})"

    def overrides(self, lib: torch.library.Library, key: str) -> Any:
        if native.install(key, self.gemm, self.addmm):  # the native dispatch, these as its Python routes
            self.changed()

            def undo() -> None:
                self._add_native_counts(native.uninstall())

            return undo
        lib.impl("mm", self.gemm, key)
        lib.impl("bmm", self.gemm, key)
        lib.impl("addmm", self.addmm, key)
        return None

    def compile_pass(self) -> InductorPass | None:
        define_op()
        return InductorPass.install("post_grad_custom_post_pass", rewrite_gemms, "primus_perf.routed_gemm",
                                    "GEMMs", (__file__,))


@functools.cache
def define_op() -> None:
    """Register ``primus_perf::routed_gemm`` (once): the dispatch's route at run time."""

    @torch.library.custom_op("primus_perf::routed_gemm", mutates_args=())
    def routed_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return of(GEMM.name).gemm(a, b, bias)

    @routed_gemm.register_fake
    def _(a, b, bias):
        return a.new_empty((*a.shape[:-1], b.shape[-1]))


def rewrite_gemms(graph: torch.fx.Graph) -> None:
    """``aten.mm/bmm`` and plain ``aten.addmm`` (1-D bias, alpha = beta = 1) nodes ->
    ``primus_perf::routed_gemm``."""
    aten = torch.ops.aten
    target = torch.ops.primus_perf.routed_gemm.default
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.mm.default, aten.bmm.default):
            args = (*node.args, None)
        elif node.target is aten.addmm.default and not node.kwargs:
            bias, a, b = node.args
            bias_meta = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
            if bias_meta is None or bias_meta.dim() != 1:
                continue
            args = (a, b, bias)
        else:
            continue
        replace_node(graph, node, target, args)
