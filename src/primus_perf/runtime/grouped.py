"""The grouped-GEMM kind's dispatch: ``aten::_grouped_mm`` of any program, eager and compiled.

``torch._grouped_mm`` and ``F.grouped_mm`` (the reference trainer's MoE layer, HF transformers'
``grouped_mm`` experts, torchtitan's MoE, Megatron's torch grouped-GEMM path) reach
``aten::_grouped_mm``, and autograd's formulas call it again for the input and weight
gradients. While held, its backend kernel (``CUDA``; ``CPU`` for tests) is
:meth:`GroupedDispatch.call`:

- the call is read as a grouped GEMM problem by ``problems.grouped_mm_call``, the reading the
  trace analyzer shares, so a trace of the program gives the problems ``primus-tune
  grouped-gemm --trace`` tunes. The layouts: ``a[T, K] @ b[G, K, N]`` with ``offs`` (forward,
  or its input gradient in a backward pass), ``a[K, T] @ b[T, N]`` with ``offs`` (the weight
  gradient) and ``a[G, M, K] @ b[G, K, N]`` (equal groups). A call "runs in a backward pass"
  when autograd's engine runs it with grad mode off; a forward recomputed for activation
  checkpointing runs with grad on and stays a forward.
- ``offs`` stays on the device: the router decides by the call's shape and reads the counts
  on the host only where its choice needs them (``kernels.grouped.router``); the calls that
  waited for the device are counted (``offs_reads``).
- without a route the call runs the dispatch's ``backend``: torch's kernel (taken with
  ``torch.library.get_kernel`` before the override: bit-identical to a call without it)
  unless the program set another (:meth:`GroupedDispatch.set_backend`). A layout or argument
  no problem describes (``bias``, another ``out_dtype``), a traced or CUDA-graph-captured
  call, and the ``_grouped_mm`` a grouped GEMM runs inside itself run torch's kernel.

While torch.profiler records, each call is wrapped in an annotation naming its problem with
its real token split (``problems.grouped_trace_name``). Under Inductor,
``post_grad_custom_pre_pass`` turns the graphs' ``aten._grouped_mm`` nodes into
``primus_perf::routed_grouped_mm``, an opaque op calling ``aten::_grouped_mm`` at run time,
kept out of CUDA graphs (else Inductor's templates would replace the call).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, NamedTuple

import torch

from primus_perf.kernels.grouped.backends import BACKENDS
from primus_perf.kernels.grouped.offsets import Offsets
from primus_perf.kernels.grouped.passes import in_grouped, inside, run_offsets
from primus_perf.kernels.grouped.router import TORCH_KERNEL, GroupedChoice, shape_key
from primus_perf.kernels.tracing import profiler_on
from primus_perf.problems import (
    GroupedGemmProblem,
    GroupedMmCall,
    dtype_name,
    grouped_mm_call,
    grouped_trace_name,
)
from primus_perf.runtime.dispatch import PLAIN, Dispatch, InductorPass, replace_node

_OP = torch.ops.aten._grouped_mm.default


class _Pass(NamedTuple):
    """A call as a pass (``kernels.grouped.passes``): its reading, ``x`` (rows sorted by group, all of the
    call's) or ``dy`` for an input gradient, the weight or ``dy``, and the groups."""

    call: GroupedMmCall
    x: torch.Tensor
    w: torch.Tensor
    offsets: Offsets


def _shape_of(key: str) -> str | None:
    try:
        return shape_key(GroupedGemmProblem.from_key(key))
    except ValueError:
        return None


def in_backward() -> bool:
    """Whether this call runs in autograd's backward pass (not a checkpointed recompute)."""
    return torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled()


def _plain(a: Any, b: Any, offs: Any, bias: Any, out_dtype: Any) -> bool:
    """A call a grouped GEMM problem describes and the dispatch may answer: not a grouped GEMM's
    own, no bias, plain tensors of one dtype, not traced, not captured into a CUDA graph."""
    if in_grouped() or bias is not None:
        return False
    if type(a) not in PLAIN or type(b) not in PLAIN or (offs is not None and type(offs) not in PLAIN):
        return False
    if a.dtype != b.dtype or out_dtype not in (None, a.dtype) or torch._C._len_torch_dispatch_stack():
        return False
    return not (a.is_cuda and torch.cuda.is_current_stream_capturing())


def _pass_of(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> _Pass | None:
    """The call as a pass (``kernels.grouped.passes``); None when no problem describes it.
    Reads nothing on the host."""
    if offs is not None and offs.dim() != 1:
        return None
    groups = None if offs is None else offs.shape[0]
    call = grouped_mm_call(a.shape, a.stride(), b.shape, b.stride(), groups, in_backward())
    if call is None:
        return None
    if a.dim() == 3:  # equal groups of a.shape[1] (x) or a.shape[2] (x^T) rows
        if call.phase == "wgrad":
            x, dy = a.transpose(1, 2), b
            return _Pass(call, x.reshape(-1, x.shape[2]), dy.reshape(-1, dy.shape[2]),
                         Offsets(call.tokens, counts=[x.shape[1]] * x.shape[0]))
        return _Pass(call, a.reshape(-1, a.shape[2]), b, Offsets(call.tokens, counts=[a.shape[1]] * a.shape[0]))
    offsets = Offsets(call.tokens, ends=offs)
    if call.phase == "wgrad":  # a is x^T [K, T], b is dy [T, N]
        return _Pass(call, a.t(), b, offsets)
    return _Pass(call, a, b, offsets)


def _answer(a: torch.Tensor, call: GroupedMmCall, out: torch.Tensor) -> torch.Tensor:
    """A pass's result in the shape torch's kernel gives."""
    if a.dim() == 3:
        return out if call.phase == "wgrad" else out.reshape(a.shape[0], a.shape[1], out.shape[-1])
    return out


class GroupedDispatch(Dispatch):
    """The grouped-GEMM kind's routing (module docstring). ``backend``: what a call runs
    without a route (a row of ``kernels.grouped.BACKENDS``; torch's kernel, ``grouped_mm``,
    unless the program sets another: the trainer's MoE backend)."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self._backends: dict[int, str] = {}  # owner -> its backend, the last set the one that runs
        self._base = TORCH_KERNEL
        self.offs_reads: Counter[str] = Counter()  # calls that waited for the device to read their offs

    @property
    def backend(self) -> str:
        return next(reversed(self._backends.values()), self._base)

    def set_backend(self, name: str, owner: object | None = None) -> None:
        """Run ``name`` where no route answers: for ``owner`` until it releases the dispatch (two
        trainers alive: the last one's), or for everyone (no owner)."""
        if name not in BACKENDS:
            raise ValueError(f"unknown grouped GEMM backend {name!r} ({', '.join(BACKENDS)})")
        if owner is None:
            self._base = name
        else:
            self._backends.pop(id(owner), None)
            self._backends[id(owner)] = name

    def release_id(self, holder_id: int) -> None:
        self._backends.pop(holder_id, None)
        super().release_id(holder_id)

    def baseline_name(self) -> str:
        return self.backend

    def reset(self) -> None:
        super().reset()
        self.offs_reads.clear()

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "offs_reads": dict(self.offs_reads)}

    def baseline_solution(self, name: str) -> dict[str, Any] | None:
        choice = GroupedChoice.of_backend(name)  # triton: its default config
        return None if choice is None else {"config": {"name": choice.label(), **choice.to_solution()}, "blob": b""}

    def confirm_key(self, key: str) -> str:
        """A shape's calls are confirmed as one, whichever skew bucket each falls in."""
        return _shape_of(key) or key

    def entry_keys(self, key: str) -> list[str]:
        """A verdict on a shape covers every skew bucket's entry of it."""
        choices = getattr(self.router, "choices", {})
        return [k for k in choices if _shape_of(k) == key] or [key]

    def call(self, torch_kernel: Any, keyset: Any, a: torch.Tensor, b: torch.Tensor,
             offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The override of ``aten::_grouped_mm`` (``torch_kernel``: torch's, taken before it)."""

        def torch_call() -> torch.Tensor:
            return torch_kernel.call_boxed(keyset, a, b, offs, bias, out_dtype)

        routing = self.router is not None or self.backend != TORCH_KERNEL
        found = _pass_of(a, b, offs) if routing and _plain(a, b, offs, bias, out_dtype) else None
        if found is None:
            return torch_call()
        if profiler_on():  # the call under an annotation naming its problem, whoever runs it
            try:
                counts = found.offsets.counts()  # a host read is fine while the profiler records
                name = grouped_trace_name(found.call.problem(dtype_name(a.dtype), counts), sum(counts))
            except ValueError:  # a dtype no problem describes, offs that split no rows
                return self._route(found, torch_call, a)
            with torch.autograd.profiler.record_function(name):
                return self._route(found, torch_call, a)
        return self._route(found, torch_call, a)

    def _route(self, p: _Pass, torch_call: Any, a: torch.Tensor) -> torch.Tensor:
        phase, x, w, offsets = p.call.phase, p.x, p.w, p.offsets
        if self.backend == TORCH_KERNEL:
            baseline = torch_call
        else:
            impl = BACKENDS[self.backend]

            def baseline() -> torch.Tensor:
                return _answer(a, p.call, run_offsets(impl, phase, x, w, offsets))

        with inside:  # the GEMMs a grouped GEMM runs are torch's
            if self.router is None:
                return baseline()
            try:
                key, run = self.router.route(phase, x, w, offsets, self.backend)
            except ValueError:  # offs that split no rows: torch's kernel, as without the override
                return torch_call()
            was = offsets.read
            routed = run if not callable(run) else (lambda: _answer(a, p.call, run()))
            out = self.answer(key, routed, baseline, probe=lambda: offsets.read and not was)
            if offsets.read:
                self.offs_reads[key] += 1
            return out

    def overrides(self, lib: torch.library.Library, key: str) -> None:
        torch_kernel = torch.library.get_kernel(_OP, key)
        lib.impl("_grouped_mm", functools.partial(self.call, torch_kernel), key, with_keyset=True)

    def compile_pass(self) -> Any:
        define_op()
        return InductorPass.install("post_grad_custom_pre_pass", rewrite_grouped_mms, "primus_perf.routed_grouped_mm",
                                    "grouped GEMMs", (__file__,))


# ---- torch.compile (Inductor) --------------------------------------------------------------


@functools.cache
def define_op() -> None:
    """Register ``primus_perf::routed_grouped_mm`` (once): ``aten::_grouped_mm`` at run time."""
    tags = tuple(getattr(torch._C.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch._C.Tag, name))

    @torch.library.custom_op("primus_perf::routed_grouped_mm", mutates_args=(), tags=tags)
    def routed_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                          bias: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
        return _OP(a, b, offs, bias, out_dtype).contiguous()  # one layout, whoever answered

    @routed_grouped_mm.register_fake
    def _(a, b, offs, bias, out_dtype):
        return _OP(a, b, offs, bias, out_dtype).contiguous()


def rewrite_grouped_mms(graph: torch.fx.Graph) -> None:
    """``aten._grouped_mm`` nodes -> ``primus_perf::routed_grouped_mm``."""
    target = torch.ops.primus_perf.routed_grouped_mm.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _OP:
            continue
        try:
            args = _grouped_args(*node.args, **node.kwargs)
        except TypeError:
            continue
        replace_node(graph, node, target, args)


def _grouped_args(a: Any, b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None) -> tuple[Any, ...]:
    return a, b, offs, bias, out_dtype
