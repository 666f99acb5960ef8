"""Routing another program's grouped GEMMs: an override of ``aten::_grouped_mm``.

``torch._grouped_mm`` and ``F.grouped_mm`` (HF transformers' ``grouped_mm`` experts,
torchtitan's MoE, Megatron's torch grouped-GEMM path) reach ``aten::_grouped_mm``, and
autograd's formulas for it call it again for the input and weight gradients. While
enabled, its backend kernel (``CUDA``; ``CPU`` for tests) is :func:`_grouped_mm` here:

- the call is read as a grouped GEMM problem by ``problems.grouped_mm_call``, the reading
  the routing point (``kernels.grouped.problem_of``) and the trace analyzer share, so a trace
  of the program gives the problems ``primus-tune grouped-gemm --trace`` tunes and this
  override routes. The layouts: ``a[T, K] @ b[G, K, N]`` with ``offs`` (forward, or its
  input gradient in a backward pass), ``a[K, T] @ b[T, N]`` with ``offs`` (the weight
  gradient ``[G, K, N]``) and ``a[G, M, K] @ b[G, K, N]`` (equal groups; ``a`` used
  transposed: the weight gradient). A call "runs in a backward pass" when autograd's
  engine runs it with grad mode off (``torch._C._current_graph_task_id``); a forward
  recomputed for activation checkpointing runs with grad on and stays a forward.
- ``offs`` stays on the device: the seam's operands of that pass (all ``T`` rows) and an
  ``Offsets`` holding ``offs`` go to the grouped router's ``route_offsets``. It decides by
  the call's shape (pass, groups, K, N, dtype, weight storage and the token bucket of its
  ``T`` rows), which needs no host read: a shape the cache has no choice for runs torch's
  kernel at once, one whose entries agree runs their choice (``grouped_mm`` and the Triton
  kernels take ``offs`` as it is). The tokens per group are read on the host (one device
  sync per ``offs`` tensor and version; a layer's forward, input- and weight-gradient calls
  share it) only where the chosen backend needs host counts (the loop, padded bmm), while
  the profiler records, and where the shape's entries differ by skew (then without waiting
  where a non-blocking copy has landed, else the call site's last choice runs: only a
  site's first call waits); the router's summary counts the calls that waited
  (``offs_reads``). A router without ``route_offsets`` (online tuning)
  gets the host counts. Rows past ``offs[-1]`` (an expert-parallel sentinel tail) are no
  group's: torch's kernel and the device-offs backends leave them unwritten, a backend
  that reads the counts gives zeros there.
- the router's answer is the call's result. None, a layout or argument no problem
  describes (``bias``, another ``out_dtype``, 3-D ``a`` with 2-D ``b``), a tracing or
  CUDA-graph-capturing call, and the ``_grouped_mm`` a grouped GEMM runs inside itself (the
  seam's or a routed call's ``grouped_mm`` backend: ``kernels.grouped.in_grouped``)
  run torch's kernel, taken with ``torch.library.get_kernel`` before the override:
  bit-identical to a call without it.

While torch.profiler records, each call is wrapped in the seam's annotation
(``problems.grouped_trace_name``), so a trace taken under ``enable()`` names each call's
problem with its real token split (a plain trace records only shapes: balanced assumed).

Under ``torch.compile`` with Inductor, ``post_grad_custom_pre_pass`` (:func:`grouped_pass`)
turns the graphs' ``aten._grouped_mm`` nodes into ``primus_perf::routed_grouped_mm``, an
opaque op that calls ``aten::_grouped_mm`` at run time (so this override), kept out of
CUDA graphs; without the pass Inductor's max-autotune templates would replace the call.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from primus_perf.kernels.grouped.offsets import Offsets
from primus_perf.kernels.grouped.passes import in_grouped, inside
from primus_perf.kernels.grouped.router import TORCH_KERNEL
from primus_perf.kernels.tracing import profiler_on
from primus_perf.problems import GroupedMmCall, dtype_name, grouped_mm_call, grouped_trace_name
from primus_perf.runtime import routes

_OP = torch.ops.aten._grouped_mm.default
PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Pass(NamedTuple):
    """A call as a pass of the seam: its reading, ``x`` (rows sorted by group, all of the
    call's) or ``dy`` for an input gradient, the weight or ``dy``, and the groups."""

    call: GroupedMmCall
    x: torch.Tensor
    w: torch.Tensor
    offsets: Offsets


def in_backward() -> bool:
    """Whether this call runs in autograd's backward pass (not a checkpointed recompute)."""
    return torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled()


def _routable(a: Any, b: Any, offs: Any, bias: Any, out_dtype: Any) -> bool:
    if in_grouped() or bias is not None or routes.installed(routes.GROUPED) is None:
        return False
    if type(a) not in PLAIN or type(b) not in PLAIN or (offs is not None and type(offs) not in PLAIN):
        return False
    if a.dtype != b.dtype or out_dtype not in (None, a.dtype) or torch._C._len_torch_dispatch_stack():
        return False
    return not (a.is_cuda and torch.cuda.is_current_stream_capturing())


def _seam_call(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> _Pass | None:
    """The call as a pass of the seam; None when no problem describes it. Reads nothing on
    the host."""
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
    """The router's answer in the shape torch's kernel gives."""
    if a.dim() == 3:
        return out if call.phase == "wgrad" else out.reshape(a.shape[0], a.shape[1], out.shape[-1])
    return out


def _with_counts(router: Any, p: _Pass) -> Any:
    """A router that takes host counts only (online tuning): the pass on the groups' rows,
    rows past them zeros."""
    counts = p.offsets.counts()
    used = sum(counts)
    if p.call.phase == "wgrad":
        return router(p.call.phase, p.x[:used], p.w[:used], counts)
    out = router(p.call.phase, p.x[:used], p.w, counts)
    if out is None or used == p.x.shape[0]:
        return out
    full = out.new_zeros(p.x.shape[0], out.shape[1])
    full[:used] = out
    return full


def _run(p: _Pass, torch_call: Any, a: torch.Tensor) -> torch.Tensor:
    """The router's answer, else torch's kernel (``torch_call()``)."""
    router = routes.installed(routes.GROUPED)
    route = getattr(router, "route_offsets", None)

    def routed() -> torch.Tensor | None:
        try:
            out = _with_counts(router, p) if route is None else route(p.call.phase, p.x, p.w, p.offsets)
        except ValueError:  # offs that split no rows: torch's kernel, as without the override
            return None
        return None if out is None else _answer(a, p.call, out)

    with inside:  # torch's kernel is the grouped_mm backend's (the baseline a confirmation names)
        return routes.grouped_routed(p.call.phase, p.x, p.w, p.offsets.groups, routed, torch_call, TORCH_KERNEL)


def _grouped_mm(torch_kernel: Any, keyset: Any, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    def torch_call() -> torch.Tensor:
        return torch_kernel.call_boxed(keyset, a, b, offs, bias, out_dtype)

    found = _seam_call(a, b, offs) if _routable(a, b, offs, bias, out_dtype) else None
    if found is None:
        return torch_call()
    if profiler_on():  # the call under an annotation naming its problem, whoever runs it
        try:
            counts = found.offsets.counts()  # a host read is fine while the profiler records
            name = grouped_trace_name(found.call.problem(dtype_name(a.dtype), counts), sum(counts))
        except ValueError:  # a dtype no problem describes, offs that split no rows
            return _run(found, torch_call, a)
        with torch.autograd.profiler.record_function(name):
            return _run(found, torch_call, a)
    return _run(found, torch_call, a)


def override(lib: torch.library.Library, key: str) -> None:
    """Put :func:`_grouped_mm` in ``lib`` at dispatch key ``key`` (``lib`` is an
    ``aten`` IMPL library; destroying it restores torch's kernel)."""
    torch_kernel = torch.library.get_kernel(_OP, key)
    lib.impl("_grouped_mm", functools.partial(_grouped_mm, torch_kernel), key, with_keyset=True)


# ---- torch.compile (Inductor) --------------------------------------------------------------

_defined = False


def define_op() -> None:
    """Register ``primus_perf::routed_grouped_mm`` (once): ``aten::_grouped_mm`` at run time."""
    global _defined
    if _defined:
        return
    tags = tuple(getattr(torch._C.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch._C.Tag, name))

    @torch.library.custom_op("primus_perf::routed_grouped_mm", mutates_args=(), tags=tags)
    def routed_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None,
                          bias: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
        return _OP(a, b, offs, bias, out_dtype).contiguous()  # one layout, whoever answered

    @routed_grouped_mm.register_fake
    def _(a, b, offs, bias, out_dtype):
        return _OP(a, b, offs, bias, out_dtype).contiguous()

    _defined = True


def rewrite_grouped_mms(graph: torch.fx.Graph) -> None:
    """``aten._grouped_mm`` nodes -> ``primus_perf::routed_grouped_mm``."""
    from primus_perf.runtime.compiled import replace_node

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


def grouped_pass() -> Any:
    """The Inductor pass (``compiled.InductorPass``), or None where Inductor has no slot."""
    from primus_perf.runtime.compiled import InductorPass

    define_op()
    return InductorPass.install("post_grad_custom_pre_pass", rewrite_grouped_mms,
                                f"primus_perf.routed_grouped_mm/{_source_hash()}", "grouped GEMMs")


@functools.cache
def _source_hash() -> str:
    from torch._inductor.custom_graph_pass import get_hash_for_files

    return get_hash_for_files((__file__,)).hex()
