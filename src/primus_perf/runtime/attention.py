"""The attention kind's dispatch: ``aten::scaled_dot_product_attention`` of any program, eager
and compiled.

While held, SDPA has an override at the autograd and backend keys (:meth:`AttentionDispatch.sdpa`):
a call the router takes (:func:`routable_sdpa`: no mask, no dropout, 4-D, the default scale,
one head dim, GQA through ``enable_gqa``) is routed in the routers' layout (batch, seq, heads,
head_dim); any other, and every call a routed kernel makes itself (:func:`bypassed`), runs
torch's SDPA composite as it would have (``OpOverload.decompose``: it honours ``sdpa_kernel``).

Under Inductor (``pre_grad_custom_pass``, before AOTAutograd differentiates the graph) every
routable SDPA call whose router may answer becomes ``primus_perf::routed_attention_forward``;
its autograd formula is ``routed_attention_backward``; a call autograd does not record becomes
``routed_attention``. A routed call's backward is the one its router builds in eager mode: the
forward op runs the router with autograd on (:func:`_as_eager` lifts a custom op's kernel
above autograd), keeps the graph in ``_graphs`` under a ticket (a CPU integer returned beside
the output and saved for backward), and the backward op runs it (``torch.autograd.grad``).
The kept graph reads q, k, v and the output, so the ops take them as Inductor has them
(``flexible_layout``); when the backward's q, k or v is not the forward's memory (recomputed)
the forward runs again on it. The CPU ticket keeps these ops out of CUDA graphs, whose replay
would skip the router's Python.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from primus_perf.kernels.attention.backends import DEFAULT
from primus_perf.kernels.routing import choice_solution
from primus_perf.kinds import ATTENTION
from primus_perf.runtime.dispatch import PLAIN, Dispatch, InductorPass, of

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_local = threading.local()  # .bypass: > 0 while a routed attention runs (its SDPA is torch's)


def bypassed() -> bool:
    """True while a routed attention call runs (its own SDPA calls are torch's)."""
    return getattr(_local, "bypass", 0) > 0


class _Bypass:
    def __enter__(self) -> None:
        _local.bypass = getattr(_local, "bypass", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _local.bypass -= 1


_bypass = _Bypass()


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for sizes; a symbolic size (a compiled graph's) counts only when the
    equality is known without adding a guard."""
    if type(a) is int and type(b) is int:
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(a == b)


def routable_sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: Any = 0.0, is_causal: Any = False,
                  scale: Any = None, enable_gqa: Any = False) -> bool:
    """Whether an SDPA call (torch's layout: batch, heads, seq, head_dim) is one an attention
    router takes: no mask, no dropout, 4-D, the default scale, one head dim for q, k and v,
    kv heads equal to q's or dividing them under ``enable_gqa``. The tensors may be fake
    (a traced call): heads and head dim must then be concrete, batch and sequence may be
    symbolic, and an argument that is not a constant (a traced value) is not routable."""
    if attn_mask is not None or type(is_causal) is not bool or type(enable_gqa) is not bool:
        return False
    if type(dropout_p) not in (int, float) or dropout_p != 0.0:
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    heads_q, heads_kv, dim = q.shape[1], k.shape[1], q.shape[3]
    fixed = (heads_q, heads_kv, dim, v.shape[1], k.shape[3], v.shape[3])
    if any(type(n) is not int for n in fixed) or fixed[3:] != (heads_kv, dim, dim):
        return False
    if heads_q != heads_kv and not (enable_gqa and heads_q % heads_kv == 0):
        return False
    if not (_same(q.shape[0], k.shape[0]) and _same(k.shape[0], v.shape[0]) and _same(k.shape[2], v.shape[2])):
        return False
    return scale is None or (type(scale) in (int, float) and math.isclose(scale, 1.0 / math.sqrt(dim)))


def torch_attention(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """torch's SDPA on (batch, seq, heads, head_dim) tensors as a program calls it (fewer kv
    heads through ``enable_gqa``), past the overrides."""
    with _bypass:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


class _BackwardEnd(torch.autograd.Function):
    """Identity on q, k, v; its backward (after the attention's) calls ``ended()``."""

    @staticmethod
    def forward(ctx, ended, q, k, v):  # type: ignore[override]
        ctx.ended = ended
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):  # type: ignore[override]
        ctx.ended()
        return None, dq, dk, dv


class _BackwardStart(torch.autograd.Function):
    """Identity on the output; its backward (before the attention's) calls ``started()``."""

    @staticmethod
    def forward(ctx, started, out):  # type: ignore[override]
        ctx.started = started
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        ctx.started()
        return None, dout


def records_backward(q: Any, k: Any, v: Any) -> bool:
    """Whether autograd records this call, so that its backward runs later (and is timed with it)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def timed_attention(run: Callable[[Any, Any, Any], Any], sample: Any, clock: Any, q: Any, k: Any, v: Any) -> Any:
    """``run(q, k, v)`` timed with its backward: ``sample.begin(clock)`` and ``sample.end(clock)``
    around the call and, where autograd records it, around its backward too (two identity nodes
    around the call; ``sample.expect`` 2). None where ``run`` answers None (it declined)."""
    grad = records_backward(q, k, v)
    if grad:
        sample.expect = 2
        q, k, v = _BackwardEnd.apply(lambda: sample.end(clock), q, k, v)
    sample.begin(clock)
    out = run(q, k, v)
    sample.end(clock)
    if out is None or not grad:
        return out
    return _BackwardStart.apply(lambda: sample.begin(clock), out)


class AttentionDispatch(Dispatch):
    """The attention kind's routing (module docstring). Confirmed in the step with its backward:
    a timed call's backward runs between two identity nodes that mark it (:func:`timed_attention`)."""

    def attend(self, q: Any, k: Any, v: Any, causal: bool, baseline: Callable[[Any, Any, Any], Any]) -> Any:
        """Attention on (batch, seq, heads, head_dim) tensors: the routed choice, else
        ``baseline(q, k, v)``."""
        if self.router is None:
            return baseline(q, k, v)
        router = self.router
        key, run = router.route(q, k, v, causal)
        if not callable(run):
            return self.answer(key, run, lambda: baseline(q, k, v))

        def bypassing() -> Any:
            with _bypass:
                return run()

        if self.interposer is None:
            return self.answer(key, bypassing, lambda: baseline(q, k, v))

        def choice(a: Any, b: Any, c: Any) -> Any:  # the cache's router (pure) on these tensors
            with _bypass:
                return router.route(a, b, c, causal)[1]()

        def timed(is_choice: bool, sample: Any, clock: Any) -> Any:
            side = (lambda a, b, c: self.guarded(key, lambda: choice(a, b, c))) if is_choice else baseline
            return timed_attention(side, sample, clock, q, k, v)

        return self.answer(key, bypassing, lambda: baseline(q, k, v), timed=timed, pairing=records_backward(q, k, v))

    def baseline_solution(self, name: str) -> dict[str, Any]:
        """torch's own SDPA (``sdpa:default``): what a dropped choice's entry becomes."""
        return {"config": choice_solution(DEFAULT, None), "blob": b""}

    def may_route(self, q: Any, k: Any, v: Any, causal: bool) -> bool:
        """Whether the router may answer such a call (fake tensors of a traced one included)."""
        return self.router is not None and self.router.may_route(q, k, v, causal)

    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        """The override of ``aten::scaled_dot_product_attention``."""

        def torch_call() -> Any:
            return _SDPA.decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

        if self.router is None or bypassed() or torch._C._len_torch_dispatch_stack():  # a routed call's own, tracing
            return torch_call()
        if type(q) not in PLAIN or type(k) not in PLAIN or type(v) not in PLAIN:
            return torch_call()
        if not routable_sdpa(q, k, v, attn_mask, dropout_p, bool(is_causal), scale, enable_gqa):
            return torch_call()
        def baseline(a: Any, b: Any, c: Any) -> Any:  # torch's SDPA, as the program called it
            return _SDPA.decompose(a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), attn_mask, dropout_p,
                                   is_causal, scale=scale, enable_gqa=enable_gqa).transpose(1, 2)

        # (batch, heads, seq, dim) -> the routers' (batch, seq, heads, dim) views, and back
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(is_causal), baseline)
        return out.transpose(1, 2)

    def overrides(self, lib: torch.library.Library, key: str) -> None:
        lib.impl("scaled_dot_product_attention", self.sdpa, "Autograd" + key)
        lib.impl("scaled_dot_product_attention", self.sdpa, key)

    def compile_pass(self) -> InductorPass | None:
        define_ops()
        return InductorPass.install("pre_grad_custom_pass", rewrite_attention, "primus_perf.routed_attention",
                                    "attention calls", (__file__,))


_graphs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}  # ticket -> (output, q k v leaves)
_tickets = itertools.count()
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
    """The dispatch's answer (router's layout), else torch's SDPA as the program called it."""
    return of(ATTENTION.name).attend(q, k, v, causal, lambda a, b, c: torch_attention(a, b, c, causal))


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _attention_like(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as the ops' outputs are made


@functools.cache
def define_ops() -> None:
    """Register the custom ops ``primus_perf::routed_attention*`` (once)."""
    # flexible_layout: Inductor passes the tensors as they are (no copy the kept graph would
    # not see); cudagraph_unsafe: kept out of CUDA graphs, whose replay would skip the Python
    # that keeps and finds each call's autograd graph (a tag this torch lacks is left out)
    flexible = tuple(getattr(torch._C.Tag, name) for name in ("flexible_layout", "cudagraph_unsafe")
                     if hasattr(torch._C.Tag, name))

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


_SDPA_CALLS = (F.scaled_dot_product_attention, _SDPA)
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
        if node.op != "call_function" or node.target not in _SDPA_CALLS:
            continue
        try:
            args = _sdpa_args(*node.args, **node.kwargs)
        except TypeError:
            continue
        values = tuple(_value(a) for a in args)
        out = _value(node)
        if not all(type(t) is FakeTensor for t in (*values[:3], out)) or not routable_sdpa(*values):
            continue
        # the router is asked about the call it would see: the routers' layout, in the dtype
        # SDPA computes in; without a tuned choice the call stays Inductor's, fusions included
        if not of(ATTENTION.name).may_route(*(t.to(out.dtype).transpose(1, 2) for t in values[:3]), values[5]):
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
