"""Routing under ``torch.compile`` with Inductor: custom ops that Inductor calls as opaque
kernels, and the graph passes that put them where the program's GEMMs and SDPA calls were.

Inductor emits its own kernels for what the dispatcher overrides of ``intercept.py`` route
in eager mode, so while enabled two of its custom-pass slots hold a pass of this module
(:class:`InductorPass`; a slot that holds another pass is left alone, with a warning):

- GEMMs, ``post_grad_custom_post_pass``: ``aten.mm/bmm`` and plain ``aten.addmm`` nodes of
  the forward and backward graphs become ``primus_perf::routed_gemm`` (:func:`routes.gemm`).
- Attention, ``pre_grad_custom_pass``: before AOTAutograd differentiates the graph, every
  SDPA call a router takes (:func:`routes.routable_sdpa`, asked of the traced call's fake
  tensors) becomes ``primus_perf::routed_attention_forward`` on the routers' layout
  (batch, seq, heads, head_dim); its autograd formula is
  ``primus_perf::routed_attention_backward``. A call autograd does not record (no grad)
  becomes ``primus_perf::routed_attention``, forward only.

A routed attention call's backward is the one its router builds in eager mode: the router
answers with a tensor whose autograd graph is the chosen kernel's backward (the Triton
autograd function, an SDPA backend's, online tuning's timing marks around them). A custom
op returns tensors only, so the forward op runs the router with autograd on, as an eager
call (a custom op's kernel runs below autograd: :func:`_as_eager` lifts that), keeps the
graph in ``_graphs`` under a ticket (a CPU integer returned beside the output and saved for
backward), and the backward op runs it (``torch.autograd.grad``). A graph lives as long as
its ticket: the compiled backward drops the ticket once it has used it, and a forward whose
backward never runs drops it with its saved tensors. The kept graph reads the buffers of q,
k, v and the output, which Inductor must therefore not reuse: the backward op takes them
(saved for backward, they are kept), the attention ops take their inputs in the layout
Inductor has them in (``flexible_layout``: no copy the kept graph would not see), and when
the backward's q, k or v is not the forward's memory (recomputed for the backward) the
backward op runs the forward again on it rather than trust the kept graph. The
ticket being a CPU tensor, Inductor leaves these ops out of its CUDA graphs, whose replay
would skip the router's Python.

A graph compiled while enabled calls the routes at run time: after ``disable()`` its calls
go to torch (no router answers). Each pass's uuid is part of Inductor's cache keys. Other
backends run no Inductor pass: under ``aot_eager`` the GEMMs reach the dispatcher overrides,
and SDPA calls run the backend op AOTAutograd traced, unrouted.
"""

from __future__ import annotations

import itertools
import operator
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from primus_perf.runtime import routes

