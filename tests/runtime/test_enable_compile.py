"""primus_perf.enable under torch.compile on the CPU: the SDPA calls of a compiled model
(``enable_fakes.Block``) go to the attention router forward and backward (its cached choices
run the fp32 reference as a kernel that counts its launches), with the uncompiled model's
results and no graph break, under Inductor (where this machine has a C++ compiler) and
under AOTAutograd with the same pre-grad rewrite; online tuning times the compiled calls'
forward and backward; without an attention router nothing is rewritten, and calls no
router takes stay torch's."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import primus_perf
from enable_fakes import (
    BLOCK_ATTENTION,
    COUNTED_KINDS,
    Block,
    FakeClock,
    attention_entry,
    attention_launched,
    gemm_entry,
    run,
)
from primus_perf.base.devices import current_device
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.attention.backends import DEFAULT
from primus_perf.kernels.attention.configs import AttnConfig, BwdConfig, FwdConfig
from primus_perf.kernels.attention.router import AttentionChoice, AttentionRouter
from primus_perf.kernels.gemm import problem_of
from primus_perf.problems import AttentionProblem
from primus_perf.runtime import attention as compiled_routes
from primus_perf.runtime import dispatch
from primus_perf.runtime.attention import rewrite_attention, torch_attention
from primus_perf.tuner.attention.online import AttentionOnline
from primus_perf.tuner.online import Pooled

ROUTED_OPS = {"primus_perf.routed_attention.default", "primus_perf.routed_attention_forward.default"}


def inductor(gm, example_inputs):
    """Inductor, with its pre-grad passes: the path ``torch.compile(model)`` takes."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def aot_with_rewrite(gm, example_inputs):
    """``aot_eager`` (AOTAutograd without Inductor's code generation: no C++ compiler
    needed) after the pre-grad pass Inductor runs while enabled."""
    from torch._inductor import config

    if config.pre_grad_custom_pass is not None:
        config.pre_grad_custom_pass(gm.graph)
        gm.recompile()
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _backend(name: str):
    if name == "inductor" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler for Inductor's CPU code here")
    return {"inductor": inductor, "aot": aot_with_rewrite}[name]


def _counting(backend):
    graphs: list = []

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return backend(gm, example_inputs)

    return compile_graph, graphs


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache.json"
    TuningCache(path).put(attention_entry(BLOCK_ATTENTION, current_device()))
    return path


