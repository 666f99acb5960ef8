"""Routing an unmodified PyTorch program: overrides of the aten GEMM and SDPA operators.

While enabled, the backend kernels of ``aten::mm``, ``aten::addmm`` and ``aten::bmm`` (the
``CUDA`` key; ``CPU`` for tests) are Python functions that run :func:`routes.gemm`, and
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
  dispatcher (``aot_eager``, CUDA graphs of eager code); Inductor emits its own GEMM
  calls, so the Inductor pass of this module (:class:`RoutedGemmPass`, installed as
  ``post_grad_custom_post_pass``) swaps them for the custom op ``primus_perf::routed_gemm``,
  which Inductor calls as an opaque kernel.

A tuned choice runs only where a router has one; a tuned kernel that fails once leaves its
problem to torch (``kernels.routing``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from primus_perf.runtime import routes

BACKEND_KEYS = {"cuda": "CUDA", "cpu": "CPU"}  # device type -> dispatch key of its kernels
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
PLAIN = (torch.Tensor, torch.nn.Parameter)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return routes.gemm(a, b)


_bmm = _mm  # a batched GEMM takes the same route (routes.gemm reads the operands' rank)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[-1]:
        return routes.gemm(a, b, bias)
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _routable_sdpa(q, k, v, attn_mask, dropout_p, scale, enable_gqa) -> bool:
    if routes.bypassed() or torch._C._len_torch_dispatch_stack():  # a routed call's own SDPA, or tracing
        return False
    if type(q) not in PLAIN or type(k) not in PLAIN or type(v) not in PLAIN:
        return False
    if attn_mask is not None or dropout_p != 0.0 or q.dim() != 4 or k.dim() != 4:
        return False
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return False
    return scale is None or math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]))


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if _routable_sdpa(q, k, v, attn_mask, dropout_p, scale, enable_gqa):
        # (batch, heads, seq, dim) -> the routers' (batch, seq, heads, dim) views, and back
        out = routes.routed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(is_causal))
        if out is not None:
            return out.transpose(1, 2)
    return _SDPA.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


class Interception:
    """The overrides for the ``kinds`` given, on one device type; :meth:`close` restores
    torch's kernels."""

    def __init__(self, kinds: set[str], device_type: str = "cuda") -> None:
        if device_type not in BACKEND_KEYS:
            raise ValueError(f"device type {device_type!r}: one of {sorted(BACKEND_KEYS)}")
        key = BACKEND_KEYS[device_type]
        self.lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": the point
            warnings.simplefilter("ignore", UserWarning)
            if "gemm" in kinds:
                self.lib.impl("mm", _mm, key)
                self.lib.impl("bmm", _bmm, key)
                self.lib.impl("addmm", _addmm, key)
            if "attention" in kinds:
                self.lib.impl("scaled_dot_product_attention", _sdpa, "Autograd" + key)
                self.lib.impl("scaled_dot_product_attention", _sdpa, key)
        self.compile_pass = RoutedGemmPass.install() if "gemm" in kinds else None

    def close(self) -> None:
        self.lib._destroy()
        if self.compile_pass is not None:
            self.compile_pass.uninstall()
            self.compile_pass = None


# ---- Inductor ------------------------------------------------------------------------

_routed_op: Any = None


def routed_gemm_op() -> Any:
    """``torch.ops.primus_perf.routed_gemm(a, b, bias)``: :func:`routes.gemm` as a custom op."""
    global _routed_op
    if _routed_op is None:

        @torch.library.custom_op("primus_perf::routed_gemm", mutates_args=())
        def routed_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return routes.gemm(a, b, bias)

        @routed_gemm.register_fake
        def _(a, b, bias):
            return a.new_empty((*a.shape[:-1], b.shape[-1]))

        _routed_op = routed_gemm
    return _routed_op


class RoutedGemmPass:
    """An Inductor post-grad pass: ``aten.mm/bmm`` and plain ``aten.addmm`` nodes (forward
    and backward graphs) become ``primus_perf::routed_gemm`` nodes."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    @classmethod
    def install(cls) -> RoutedGemmPass | None:
        try:
            from torch._inductor import config
            from torch._inductor.custom_graph_pass import CustomGraphPass
        except ImportError:  # torch without Inductor
            return None
        routed_gemm_op()
        rewrite = _rewrite

        class _Pass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                rewrite(graph)

            def uuid(self) -> str:
                return "primus_perf.routed_gemm/1"

        me = cls(config.post_grad_custom_post_pass)
        if me.previous is not None:  # somebody else's pass: leave Inductor as it is
            warnings.warn("an Inductor post-grad pass is already set; compiled GEMMs are not routed", stacklevel=3)
            return None
        config.post_grad_custom_post_pass = _Pass()
        return me

    def uninstall(self) -> None:
        from torch._inductor import config

        config.post_grad_custom_post_pass = self.previous


def _rewrite(graph: torch.fx.Graph) -> None:
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
        with graph.inserting_before(node):
            new = graph.call_function(target, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