_graphs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}  # ticket -> (output, q k v leaves)
_tickets = itertools.count()
_defined = False
# what a custom op's kernel runs without (it is called below autograd) and an eager call has
_BELOW_AUTOGRAD = tuple(getattr(torch._C.DispatchKey, name) for name in
                        ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"))


@contextmanager
def _as_eager(grad: bool) -> Iterator[None]:
    """Inside a custom op's kernel: autograd records again (``grad``) as in an eager call."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _BELOW_AUTOGRAD:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.set_grad_enabled(grad):
        yield


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The router's answer, else torch's SDPA as the program called it."""
    out = routes.routed_attention(q, k, v, causal)
    return routes.torch_attention(q, k, v, causal) if out is None else out


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _attention_like(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as the ops' outputs are made


def define_ops() -> None:
    """Register the custom ops ``primus_perf::routed_gemm`` and ``routed_attention*`` (once)."""
    global _defined
    if _defined:
        return
    # flexible_layout: Inductor passes the tensors as they are (no copy the kept graph would
    # not see); cudagraph_unsafe: kept out of CUDA graphs, whose replay would skip the Python
    # that keeps and finds each call's autograd graph (a tag this torch lacks is left out)
    flexible = tuple(getattr(torch._C.Tag, name) for name in ("flexible_layout", "cudagraph_unsafe")
                     if hasattr(torch._C.Tag, name))

    @torch.library.custom_op("primus_perf::routed_gemm", mutates_args=())
    def routed_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return routes.gemm(a, b, bias)

    @routed_gemm.register_fake
    def _(a, b, bias):
        return a.new_empty((*a.shape[:-1], b.shape[-1]))

    @torch.library.custom_op("primus_perf::routed_attention", mutates_args=(), tags=flexible)
    def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with _as_eager(grad=False):
            return _attend(q, k, v, causal).contiguous()

    routed_attention.register_fake(lambda q, k, v, causal: _attention_like(q))

    @torch.library.custom_op("primus_perf::routed_attention_forward", mutates_args=(), tags=flexible)
    def routed_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        with _as_eager(grad=True):
            out = _attend(*leaves, causal)
        n = next(_tickets)
        ticket = torch.tensor(n, device="cpu")
        _graphs[n] = (out, leaves)
        weakref.finalize(ticket, _graphs.pop, n, None)
        return out.detach().contiguous(), ticket

    @routed_attention_forward.register_fake
    def _(q, k, v, causal):
        return _attention_like(q), torch.empty((), dtype=torch.int64, device="cpu")

    @torch.library.custom_op("primus_perf::routed_attention_backward", mutates_args=(), tags=flexible)
    def routed_attention_backward(grad: torch.Tensor, ticket: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor,
                                  causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kept = _graphs.get(int(ticket))
        if kept is None:
            raise RuntimeError("primus_perf: the autograd graph of a routed attention call is gone")
        output, leaves = kept
        if not all(map(_same_memory, (q, k, v), leaves)):
            # q, k or v recomputed for the backward (AOTAutograd's partitioner may recompute
            # cheap producers): the forward's buffers, which the kept graph reads, may have
            # been reused since, so the forward runs again on these
            leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
            with _as_eager(grad=True):
                output = _attend(*leaves, causal)
        with _as_eager(grad=False):  # kept for a second backward of a retained graph, as autograd would
            grads = torch.autograd.grad(output, leaves, grad, retain_graph=True)
        return tuple(g.contiguous() for g in grads)

    @routed_attention_backward.register_fake
    def _(grad, ticket, q, k, v, out, causal):
        return _attention_like(q), _attention_like(k), _attention_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, ctx.causal = inputs
        out, ticket = output
        ctx.save_for_backward(ticket, q, k, v, out)

    def backward(ctx, grad, _ticket_grad):
        return (*torch.ops.primus_perf.routed_attention_backward(grad, *ctx.saved_tensors, ctx.causal), None)

    routed_attention_forward.register_autograd(backward, setup_context=setup_context)
    _defined = True


class InductorPass:
    """A graph rewrite in one of Inductor's custom-pass slots, while enabled. Its uuid (part
    of Inductor's cache keys) hashes the source of the rewrites and of the routes, so that
    no graph compiled by another version of them is taken from a cache."""

    def __init__(self, slot: str, installed: Any) -> None:
        self.slot = slot
        self.installed = installed

    @classmethod
    def install(cls, slot: str, rewrite: Callable[[torch.fx.Graph], None], name: str,
                what: str) -> InductorPass | None:
        """``rewrite`` in ``torch._inductor.config.<slot>``; None (with a warning that
        compiled ``what`` are not routed) when the slot holds somebody else's pass."""
        try:
            from torch._inductor import config
            from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
        except ImportError as exc:  # torch without Inductor, or without its custom-pass API
            warnings.warn(f"Inductor's custom passes are not available ({exc}); compiled {what} are not routed",
                          stacklevel=5)
            return None
        if getattr(config, slot) is not None:  # somebody else's pass: leave Inductor as it is
            warnings.warn(f"an Inductor {slot} is already set; compiled {what} are not routed", stacklevel=5)
            return None
        define_ops()
        version = f"{name}/{get_hash_for_files((__file__, routes.__file__)).hex()}"

        class _Pass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                rewrite(graph)

            def uuid(self) -> str:
                return version

        installed = _Pass()
        setattr(config, slot, installed)
        return cls(slot, installed)

    def uninstall(self) -> None:
        from torch._inductor import config

        if getattr(config, self.slot) is self.installed:
            setattr(config, self.slot, None)


def gemm_pass() -> InductorPass | None:
    return InductorPass.install("post_grad_custom_post_pass", rewrite_gemms, "primus_perf.routed_gemm", "GEMMs")


def attention_pass() -> InductorPass | None:
    return InductorPass.install("pre_grad_custom_pass", rewrite_attention, "primus_perf.routed_attention",
                                "attention calls")


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


def replace_node(graph: torch.fx.Graph, node: torch.fx.Node, target: Any, args: tuple[Any, ...]) -> None:
    """``node`` -> a call of ``target`` on ``args`` that takes its metadata and its uses."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
_UNKNOWN = object()  # a traced argument without a value: never routable


def _sdpa_args(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: Any = 0.0,
               is_causal: Any = False, scale: Any = None, enable_gqa: Any = False) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _value(arg: Any) -> Any:
    """A traced argument's value (Dynamo's fake tensor, or the constant itself)."""
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("example_value", arg.meta.get("val", _UNKNOWN))
    return arg


def rewrite_attention(graph: torch.fx.Graph) -> None:
    """Routable SDPA calls of a pre-grad (Dynamo) graph -> ``primus_perf::routed_attention*``
    between transposes to and from the routers' layout; inputs autocast would have cast are
    cast to the dtype SDPA computed in."""
    from torch._subclasses.fake_tensor import FakeTensor

    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        try:
            args = _sdpa_args(*node.args, **node.kwargs)
        except TypeError:
            continue
        values = tuple(_value(a) for a in args)
        out = _value(node)
        if not all(type(t) is FakeTensor for t in (*values[:3], out)) or not routes.routable_sdpa(*values):
            continue
        # the router is asked about the call it would see: the routers' layout, in the dtype
        # SDPA computes in; without a tuned choice the call stays Inductor's, fusions included
        if not routes.attention_may_route(*(t.to(out.dtype).transpose(1, 2) for t in values[:3]), values[5]):
            continue
        with graph.inserting_before(node):
            qkv = []
            for arg, val in zip(args[:3], values[:3]):
                if val.dtype != out.dtype:
                    arg = graph.call_function(aten._to_copy.default, (arg,), {"dtype": out.dtype})
                qkv.append(graph.call_function(aten.transpose.int, (arg, 1, 2)))
            causal = values[5]
            if out.requires_grad:
                op = graph.call_function(torch.ops.primus_perf.routed_attention_forward.default, (*qkv, causal))
                routed = graph.call_function(operator.getitem, (op, 0))
            else:
                op = routed = graph.call_function(torch.ops.primus_perf.routed_attention.default, (*qkv, causal))
            new = graph.call_function(aten.transpose.int, (routed, 1, 2))
        op.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
