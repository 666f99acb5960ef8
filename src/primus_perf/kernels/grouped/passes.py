"""The three passes of a grouped GEMM (MoE expert layers) on the kernel side: the problem of
a pass's operands (:func:`problem_of`) and one pass on a backend (:func:`run_backend`).

A pass is ``(phase, a, b, counts)``: fwd ``x[T, K]``, ``w[G, K, N]``; dgrad ``dy[T, N]``,
``w.transpose(1, 2)``; wgrad ``x[T, K]``, ``dy[T, N]``; ``counts``: the host token counts
per group (see :class:`~primus_perf.problems.GroupedGemmProblem`), or an
:class:`~.offsets.Offsets` (:func:`run_offsets`: the device ``offs`` of an
``aten::_grouped_mm`` call, read on the host only by a backend that needs counts). Where a
program's grouped GEMMs are routed is the runtime's business (``runtime.grouped``); the re-entrancy
guard every routed grouped GEMM runs inside (:data:`inside`, :func:`in_grouped`) lives here,
below both the runtime and the kernels that read it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from primus_perf.kernels.grouped.backends import Backend
from primus_perf.kernels.grouped.offsets import Offsets
from primus_perf.problems import (
    GROUPED_PASSES,
    GroupedGemmProblem,
    GroupedMmCall,
    dtype_name,
    grouped_mm_call,
)

DEFAULT_BACKEND = "loop"


class _Local(threading.local):
    depth = 0  # > 0 while a grouped GEMM runs on this thread (a class default: no getattr miss per read)


_local = _Local()


class _Inside:
    """While entered, this thread runs a grouped GEMM (:func:`in_grouped`). ``mirror``: the
    ``(enter, exit)`` of a native GEMM dispatch that keeps its own count of this depth
    (``runtime.native``: its table answers no call of a grouped GEMM's own), or None."""

    mirror: tuple[Callable[[], None], Callable[[], None]] | None = None

    def __enter__(self) -> None:
        _local.depth += 1
        if self.mirror is not None:
            self.mirror[0]()

    def __exit__(self, *exc: object) -> None:
        _local.depth -= 1
        if self.mirror is not None:
            self.mirror[1]()


inside = _Inside()


def in_grouped() -> bool:
    """True while a grouped GEMM runs (an ``aten::_grouped_mm`` call the runtime's grouped
    dispatch answers): the GEMMs its router or backend
    calls, ``torch.mm``, ``torch.bmm`` and ``torch._grouped_mm`` alike, are torch's and are
    not routed again. The grouped problem is what was tuned, timed with those GEMMs as torch
    runs them; its pieces (per-expert slices, a zero-padded batch) change shape with every
    step's token split and are no problem the GEMM router was tuned for."""
    return _local.depth > 0


def run_backend(
    backend: Backend, phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]
) -> torch.Tensor:
    """One pass of :func:`run` on ``backend`` (``wgrad`` or the product of the others)."""
    return backend.wgrad(a, b, counts) if phase == "wgrad" else backend.mm(a, b, counts)


def run_offsets(backend: Backend, phase: str, a: torch.Tensor, b: torch.Tensor, offsets: Offsets) -> torch.Tensor:
    """One pass with the groups as :class:`Offsets`: ``a`` (and a wgrad's ``b``) has
    ``offsets.rows`` rows. A backend with a device entry (``mm_offs`` / ``wgrad_offs``) takes
    the device ends as they are (no host read; rows past the last group are left as torch's
    kernel leaves them, unwritten); any other reads the counts (one device sync per ``offs``
    tensor), runs on the groups' rows and gives zeros for the rows past them."""
    device_fn = backend.wgrad_offs if phase == "wgrad" else backend.mm_offs
    if device_fn is not None and offsets.ends is not None:
        return device_fn(a, b, offsets.ends)
    counts = offsets.counts()
    used = sum(counts)
    if phase == "wgrad":
        return backend.wgrad(a[:used], b[:used], counts)
    out = backend.mm(a[:used], b, counts)
    if used == a.shape[0]:
        return out
    full = out.new_zeros(a.shape[0], out.shape[1])
    full[:used] = out
    return full


def _call_of(phase: str, a: torch.Tensor, b: torch.Tensor, groups: int) -> GroupedMmCall:
    if phase not in GROUPED_PASSES:
        raise ValueError(f"unknown grouped GEMM pass {phase!r}")
    a_shape, a_strides = tuple(a.shape), a.stride()
    if phase == "wgrad":  # the aten call's a is x^T
        a_shape, a_strides = a_shape[::-1], a_strides[::-1]
    call = grouped_mm_call(a_shape, a_strides, b.shape, b.stride(), groups, phase == "dgrad")
    if call is None or call.phase != phase:
        raise ValueError(f"grouped GEMM {phase}: operands {tuple(a.shape)} and {tuple(b.shape)} do not fit")
    return call


def problem_of(
    phase: str, a: torch.Tensor, b: torch.Tensor, counts: Sequence[int]
) -> GroupedGemmProblem:
    """The problem of a pass, read as the ``aten::_grouped_mm`` call of that pass would be
    (``problems.grouped_mm_call``: the routing point, the dispatcher override and the trace
    analyzer share one reading). ``k``, ``n`` and ``trans_w`` describe the forward weight
    (``trans_w``: stored ``[G, N, K]`` and used transposed); a wgrad problem has
    ``trans_w=False``: it produces ``dW[G, K, N]`` whatever the weight's storage."""
    return _call_of(phase, a, b, len(counts)).problem(dtype_name(a.dtype), list(counts))


def shape_problem_of(phase: str, a: torch.Tensor, b: torch.Tensor, groups: int) -> GroupedGemmProblem:
    """The problem of a pass as far as its shapes tell, without the counts: the balanced
    split (skew 1), the key a trace that does not record ``offs`` names the call by. The
    router's shape-level key (``router.shape_key``)."""
    return _call_of(phase, a, b, groups).problem(dtype_name(a.dtype))
