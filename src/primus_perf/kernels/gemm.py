"""The GEMM router: operands -> problem -> the cached kernel (:class:`GemmRouter`).

The kernel table (:data:`KERNELS`) is data: a solution's ``source`` (what the tuner wrote
into the entry's config: "cublaslt", "hipblaslt") -> a factory that makes the kernel of
one problem from the entry's solution, or None when it cannot run on the operands' device.
The cuBLASLt/hipBLASLt kernel runs the stored algorithm on torch's current stream with one
shared workspace per device. Entries whose source has no row are counted as unusable.

While torch.profiler records, a routed call goes through the operator ``primus_perf::gemm``
(:func:`traced_gemm_op`), so the trace shows it like ``aten::mm``, with its operands' shapes
and strides. Its arguments name the router (a small id; the registry holds routers weakly)
and the slot of the kernel in that router's table.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from primus_perf.kernels.blaslt.binding import BlasLt, Plan, load
from primus_perf.kernels.blaslt.layout import refusal
from primus_perf.kernels.routing import OWN, UNSUPPORTED, CachedChoice
from primus_perf.problems import GemmProblem, dtype_name, operand_layout

WORKSPACE_BYTES = 32 * 2**20
TRACED_OP = "primus_perf::gemm"
TORCH_CHOICE = -1  # slot of a problem whose cached choice is torch's own
TORCH_SOURCE = "torch"

_live_routers: weakref.WeakValueDictionary[int, GemmRouter] = weakref.WeakValueDictionary()
_router_ids = itertools.count()
_traced_op: Any = None
_workspaces: dict[Any, Any] = {}  # device -> the BLAS-Lt workspace shared by every kernel on it


class GemmKernel(Protocol):
    """One problem's kernel: ``kernel(a, b)`` is ``a @ b`` (``close()`` releases it). A kernel
    may also have ``for_call(a, b)``: the callable the router then uses for every call of
    that call's signature (what it can settle once per signature, settled)."""

    def __call__(self, a: Any, b: Any) -> Any: ...

    def close(self) -> None: ...


# solution source -> factory(problem, solution, device) -> kernel, or None when it cannot run there
KernelFactory = Callable[[GemmProblem, Mapping[str, Any], Any], "GemmKernel | None"]


def library_versions(lt: BlasLt | None = None) -> dict[str, str]:
    """The BLAS-Lt library identity a GEMM cache entry must match: ``{"cublasLt": "13.1.0"}``
    (of ``lt``, or of the library :func:`~primus_perf.kernels.blaslt.binding.load` finds)."""
    lt = lt or load()
    return {lt.library_name(): lt.version()}


def _layout(t: Any) -> Any:
    la = operand_layout(t.shape[-2], t.shape[-1], t.stride(-2), t.stride(-1))
    if la is None:
        raise ValueError(f"operand strides {t.stride()} have no BLAS layout")
    return la