@pytest.mark.parametrize("backend", ["aot", "inductor"])
def test_compiled_attention_routes_forward_and_backward(cache: Path, backend: str) -> None:
    """Forward and backward on the router, the uncompiled results, one graph; the kept
    autograd graph is dropped after the backward, or with the output when none runs."""
    torch.manual_seed(0)
    kept = len(compiled_routes._graphs)  # another test's, alive
    model, x = Block(), torch.randn(2, 8, 32)
    ref_y, ref_g = run(model, x)
    compile_graph, graphs = _counting(_backend(backend))
    key = BLOCK_ATTENTION.key()
    torch._dynamo.reset()
    attention_launched.clear()
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", router_kinds=COUNTED_KINDS,
                            log=None) as tuned:
        compiled = torch.compile(model, backend=compile_graph, fullgraph=True)  # a graph break would raise
        y, g = run(compiled, x)
        assert dict(attention_launched) == {(key, "forward"): 1, (key, "backward"): 1}
        assert tuned.summary()["attention"]["problems"] == {"routed": {key: 1}, "fallback": {}}
        assert len(compiled_routes._graphs) == kept  # the backward ran the kept graph and dropped it
        out = compiled(x)  # a forward whose backward never runs
        assert len(compiled_routes._graphs) == kept + 1
        del out
        assert len(compiled_routes._graphs) == kept
        with torch.no_grad():  # recompiled without autograd: the forward-only op, nothing kept
            torch.testing.assert_close(compiled(x), ref_y, rtol=1e-5, atol=1e-5)
        assert len(compiled_routes._graphs) == kept
        assert dict(attention_launched) == {(key, "forward"): 3, (key, "backward"): 1}
    torch._dynamo.reset()
    assert len(graphs) == 2  # one graph with grad, one without
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    for got, want in zip(g, ref_g):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_an_sdpa_choice_runs_its_backward_through_the_kept_graph(cache: Path) -> None:
    """The real router with an SDPA choice (``sdpa:math``): its backward is recorded by
    aten's autograd inside the custom op's kernel, which therefore runs as an eager call."""
    torch.manual_seed(3)
    model, x = Block(), torch.randn(2, 8, 32)
    ref_y, ref_g = run(model, x)
    torch._dynamo.reset()
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", log=None) as tuned:
        y, g = run(torch.compile(model, backend=aot_with_rewrite, fullgraph=True), x)
        s = tuned.summary()["attention"]
    torch._dynamo.reset()
    assert s["routed"] == 1 and s["fallback"] == 0
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    for got, want in zip(g, ref_g):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_backward_runs_the_forward_again_on_inputs_that_are_not_the_forwards_memory(cache: Path) -> None:
    """AOTAutograd's partitioner may recompute a cheap producer of q for the backward, and
    Inductor may then reuse the forward's buffer of q, which the kept graph reads: given a q
    that is not the forward's memory, the backward op runs the forward again on it."""
    from primus_perf.kernels.attention.reference import reference_attention

    compiled_routes.define_ops()
    ops = torch.ops.primus_perf
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 8, h, 8) for h in (4, 2, 2))  # the routers' layout
    do = torch.randn(2, 8, 4, 8)
    recomputed = q.clone()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(reference_attention(*leaves, causal=True), leaves, do)
    key = BLOCK_ATTENTION.key()
    attention_launched.clear()
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", router_kinds=COUNTED_KINDS, log=None):
        out, ticket = ops.routed_attention_forward(q, k, v, True)
        q.data.zero_()  # the forward's buffer, reused by Inductor (no version counter bump)
        got = ops.routed_attention_backward(do, ticket, recomputed, k, v, out, True)
    assert dict(attention_launched) == {(key, "forward"): 2, (key, "backward"): 1}
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter (CPU) only")
def test_a_cached_triton_choice_runs_its_kernels_forward_and_backward(tmp_path: Path) -> None:
    """The real router with a Triton choice, on the CPU interpreter (fp16: it has no bf16
    dot): the compiled call runs the Triton forward and its backward the Triton backward,
    within the kernel's error of eager SDPA."""
    pytest.importorskip("triton")

    p = AttentionProblem(1, 4, 2, 48, 48, 32, "f16", True, "bshd")
    choice = AttentionChoice("triton", AttnConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 16, 16, 4, 1)))
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(attention_entry(p, current_device(), choice=choice))
    torch.manual_seed(4)
    qkv = [torch.randn(1, h, 48, 32, dtype=torch.float16, requires_grad=True) for h in (4, 2, 2)]
    do = torch.randn(1, 4, 48, 32, dtype=torch.float16)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def rel(got, want):
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    ref = attend(*qkv)
    ref_grads = torch.autograd.grad(ref, qkv, do)
    torch._dynamo.reset()
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", log=None) as tuned:
        out = torch.compile(attend, backend=_backend("inductor"), fullgraph=True)(*qkv)
        grads = torch.autograd.grad(out, qkv, do)
        s = tuned.summary()["attention"]
    torch._dynamo.reset()
    assert s["routed"] == 1 and s["fallback"] == 0 and not s["failed"]
    assert rel(out, ref) < 2e-3 and all(rel(g, r) < 2e-3 for g, r in zip(grads, ref_grads))


def test_dynamic_shapes_route_each_sequence_length(tmp_path: Path) -> None:
    """Batch and sequence symbolic (one graph for two lengths): each call's problem is
    routed by its own shapes at run time."""
    short, long = AttentionProblem(2, 4, 2, 8, 8, 8, "f32", True, "bshd"), \
        AttentionProblem(2, 4, 2, 16, 16, 8, "f32", True, "bshd")
    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([attention_entry(p, current_device()) for p in (short, long)])
    torch.manual_seed(1)
    model = Block()
    xs = [torch.randn(2, seq, 32) for seq in (8, 16)]
    refs = [model(x) for x in xs]
    compile_graph, graphs = _counting(aot_with_rewrite)
    torch._dynamo.reset()
    attention_launched.clear()
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", router_kinds=COUNTED_KINDS, log=None):
        compiled = torch.compile(model, backend=compile_graph, dynamic=True, fullgraph=True)
        for x, ref in zip(xs, refs):
            torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    assert len(graphs) == 1
    assert attention_launched[short.key(), "forward"] == 1 and attention_launched[long.key(), "forward"] == 1


