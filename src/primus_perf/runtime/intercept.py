"""Routing an unmodified PyTorch program: overrides of the aten GEMM and SDPA operators.

While enabled, the backend kernels of ``aten::mm``, ``aten::addmm`` and ``aten::bmm`` (the
``CUDA`` key; ``CPU`` for tests) are Python functions that run :func:`routes.gemm`,
``aten::_grouped_mm``'s runs :func:`routes.grouped` (``grouped_intercept.py``), and
``aten::scaled_dot_product_attention`` has one at the autograd and backend keys that runs
:func:`routes.routed_attention`. Torch's default goes through the ``out=`` overloads (the same
kernels) and the SDPA composite itself (``OpOverload.decompose``): a call left to torch
is bit-identical to one without the overrides.

Why the dispatcher (``torch.library.Library("aten", "IMPL")``), measured against the
alternatives in torch 2.13:

- it sees every GEMM of a step: ``F.linear``, ``torch.matmul``, ``@`` and ``einsum``
  reach ``aten::mm/addmm/bmm``, and so do the backward formulas of autograd (input and
  weight gradients) and the local shards of DDP and FSDP2 (DTensor computes through the
  same operators). A ``TorchFunctionMode`` sees only Python-level calls (no backward
  GEMMs) and a ``TorchDispatchMode`` puts every operator of the step, elementwise ones
  included, through Python;
- it costs one Python call per GEMM and nothing for any other operator
  (``benchmarks/enable_overhead.py`` and ``tests/test_enable.py`` measure it);
- ``torch.compile`` traces the operators as they are (Dynamo and AOTAutograd run fake
  tensors, which the overrides pass to torch's own implementations): no graph break. The
  compiled graph calls ``aten::mm`` etc., routed when the backend runs them through the
  dispatcher (``aot_eager``, CUDA graphs of eager code); Inductor emits its own kernels,
  so while enabled its custom passes (``compiled.py``) swap the GEMM nodes and the
  routable SDPA calls for custom ops that take the same routes.

A tuned choice runs only where a router has one; a tuned kernel that fails once leaves its
problem to torch (``kernels.routing``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from primus_perf import kinds
from primus_perf.runtime import grouped_intercept, native, routes
from primus_perf.runtime.compiled import attention_pass, gemm_pass

BACKEND_KEYS = {"cuda": "CUDA", "cpu": "CPU"}  # device type -> dispatch key of its kernels
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
PLAIN = (torch.Tensor, torch.nn.Parameter)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[-1]:  # the bias epilogue
        return routes.gemm(a, b, bias)
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _routable_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:
    if routes.bypassed() or torch._C._len_torch_dispatch_stack():  # a routed call's own SDPA, or tracing
        return False
    if type(q) not in PLAIN or type(k) not in PLAIN or type(v) not in PLAIN:
        return False
    return routes.routable_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if _routable_sdpa(q, k, v, attn_mask, dropout_p, bool(is_causal), scale, enable_gqa):
        # (batch, heads, seq, dim) -> the routers' (batch, seq, heads, dim) views, and back
        out = routes.routed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(is_causal))
        if out is not None:
            return out.transpose(1, 2)
    return _SDPA.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@dataclass(frozen=True)
class Intercept:
    """A kind's intercept part (``primus_perf.kinds``): ``overrides(lib, dispatch key)``
    registers the aten overrides that send its calls to the routes (in ``lib``, or
    elsewhere: it then returns what removes them); ``compile_pass()`` installs the Inductor
    pass that does so under ``torch.compile`` (None: not installed, with a warning saying why)."""

    overrides: Callable[[torch.library.Library, str], Callable[[], None] | None]
    compile_pass: Callable[[], Any]


def _gemm_overrides(lib: torch.library.Library, key: str) -> Callable[[], None] | None:
    # the native dispatch (native.py) where it builds, with these as its Python routes
    if native.install(key, routes.gemm, _addmm):
        return native.uninstall
    # mm and bmm call routes.gemm itself (one Python frame per GEMM: it reads the operands' rank)
    lib.impl("mm", routes.gemm, key)
    lib.impl("bmm", routes.gemm, key)
    lib.impl("addmm", _addmm, key)
    return None


def _attention_overrides(lib: torch.library.Library, key: str) -> None:
    lib.impl("scaled_dot_product_attention", _sdpa, "Autograd" + key)
    lib.impl("scaled_dot_product_attention", _sdpa, key)
    return None


# a module that overrides another aten operator for a kind attaches its Intercept the same way
kinds.attach(kinds.GEMM.name, intercept=Intercept(_gemm_overrides, gemm_pass))
kinds.attach(kinds.ATTENTION.name, intercept=Intercept(_attention_overrides, attention_pass))
kinds.attach(kinds.GROUPED.name, intercept=Intercept(grouped_intercept.override, grouped_intercept.grouped_pass))


class Interception:
    """The overrides of the ``kinds_given`` (each kind's :class:`Intercept` part; a kind
    without one has none), on one device type; :meth:`close` restores torch's kernels."""

    def __init__(self, kinds_given: set[str], device_type: str = "cuda") -> None:
        if device_type not in BACKEND_KEYS:
            raise ValueError(f"device type {device_type!r}: one of {sorted(BACKEND_KEYS)}")
        key = BACKEND_KEYS[device_type]
        parts = list(kinds.with_part("intercept", among=kinds_given).values())
        self.lib = torch.library.Library("aten", "IMPL")
        self.undo: list[Callable[[], None]] = []  # overrides registered outside self.lib
        self.compile_passes: list[Any] = []  # Inductor's (compiled.py)
        try:
            with warnings.catch_warnings():  # "overriding a previously registered kernel": the point
                warnings.simplefilter("ignore", UserWarning)
                for part in parts:
                    undo = part.overrides(self.lib, key)
                    if undo is not None:
                        self.undo.append(undo)
            for part in parts:
                compile_pass = part.compile_pass()
                if compile_pass is not None:
                    self.compile_passes.append(compile_pass)
        except BaseException:
            self.close()  # nothing of a half-made interception stays
            raise

    def close(self) -> None:
        for undo in self.undo:
            undo()
        self.undo = []
        self.lib._destroy()
        for compile_pass in self.compile_passes:
            compile_pass.uninstall()
        self.compile_passes = []