def problem_of(a: Any, b: Any) -> GemmProblem:
    """The GemmProblem of ``a @ b`` for 2-D operands, or of ``torch.bmm(a, b)`` for 3-D ones,
    whose rows or columns are contiguous (``problems.operand_layout``) and whose layout a
    BLAS-Lt kernel may be given (``blaslt.layout.refusal``: e.g. no expanded, overlapping or
    interleaved batch); ValueError for any other operands (torch runs them). The output is
    the packed tensor a routed call allocates. Pointer alignment is the kernel's check, per
    call (views at an offset into a storage share a problem with aligned ones)."""
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(f"problem_of needs 2-D or 3-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"operand dtypes differ: {a.dtype} and {b.dtype}")
    p = GemmProblem.from_operands(_layout(a), _layout(b), dtype_name(a.dtype))
    if a.dim() == 3:
        batch = a.shape[0]
        if batch != b.shape[0]:
            raise ValueError(f"batched operands {tuple(a.shape)} and {tuple(b.shape)} do not pair up")
        if batch > 1 and min(a.stride(0), b.stride(0)) <= 0:  # GemmProblem reads a 0 stride as "packed"
            raise ValueError(f"batch strides {a.stride(0)} and {b.stride(0)}: an expanded batch has no BLAS-Lt layout")
        if batch > 1:  # BLAS A is torch's b (docstring of problems/gemm.py)
            p = dataclasses.replace(p, batch=batch, stride_a=b.stride(0), stride_b=a.stride(0),
                                    stride_c=p.ldc * p.n, stride_d=p.ldd * p.n)
    why = refusal(p)
    if why is not None:
        raise ValueError(f"no BLAS-Lt layout for {tuple(a.shape)}{tuple(a.stride())} @ "
                         f"{tuple(b.shape)}{tuple(b.stride())}: {why}")
    return p


def _workspace(device: Any) -> int:
    """The pointer of the BLAS-Lt workspace of ``device`` (made on first use)."""
    import torch

    ws = _workspaces.get(device)
    if ws is None:
        ws = _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws.data_ptr()


class BlasLtKernel:
    """A stored cuBLASLt/hipBLASLt algorithm for one problem, on torch's current stream.

    The algorithm was chosen for pointers aligned to the vendor table's
    ``pointer_alignment`` (``blaslt.layout``); a call whose operand pointers are less aligned
    (a view at an offset into its storage) runs torch's GEMM instead, counted in
    ``unaligned``. Everything but the pointers and the stream is built once: the library
    call's arguments (``Plan.launcher``) per kernel, the device's workspace and the output's
    shape per call signature (:meth:`for_call`)."""

    def __init__(self, plan: Plan, algo: bytes) -> None:
        self.plan = plan
        self.algo = algo
        self.unaligned = 0
        self._launch = plan.launcher(algo, WORKSPACE_BYTES)
        self._runs: dict[tuple[int, int], Callable[[Any, Any], Any]] = {}  # (device index, rank) -> run

    def for_call(self, a: Any, b: Any) -> Callable[[Any, Any], Any]:
        """``run(a, b)`` for every call with the device and rank of these operands (the
        router resolves one per call signature)."""
        where = (a.get_device(), a.dim())
        run = self._runs.get(where)
        if run is None:
            run = self._runs[where] = self._run_on(a.device, *where)
        return run

    def _run_on(self, device: Any, index: int, rank: int) -> Callable[[Any, Any], Any]:
        import torch

        p = self.plan.problem  # the output's shape, by operand rank (torch's [M, N] is BLAS D^T)
        shape = (p.n, p.m) if rank == 2 else (p.batch, p.n, p.m)
        misaligned = self.plan.lt.t.pointer_alignment - 1  # a pointer with any of these bits set
        launch, ws = self._launch, _workspace(device)
        stream = torch._C._cuda_getCurrentRawStream  # (device index) -> the raw stream
        kernel = self

        def run(a: Any, b: Any) -> Any:
            a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
            if (a_ptr | b_ptr) & misaligned:  # a pointer less aligned than the plan's
                kernel.unaligned += 1
                return torch_mm(a, b)
            out = a.new_empty(shape)
            launch(b_ptr, a_ptr, out.data_ptr(), ws, stream(index))  # BLAS A is torch's b
            return out

        return run

    def __call__(self, a: Any, b: Any) -> Any:
        return self.for_call(a, b)(a, b)

    def native(self, a: Any) -> tuple:
        """The native GEMM dispatch's launch record for calls with the device and rank of
        ``a`` (``runtime/native_gemm.cpp`` reads it in this order): the library's ``Matmul``
        arguments (:class:`~primus_perf.kernels.blaslt.binding.LaunchArgs`), the device's
        workspace and its size, the alignment mask a pointer must clear, the output's shape."""
        args = self._launch.args
        p = self.plan.problem
        shape = (p.n, p.m) if a.dim() == 2 else (p.batch, p.n, p.m)
        return (args.fn, args.handle, args.desc, args.alpha, args.beta, *args.layouts, args.algo,
                _workspace(a.device), args.workspace, args.success, self.plan.lt.t.pointer_alignment - 1, shape)

    def close(self) -> None:
        self.plan.close()


def blaslt_kernel(problem: GemmProblem, solution: Mapping[str, Any], device: Any) -> BlasLtKernel | None:
    """The kernel of a stored BLAS-Lt algorithm (None off the GPU)."""
    if device.type != "cuda" or not solution.get("blob"):
        return None
    return BlasLtKernel(load().plan(problem), bytes(solution["blob"]))


KERNELS: dict[str, KernelFactory] = {
    "cublaslt": blaslt_kernel,
    "hipblaslt": blaslt_kernel,
}


def torch_mm(a: Any, b: Any, bias: Any = None) -> Any:
    """Torch's own GEMM for ``a @ b`` (``torch.bmm`` for 3-D operands; ``+ bias`` when given),
    called through the ``out=`` overloads (``aten::mm.out`` etc.): the same kernels as
    ``torch.mm``/``addmm``/``bmm`` (one implementation behind both overloads), reached past
    any override of those (the Python bindings parse the call in C++: cheaper than
    ``torch.ops.aten.mm.out``)."""
    import torch

    out = a.new_empty((*a.shape[:-1], b.shape[-1]))
    if bias is not None:
        return torch.addmm(bias, a, b, out=out)
    if a.dim() == 3:
        return torch.bmm(a, b, out=out)
    return torch.mm(a, b, out=out)


def torch_kernel(problem: GemmProblem, solution: Mapping[str, Any], device: Any) -> GemmKernel:
    """Torch's own choice as a kernel (online tuning times it against the library's)."""
    return _TorchKernel()


class _TorchKernel:
    def __call__(self, a: Any, b: Any) -> Any:
        return torch_mm(a, b)

    def close(self) -> None:
        pass


def solution_source(solution: Mapping[str, Any]) -> str:
    """The kernel-table row of a stored solution: its config's ``source``; an entry without
    one is torch's own choice when it has no blob (older entries)."""
    config = solution.get("config") or {}
    return str(config.get("source") or ("" if solution.get("blob") else TORCH_SOURCE))


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
            return a.new_empty((*a.shape[:-1], b.shape[-1]))

        _traced_op = gemm
    return _traced_op


# what the native GEMM dispatch's table runs for a signature (runtime/native_gemm.cpp's enum Kind)
NATIVE_TORCH, NATIVE_FALLBACK, NATIVE_LAUNCH, NATIVE_PYTHON = 0, 1, 2, 3


class GemmRouter:
    """The cached GEMM choices of this device; ``kernels``: the kernel table (source -> factory).

    :meth:`resolve` answers a call signature (what :func:`problem_of` and the kernel read of the
    operands: shapes, strides, dtypes, devices, the bias's dtype or its absence) with ``(key,
    slot, run)``: ``run`` the callable of the problem's kernel for that signature, or None where
    torch runs the call (``slot`` then says why: :data:`TORCH_CHOICE` for an entry that keeps
    torch's choice, None for no entry, no kernel here or an operand layout no kernel may be
    given). The runtime's GEMM dispatch resolves each signature once and owns the table, the
    counts and the failures."""

    def __init__(self, entries: list[CachedChoice], kernels: Mapping[str, KernelFactory] | None = None) -> None:
        self.entries = {e.problem_key: e for e in entries}
        self.kernels = KERNELS if kernels is None else kernels
        self.id = next(_router_ids)
        _live_routers[self.id] = self
        self._slots: list[GemmKernel] = []  # the kernel of each routed problem
        self._slot_of: dict[str, int] = {}  # problem key -> its slot
        self.unusable: set[str] = set()  # problems whose entry has no kernel here
        self._routes: dict[tuple, tuple[str, int | None, Any]] = {}  # route()'s signatures

    @classmethod
    def from_entries(cls, entries: list[CachedChoice], kernels: Mapping[str, KernelFactory] | None = None
                     ) -> GemmRouter:
        return cls(entries, kernels)

    def resolve(self, a, b, bias=None) -> tuple[str, int | None, Callable[[Any, Any], Any] | None]:
        """``(key, slot, run)`` of a call signature (class docstring)."""
        try:
            p = problem_of(a, b)
        except ValueError:
            return UNSUPPORTED, None, None
        if a.device != b.device:  # the kernel would be handed a pointer of another device
            return UNSUPPORTED, None, None
        if bias is not None:
            p = dataclasses.replace(p, epilogue="bias")
        key = p.key()
        entry = self.entries.get(key)
        if entry is None or (bias is not None and bias.dtype != a.dtype):
            return key, None, None  # (torch's addmm refuses a bias of another dtype: it says so)
        source = solution_source(entry.solution)
        if source == TORCH_SOURCE:
            return key, TORCH_CHOICE, None
        slot = self._slot_of.get(key)
        if slot is None:
            factory = self.kernels.get(source)
            kernel = factory(GemmProblem.from_dict(entry.problem), entry.solution, a.device) if factory else None
            if kernel is None:
                self.unusable.add(key)
                return key, None, None
            self._slots.append(kernel)
            slot = self._slot_of[key] = len(self._slots) - 1
        kernel = self._slots[slot]
        for_call = getattr(kernel, "for_call", None)
        return key, slot, kernel if for_call is None else for_call(a, b)

    def route(self, a, b, bias=None) -> tuple[str, Any]:
        """``(key, run)`` of one call (``kernels.routing``), from :meth:`resolve`, once per call
        signature (an online router asks it for every call of the problems the cache holds)."""
        sig = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device, b.device,
               None if bias is None else bias.dtype)
        hit = self._routes.get(sig)
        if hit is None:
            hit = self._routes[sig] = self.resolve(a, b, bias)
        key, slot, run = hit
        if run is None:
            return key, (OWN if slot == TORCH_CHOICE else None)
        return key, (lambda: run(a, b)) if bias is None else (lambda: run(a, b).add_(bias))

    def launch_record(self, slot: int, a) -> tuple | None:
        """The native dispatch's launch record of ``slot``'s kernel for calls like ``a``'s (a
        BLAS-Lt kernel's ``native``), None for a kernel only Python can call."""
        native = getattr(self._slots[slot], "native", None)
        return native(a) if native is not None else None

    def add_unaligned(self, slot: int, calls: int) -> None:
        if 0 <= slot < len(self._slots):
            self._slots[slot].unaligned += calls

    def label(self, key: str) -> str:
        """The readable name of the cached choice of ``key`` (its config's name)."""
        config = self.entries[key].solution.get("config") or {} if key in self.entries else {}
        return str(config.get("name") or config.get("source") or "cached")

    def idle(self, baseline: str = TORCH_SOURCE) -> bool:
        """True when no entry names a kernel other than torch's own: every call would be
        torch's, so a program need not send its GEMMs here at all."""
        return all(solution_source(e.solution) == TORCH_SOURCE for e in self.entries.values())

    def may_route(self, *call: Any) -> bool:
        return True

    def launch(self, slot: int, a, b):
        """``a @ b`` with the kernel of ``slot`` (no checks: the slot was resolved for them)."""
        return self._slots[slot](a, b)

    def close(self) -> None:
        """Release the kernels; the router routes nothing after."""
        for kernel in self._slots:
            kernel.close()
        self._slots.clear()
        self._slot_of.clear()
        self._routes.clear()
        self.entries.clear()
        _live_routers.pop(self.id, None)