def test_autocast_inputs_are_cast_as_sdpa_would_cast_them(tmp_path: Path) -> None:
    """Under autocast SDPA computes in the autocast dtype; the routed op gets its inputs
    in that dtype, so the router sees the bf16 problem."""
    bf16 = AttentionProblem(2, 4, 2, 8, 8, 8, "bf16", True, "bshd")
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(attention_entry(bf16, current_device()))

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = torch.randn(2, 4, 8, 8), torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = attend(q, k, v)
    torch._dynamo.reset()
    attention_launched.clear()
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", router_kinds=COUNTED_KINDS, log=None), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(attend, backend=aot_with_rewrite, fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    assert ref.dtype == out.dtype == torch.bfloat16
    assert dict(attention_launched) == {(bf16.key(), "forward"): 1}
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


SPEED = {"torch": 1.0, "fast": 0.7, "slow": 3.0}  # ms per forward
BACKEND = {"torch": "sdpa:default", "fast": "sdpa:math", "slow": "sdpa:flash"}


class FakeAttentionOnline(AttentionOnline):
    """The real attention adapter (its ``timed`` marks the backward around the kernel's) with
    a fake pool: torch's SDPA whose forward advances the clock by the candidate's time."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock

    def pool(self, problem, q, k, v, causal):
        def runner(name):
            def attend(q, k, v, causal):
                self.clock.now += SPEED[name] * 1e-3
                return torch_attention(q, k, v, causal)
            return attend

        return [Pooled(n, {"config": {"backend": BACKEND[n]}, "blob": b""}, 0.0, runner(n)) for n in SPEED]


def test_online_tuning_times_compiled_forward_and_backward(tmp_path: Path) -> None:
    """A sample of an attention call is complete only when its backward's marks are in: the
    problem locks the fastest candidate only if the compiled backward ran the kept graph
    (without it, no sample would complete and the bound would keep torch's default)."""
    clock = FakeClock(lag=2)
    torch.manual_seed(2)
    model, x = Block(), torch.randn(2, 8, 32)
    torch._dynamo.reset()
    with primus_perf.enable(tmp_path / "online.json", online=True, kinds=("attention",), device_type="cpu",
                            router_kinds=COUNTED_KINDS, online_options={"adapters": {"attention": FakeAttentionOnline(clock)},
                                                                        "clock": clock}, log=None) as tuned:
        compiled = torch.compile(model, backend=aot_with_rewrite, fullgraph=True)
        for _ in range(30):  # warm-up calls, then pairs against torch's default
            run(compiled, x)
            for _ in range(clock.lag):  # the step goes on: its marks complete, as device events do
                clock.mark()
        s = tuned.summary()["attention"]
    torch._dynamo.reset()
    info = s["online"][BLOCK_ATTENTION.key()]
    assert info["chosen"] == "fast" and info["dropped"] == ["slow"] and info["in_step"]["verdict"] == "kept", info
    assert s["tuning"][BLOCK_ATTENTION.key()] < 18  # locked on complete samples, before the bound
    assert [e.solution["config"]["backend"] for e in TuningCache(tmp_path / "online.json").entries("attention")] \
        == ["sdpa:math"]


def _dynamo_graph(fn, *args):
    graphs: list = []

    def capture(gm, _example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=capture, fullgraph=True)(*args)
    torch._dynamo.reset()
    return graphs[0]


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_rewrite_takes_only_the_calls_a_router_takes() -> None:
    q, k = torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(2, 2, 8, 8, requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    compiled_routes.define_ops()

    def untouched(q, k):
        return (F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
                + F.scaled_dot_product_attention(q, k, k, dropout_p=0.1, enable_gqa=True)
                + F.scaled_dot_product_attention(q, k, k, scale=0.5, enable_gqa=True)
                + F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1)[..., :4])[..., :1]
                + F.scaled_dot_product_attention(q[0], k[0], k[0], enable_gqa=True))

    gm = _dynamo_graph(untouched, q, k)
    before = _targets(gm)
    rewrite_attention(gm.graph)
    assert _targets(gm) == before and not ROUTED_OPS & set(before)

    def routable(q, k):
        return F.scaled_dot_product_attention(q, k, k, scale=8 ** -0.5, is_causal=True, enable_gqa=True)

    problem = AttentionProblem(batch=2, heads_q=4, heads_kv=2, seq_q=8, seq_kv=8, head_dim=8, dtype="f32",
                               causal=True, layout="bshd")
    tuned = AttentionChoice("triton", AttnConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 16, 16, 4, 1)))
    for choices, rewritten in (({}, False), ({problem.key(): AttentionChoice(DEFAULT)}, False),
                               ({problem.key(): tuned}, True)):
        # untuned, or torch's default measured fastest: Inductor keeps its own attention
        attention = dispatch.of("attention")
        attention.install(AttentionRouter(choices))
        try:
            gm = _dynamo_graph(routable, q, k)
            rewrite_attention(gm.graph)
        finally:
            attention.install(None)
        gm.recompile()
        targets = _targets(gm)
        assert ("primus_perf.routed_attention_forward.default" in targets) is rewritten, choices
        assert any("scaled_dot_product_attention" in t for t in targets) is not rewritten
    torch.testing.assert_close(gm(q, k)[0], routable(q, k))  # no router installed now: torch's SDPA


def test_pass_is_installed_with_the_attention_router_only(cache: Path) -> None:
    from torch._inductor import config

    # a GEMM entry that routes (a cache of torch's choices only installs no GEMM override or pass)
    TuningCache(cache).put(gemm_entry(problem_of(torch.randn(3, 5), torch.randn(5, 7)), current_device()))
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=COUNTED_KINDS, log=None):
        assert config.pre_grad_custom_pass is None  # no attention router: compiled graphs keep their SDPA calls
        assert config.post_grad_custom_post_pass is not None
    with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", router_kinds=COUNTED_KINDS, log=None):
        assert config.pre_grad_custom_pass.uuid().startswith("primus_perf.routed_attention/")
        assert config.post_grad_custom_post_pass is None
    assert config.pre_grad_custom_pass is None and config.post_grad_custom_post_pass is None


def test_another_pre_grad_pass_is_left_in_place_with_a_warning(cache: Path) -> None:
    from torch._inductor import config

    def theirs(graph):
        pass

    config.pre_grad_custom_pass = theirs
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with primus_perf.enable(cache, kinds=("attention",), device_type="cpu", router_kinds=COUNTED_KINDS,
                                    log=None):
                assert config.pre_grad_custom_pass is theirs
        assert config.pre_grad_custom_pass is theirs
        assert [str(w.message) for w in seen] == [
            "an Inductor pre_grad_custom_pass is already set; compiled attention calls are not routed"]
    finally:
        config.pre_grad_custom_pass = None


def test_routed_attention_ops_stay_out_of_cuda_graphs() -> None:
    """A CUDA graph's replay would skip the Python that keeps each call's autograd graph."""
    compiled_routes.define_ops()
    for name in ("routed_attention", "routed_attention_forward", "routed_attention_backward"):
        tags = getattr(torch.ops.primus_perf, name).default.tags
        assert torch._C.Tag.cudagraph_unsafe in tags and torch._C.Tag.flexible_layout in tags, name


def test_a_torch_without_inductors_pass_api_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch._inductor.custom_graph_pass", None)
    with pytest.warns(UserWarning, match="custom passes are not available.*compiled attention calls are not routed"):
        assert dispatch.InductorPass.install("pre_grad_custom_pass", lambda graph: None, "t",
                                             "attention calls", ()) is None
