"""Synthetic H200 traces of a plain Hugging Face transformers training script, built from the
real op structure.

transformers' own Qwen2 (its RMSNorm, SwiGLU, rotary embedding, SDPA or eager attention, its
loss) is built tiny and trained on the CPU under torch.profiler the way ``primus-profile run --
train.py`` records a script: bf16 parameters (or fp32 under ``torch.autocast``), micro-batch 2 x
4 gradient-accumulation steps, a foreach AdamW, each step marked from an optimizer post hook
(so the next step's marker opens inside the optimizer step's annotation, as in the H200 run
whose fusion advice read "57 chains ... move 0.0 GB"). Optionally FSDP2's hooks: their places
recorded by hooks on the layers, expanded here into FSDP2's ops as an H200 trace shows them
(the shards' copy into the all-gather's buffer, the all-gather, the copy out; the gradients'
copy into the reduce-scatter's buffer, the reduce-scatter, the sharded gradients'
accumulation), over 2 ranks.

Then each tiny size is mapped to Qwen2's 7B size (hidden 3,584, intermediate 18,944, 28 heads
and 4 kv heads of 128, vocabulary 152,064, sequences of 2,048) and each op that launches a
kernel on a GPU gets a CUDA launch and a kernel, timed at the rates the same script's real
H200 trace ran (torch 2.11, transformers 5.17; 337 ms a step): GEMMs at 75% of the bf16 peak,
cuDNN's causal attention at 42% forward and 32% backward, elementwise kernels at their ops'
bandwidths (2.5-4.1 TB/s), the loss's log-softmax at 2.0 TB/s, the foreach AdamW's kernels at
3.0 TB/s; FSDP2's all-gathers, reduce-scatters and copies as long as that run's over 2 H200s
took for a layer's parameters and for the root's (a line through the two). The
host launches one kernel every 8 us and waits at each ``.item()`` of a device tensor until the
GPU drains (transformers' mask check, once per micro-batch).
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import tempfile
from pathlib import Path
from typing import Any

TINY = {"hidden_size": 336, "intermediate_size": 200, "num_attention_heads": 28, "num_key_value_heads": 4,
        "head_dim": 12, "vocab_size": 1000}
LAYERS, SEQ, MB, ACCUM = 4, 64, 2, 4
# tiny size -> Qwen2's 7B size (hidden, intermediate, head dim and half of it, kv projection,
# vocabulary, sequence, the padded labels, a micro-batch's tokens)
SCALE = {336: 3584, 200: 18944, 12: 128, 6: 64, 48: 512, 1000: 152064, 64: 2048, 65: 2049, 128: 4096}
H, INTER, V, KV = 3584, 18944, 152064, 512
LAYER_PARAMS = 2 * H * H + 2 * KV * H + 3 * H * INTER + 2 * H + H + 2 * KV  # q, o; k, v; MLP; norms; biases
ROOT_PARAMS = 2 * V * H + H  # embedding, lm_head, the final norm
PARAMS = LAYERS * LAYER_PARAMS + ROOT_PARAMS
H200 = {"id": 0, "name": "NVIDIA H200", "totalGlobalMem": 150754820096, "computeMajor": 9, "computeMinor": 0,
        "numSms": 132}
PEAK_BF16 = 989.4e12
GEMM_FRACTION = 0.75
ATTENTION_FRACTION = {"fwd": 0.42, "bwd": 0.32}
# TB/s each op's kernels ran at on the H200 (bytes as read and written)
BANDWIDTH = {"aten::mul": 2.9, "aten::copy_": 2.5, "aten::add_": 4.1, "aten::fill_": 4.1, "aten::add": 3.0,
             "aten::silu": 3.6, "aten::silu_backward": 3.8, "aten::div": 3.2, "aten::pow": 3.8, "aten::neg": 1.45,
             "aten::cat": 2.5, "aten::_log_softmax": 2.0,
             "aten::mean": 2.7, "aten::sum": 2.7, "aten::_softmax": 2.0, "aten::_softmax_backward_data": 2.0,
             "aten::_log_softmax_backward_data": 3.0}
REDUCES = {"aten::mean", "aten::sum"}  # their output is small
GATHERS = {"aten::nll_loss_forward", "aten::nll_loss_backward", "aten::gather", "aten::index_select"}  # rows only
FOREACH_TBS = 3.0
# foreach AdamW's element accesses per op (read + written)
FOREACH_ACCESSES = {"aten::_foreach_lerp_": 3, "aten::_foreach_mul_": 2, "aten::_foreach_addcmul_": 3,
                    "aten::_foreach_sqrt": 2, "aten::_foreach_div_": 2, "aten::_foreach_add_": 2,
                    "aten::_foreach_addcdiv_": 4}
ELEM = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "bool": 1}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
CPU_ATTENTION = {"aten::_scaled_dot_product_flash_attention_for_cpu": "fwd",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "bwd"}
# ops whose CPU kernels call other ops (type promotion, a reduction's fill, the foreach fallback)
# that a GPU runs in one kernel of their own
ONE_KERNEL = {"aten::mul", "aten::add", "aten::sub", "aten::div", "aten::pow", "aten::rsqrt", "aten::neg",
              "aten::silu", "aten::silu_backward", "aten::mul_", "aten::add_", "aten::div_", "aten::sub_", "aten::mean",
              "aten::sum", "aten::where", "aten::masked_fill", "aten::embedding_dense_backward", "aten::cumsum",
              "aten::_log_softmax", "aten::_softmax", "aten::lerp_", "aten::addcmul_", "aten::addcdiv_", "aten::sqrt",
              "aten::cat", "aten::arange"}
NO_KERNEL = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::t", "aten::transpose",
             "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::expand_as", "aten::slice",
             "aten::select", "aten::narrow", "aten::as_strided", "aten::split", "aten::split_with_sizes", "aten::chunk",
             "aten::unbind", "aten::detach", "aten::detach_", "aten::alias", "aten::lift_fresh", "aten::empty",
             "aten::empty_like", "aten::empty_strided", "aten::resize_", "aten::result_type", "aten::resolve_conj",
             "aten::resolve_neg", "aten::dropout", "aten::item", "aten::is_nonzero", "aten::contiguous",
             "aten::_local_scalar_dense", "aten::size", "aten::numel", "aten::to", "aten::_to_copy", "aten::lift",
             "aten::movedim", "aten::flatten", "aten::view_as", "aten::_has_compatible_shallow_copy_type"}
GEMM_KERNEL = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT"
ATTENTION_KERNEL = {"fwd": "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1"
                           "_kernel0_0",
                    "bwd": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_1x4x1_cga1x1x1"
                           "_kernel0_0"}
FOREACH_KERNEL = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
                  "TensorListMetadata<3>, at::native::(anonymous namespace)::PointwiseOpScalarFunctor<{t}, 3, 3, 0>>")
ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
REDUCE_SCATTER = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
COMPUTE, GATHER_STREAM, REDUCE_STREAM = 7, 19, 23
LAUNCH_US, OP_US = 8.0, 20.0  # the host's time per launch and per op (Python, dispatch)


# --------------------------------------------------------------------------- the CPU recording

@functools.cache
def record(autocast: bool = False, attn: str = "sdpa", fsdp: bool = False,
           checkpointing: bool = False) -> tuple[dict[str, Any], ...]:
    """The host events of two optimizer steps of the tiny model on the CPU (see the module
    docstring), as torch.profiler wrote them; ``checkpointing``: transformers' gradient
    checkpointing on (each decoder layer's forward run again in the backward pass)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**TINY, num_hidden_layers=LAYERS, attn_implementation=attn, use_cache=False,
                                   max_position_embeddings=2 * SEQ)
    model = transformers.Qwen2ForCausalLM(cfg)
    if not autocast:
        model = model.to(torch.bfloat16)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if fsdp:
        _fsdp_places(model)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, TINY["vocab_size"], (MB, SEQ), generator=gen) for _ in range(ACCUM)]

    def step() -> None:
        for x in ids:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=x, labels=x).loss / ACCUM
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cpu.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                    schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1),
                                    on_trace_ready=lambda p: p.export_chrome_trace(str(out))) as prof:
            hook = opt.register_step_post_hook(lambda *_: prof.step())  # as primus-profile run marks steps
            for _ in range(3):
                step()
            hook.remove()
        events = json.loads(out.read_text())["traceEvents"]
    return tuple(e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"))


def _fsdp_places(model: Any) -> None:
    """Empty annotations where FSDP2's hooks run (their ops are added by :func:`gpu_trace`):
    each layer's pre-forward and pre-backward (an all-gather each: reshard after forward) and
    post-backward reduction, the root's at the model's forward and at the backward's end."""
    import torch
    from torch.autograd.profiler import record_function

    def mark(name: str) -> None:
        with record_function(name):
            pass

    def root_pre(_module: Any, _args: Any) -> None:
        mark("FSDP::root_pre_forward")

    model.register_forward_pre_hook(root_pre)
    model.model.embed_tokens.weight.register_post_accumulate_grad_hook(
        lambda _p: mark("FSDP::root_post_backward_callback"))
    for i, layer in enumerate(model.model.layers):
        def pre(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
            mark(f"FSDP::pre_forward (model.layers.{i})")
            x = args[0] if args else kwargs["hidden_states"]
            if x.requires_grad:
                x.register_hook(lambda g, i=i: mark(f"FSDP::post_backward_reduce (model.layers.{i})"))

        def post(_m: Any, _args: Any, _kwargs: Any, out: Any, i: int = i) -> None:
            y = out[0] if isinstance(out, tuple) else out
            if isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(lambda g, i=i: mark(f"FSDP::pre_backward (model.layers.{i})"))

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)


# --------------------------------------------------------------------------- to a GPU trace

def _scale(v: Any) -> Any:
    if isinstance(v, list):
        return [_scale(x) for x in v]
    return SCALE.get(v, v) if type(v) is int else v


def _tree(events: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The host events as a forest (each node a copy with ``kids``), per thread in start order."""
    roots: list[dict[str, Any]] = []
    stack: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (str(e["tid"]), e["ts"], -e["dur"])):
        node = {**e, "args": dict(e.get("args") or {}), "kids": []}
        while stack and (stack[-1]["tid"] != e["tid"] or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        (stack[-1]["kids"] if stack else roots).append(node)
        stack.append(node)
    return sorted(roots, key=lambda n: n["ts"])


def _numel(d: Any) -> int:
    return math.prod(d) if isinstance(d, list) and d and all(type(x) is int for x in d) else 0


def _tensors(n: dict[str, Any]) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each tensor input (a tensor list's summed)."""
    dims, types = n["args"].get("Input Dims") or [], n["args"].get("Input type") or []
    out = []
    for d, t in zip(dims, types, strict=False):
        if _numel(d):
            out.append((_numel(d), ELEM.get(t, 2)))
        elif isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            out.append((sum(_numel(x) for x in d), 2))
    return out


def _gemm_us(n: dict[str, Any]) -> float:
    dims = [d for d in (n["args"].get("Input Dims") or []) if isinstance(d, list) and len(d) >= 2]
    if n["name"] == "aten::addmm":
        dims = dims[-2:]
    if len(dims) < 2:
        return 5.0
    a, b = dims[0], dims[1]
    batch = math.prod(a[:-2]) if len(a) > 2 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1] / (GEMM_FRACTION * PEAK_BF16) * 1e6 + 4.0


def _memory_us(n: dict[str, Any]) -> float:
    t = _tensors(n)
    if not t:
        return 3.0
    if n["name"] in GATHERS:
        return 20.0
    read = sum(e * b for e, b in t)
    written = 0 if n["name"] in REDUCES else max(t)[0] * t[0][1]
    if n["name"] in ("aten::copy_", "aten::fill_", "aten::zero_"):
        read -= t[0][0] * t[0][1]  # the destination is written, not read
    return (read + written) / (BANDWIDTH.get(n["name"], 3.0) * 1e12) * 1e6 + 3.0


def _attention(n: dict[str, Any], direction: str) -> tuple[dict[str, Any], float]:
    """The CPU flash op as cuDNN's (its name and inputs, ``torch 2.11``'s schema), and its time."""
    a = n["args"]
    dims, concrete = a.get("Input Dims") or [], a.get("Concrete Inputs") or []
    causal = str(concrete[4 if direction == "fwd" else 7] if len(concrete) > 7 or direction == "fwd" else "True")
    q, k = (dims[0], dims[1]) if direction == "fwd" else (dims[1], dims[2])
    bf16 = "c10::BFloat16"
    if direction == "fwd":
        name = "aten::_scaled_dot_product_cudnn_attention"
        args = {"Input Dims": [q, k, k, [], [], [], [], [], []],
                "Input type": [bf16] * 3 + ["", "Scalar", "Scalar", "Scalar", "Scalar", ""],
                "Concrete Inputs": ["", "", "", "", "True", "0.", causal, "False", ""]}
    else:
        name = "aten::_scaled_dot_product_cudnn_attention_backward"
        args = {"Input Dims": [q, q, k, k, q, [q[0], q[1], q[2], 1]] + [[]] * 10,
                "Input type": [bf16] * 5 + ["float"] + [""] * 10,
                "Concrete Inputs": [""] * 14 + [causal, ""]}
    b, h, s, d = q
    pairs = s * (s + 1) // 2 if causal.lower() == "true" else s * s
    flops = 4 * b * h * pairs * d * (2.5 if direction == "bwd" else 1)
    return {**n, "name": name, "args": args, "kids": []}, flops / (ATTENTION_FRACTION[direction] * PEAK_BF16) * 1e6


class _Sim:
    """The host and GPU clocks: the host launches in order, each kernel starts at the later of
    its launch and its stream's previous kernel."""

    def __init__(self, t0: float) -> None:
        self.h = t0
        self.tid = 1  # the host thread launching now (the autograd engine's device thread: 2)
        self.free: dict[int, float] = {}
        self.out: list[dict[str, Any]] = []
        self.corr = 0
        self.last_end = t0

    def launch(self, name: str, dur: float, stream: int = COMPUTE, after: float = 0.0, kind: str = "kernel") -> float:
        self.corr += 1
        self.out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel" if kind == "kernel"
                         else "cudaMemcpyAsync", "pid": 1, "tid": self.tid, "ts": self.h, "dur": 4.0,
                         "args": {"correlation": self.corr}})
        start = max(self.h + 5.0, self.free.get(stream, 0.0), after)
        self.out.append({"ph": "X", "cat": "kernel" if kind == "kernel" else "gpu_memcpy", "name": name, "pid": 0,
                         "tid": stream, "ts": start, "dur": dur,
                         "args": {"correlation": self.corr, "stream": stream, "device": 0}})
        self.free[stream] = start + dur
        self.last_end = max(self.last_end, start + dur)
        self.h += LAUNCH_US
        return start + dur

    def sync(self) -> None:
        end = max(self.free.values(), default=self.h)
        wait = max(self.h, end) + 3.0 - self.h
        self.out.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1, "tid": self.tid,
                         "ts": self.h, "dur": wait, "args": {}})
        self.h += wait


def _foreach(sim: _Sim, n: dict[str, Any], elements: float, dtype: str) -> None:
    size = ELEM[dtype]
    total = FOREACH_ACCESSES.get(n["name"], 2) * elements * size / (FOREACH_TBS * 1e12) * 1e6
    for _ in range(12):  # multi_tensor_apply launches in chunks
        sim.launch(FOREACH_KERNEL.format(t=dtype), total / 12)


class _Fsdp:
    """FSDP2's ops at the places :func:`_fsdp_places` recorded, per group (a layer, or the root)."""

    def __init__(self) -> None:
        self.reduced: dict[str, int] = {}

    @staticmethod
    def _op(name: str, sim: _Sim, dims: list | None = None, cat: str = "cpu_op", **args: Any) -> dict[str, Any]:
        ev = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": sim.tid, "ts": sim.h, "dur": 0.0,
              "args": {**({"Input Dims": dims, "Input type": ["c10::BFloat16"] * len(dims)} if dims else {}), **args}}
        sim.out.append(ev)
        sim.h += OP_US
        return ev

    @staticmethod
    def _close(ev: dict[str, Any], sim: _Sim) -> None:
        sim.h += 1.0
        ev["dur"] = sim.h - ev["ts"]

    def gather(self, sim: _Sim, group: str, full: int, wait: bool) -> None:
        shard = full // 2
        outer = self._op(f"FSDP::all_gather ({group})" if group else "FSDP::all_gather", sim, cat="user_annotation")
        inner = self._op("fsdp::all_gather_copy_in", sim, [[full], [shard]])
        op = self._op("aten::_foreach_copy_", sim, [[], []])
        sim.launch("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
                   "namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<c10::BFloat16>>",
                   3.0 * shard / 1e6)
        for ev in (op, inner):
            self._close(ev, sim)
        c10d = self._op("c10d::_allgather_base_", sim, [[full], [shard], [], [], []])
        rpc = self._op("record_param_comms", sim, [[shard]], **{"Collective name": "_allgather_base",
                                                               "Group size": 2, "In msg nelems": shard,
                                                               "Out msg nelems": full, "dtype": "BFloat16"})
        nccl = self._op("nccl:_all_gather_base", sim, [[shard]], cat="user_annotation")
        done = sim.launch(ALL_GATHER, 1029 + 2.735 * full / 1e6, GATHER_STREAM, after=sim.free.get(COMPUTE, 0.0))
        for ev in (nccl, rpc, c10d, outer):
            self._close(ev, sim)
        out = self._op(f"FSDP::all_gather_copy_out ({group})" if group else "FSDP::all_gather_copy_out", sim,
                       cat="user_annotation")
        inner = self._op("fsdp::split_with_sizes_copy", sim, [[2, shard]])
        op = self._op("aten::split_with_sizes_copy", sim, [[2, shard], [], [], [[2, shard]]])
        sim.launch("at::native::detail::split_with_sizes_copy_out_contiguous_no_cast_kernel(char**, char**, long*, "
                   "long*, long*, long, long)", 1.03 * full / 1e6, after=done if wait else 0.0)
        for ev in (op, inner, out):
            self._close(ev, sim)

    def reduce(self, sim: _Sim, group: str, full: int) -> None:
        shard = full // 2
        inner = self._op("fsdp::chunk_cat", sim, [[2, shard]])
        op = self._op("aten::_chunk_cat", sim, [[2, shard]])
        ready = sim.launch("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<c10::BFloat16>(...)",
                           1.22 * full / 1e6)
        for ev in (op, inner):
            self._close(ev, sim)
        c10d = self._op("c10d::_reduce_scatter_base_", sim, [[shard], [full], [], [], [], []])
        rpc = self._op("record_param_comms", sim, [[full]], **{"Collective name": "_reduce_scatter_base",
                                                              "Group size": 2, "In msg nelems": full,
                                                              "Out msg nelems": shard, "dtype": "BFloat16"})
        nccl = self._op("nccl:_reduce_scatter_base", sim, [[full]], cat="user_annotation")
        done = sim.launch(REDUCE_SCATTER, 1337 + 2.582 * full / 1e6, REDUCE_STREAM, after=ready)
        for ev in (nccl, rpc, c10d):
            self._close(ev, sim)
        if self.reduced.get(group, 0):  # the sharded gradient exists from the second micro-batch on
            op = self._op("aten::add_", sim, [[shard], [shard], []])
            sim.launch("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
                       1.5 * shard / 1e6, REDUCE_STREAM, after=done)
            self._close(op, sim)
        self.reduced[group] = self.reduced.get(group, 0) + 1

    def expand(self, sim: _Sim, name: str) -> None:
        group = name[name.find("(") + 1:-1] if "(" in name else ""
        if name.startswith(("FSDP::pre_forward", "FSDP::pre_backward")):
            self.gather(sim, group, LAYER_PARAMS, wait=name.startswith("FSDP::pre_forward"))
        elif name.startswith("FSDP::post_backward_reduce"):
            self.reduce(sim, group, LAYER_PARAMS)
        elif name == "FSDP::root_pre_forward":
            outer = self._op("FSDP::pre_forward", sim, cat="user_annotation")
            self.gather(sim, "", ROOT_PARAMS, wait=True)
            self._close(outer, sim)
        elif name == "FSDP::root_post_backward_callback":
            outer = self._op("FSDP::post_backward_reduce", sim, cat="user_annotation")
            self.reduce(sim, "", ROOT_PARAMS)
            self._close(outer, sim)


def gpu_trace(path: Path, autocast: bool = False, attn: str = "sdpa", fsdp: bool = False, rank: int = 0,
              masked_compile: bool = False, checkpointing: bool = False) -> Path:
    """The H200 trace of the recording's second optimizer step and the step marker around it
    (see the module docstring), written to ``path``; ``masked_compile``: the attention as a
    whole compiled model runs it (cuDNN with the causal mask as a bias, not causal: at 25% of
    the roofline of the full problem) inside ``Torch-Compiled Region`` annotations."""
    sim = _Sim(1_000_000.0)
    dtype = "float" if autocast else "c10::BFloat16"
    elements = PARAMS / (2 if fsdp else 1)
    fs = _Fsdp()
    events: list[dict[str, Any]] = []
    counted = {"step counters": False}

    def emit(n: dict[str, Any], parent: str = "") -> None:
        name = n["name"]
        outer_tid = sim.tid
        if name.startswith("autograd::engine::evaluate_function"):
            sim.tid = 2  # CUDA's backward runs on the autograd engine's device thread
        ev = {"ph": "X", "cat": n["cat"], "name": name, "pid": 1, "tid": sim.tid, "ts": sim.h, "dur": 0.0,
              "args": {k: _scale(v) if k == "Input Dims" else v for k, v in n["args"].items()
                       if k in ("Input Dims", "Input type", "Concrete Inputs", "Sequence number", "Input Strides")}}
        events.append(ev)
        sim.h += OP_US
        if fsdp and name.startswith("FSDP::"):
            fs.expand(sim, name)
        kids = n["kids"]
        if name in CPU_ATTENTION:
            direction = CPU_ATTENTION[name]
            node, us = _attention({**n, "args": ev["args"]}, direction)
            ev.update(name=node["name"], args=node["args"])
            if masked_compile:
                d = ev["args"]["Input Dims"]
                q = d[0] if direction == "fwd" else d[1]
                d[3 if direction == "fwd" else 8] = [q[0], 1, q[2], q[2]]
                ev["args"]["Input type"][3 if direction == "fwd" else 8] = "c10::BFloat16"
                ev["args"]["Concrete Inputs"][6 if direction == "fwd" else 14] = "False"
                b, h, s, dd = q
                flops = 4 * b * h * s * s * dd * (2.5 if direction == "bwd" else 1)
                us = flops / (0.25 * PEAK_BF16) * 1e6
            sim.launch(ATTENTION_KERNEL[direction], us)
        elif name.startswith("aten::_foreach_"):
            if not (name == "aten::_foreach_add_" and not counted["step counters"]):
                _foreach(sim, n, elements, dtype)
            counted["step counters"] |= name == "aten::_foreach_add_"  # the first: the CPU step counters
        elif name in GEMM_OPS:
            sim.launch(GEMM_KERNEL, _gemm_us({**n, "args": ev["args"]}))
        elif name == "aten::_local_scalar_dense" and parent == "aten::item" and n.get("device_sync"):
            sim.launch("Memcpy DtoH (Device -> Pageable)", 2.0, kind="memcpy")
            sim.sync()
        elif name == "aten::embedding_dense_backward":
            sim.launch("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>>",
                       V * H * 2 / 4.1e12 * 1e6)
            sim.launch("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16>", 60.0)
        elif name in ONE_KERNEL or (not kids and name.startswith("aten::") and name not in NO_KERNEL):
            sim.launch(f"void at::native::vectorized_elementwise_kernel<4, {name.removeprefix('aten::')}_kernel_cuda>",
                       _memory_us({**n, "args": ev["args"]}))
        elif fsdp and name.endswith("torch::autograd::AccumulateGrad"):
            pass  # FSDP2 hands each unsharded gradient to its reduce-scatter: nothing accumulates it here
        else:
            for kid in kids:
                if name == "aten::is_nonzero":
                    kid = {**kid, "device_sync": True, "kids": [{**g, "device_sync": True} for g in kid["kids"]]}
                if kid["name"] == "aten::_local_scalar_dense" and n.get("device_sync"):
                    kid = {**kid, "device_sync": True}
                emit(kid, name)
        sim.h += 1.0
        ev["dur"] = sim.h - ev["ts"]
        sim.tid = outer_tid

    recorded = record(autocast, attn, fsdp, checkpointing)
    optim = sorted((e for e in recorded if e["name"].startswith("Optimizer.step#")), key=lambda e: e["ts"])
    start, stop = optim[-2]["ts"] + optim[-2]["dur"], optim[-1]["ts"]  # the last recorded step
    roots = _tree(tuple(e for e in recorded if not e["name"].startswith("ProfilerStep#")))
    window = [r for r in roots if start <= r["ts"] <= stop]
    # primus-profile run's step marker: opened by the post hook inside the previous optimizer
    # step's annotation, closed by the next one inside this step's
    events.append({"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "pid": 1, "tid": 1,
                   "ts": sim.h - 50.0, "dur": 51.0, "args": {}})
    marker = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "pid": 1, "tid": 1, "ts": sim.h,
              "dur": 0.0, "args": {}}
    events.append(marker)
    sim.h += 5.0
    compiled = False
    for r in window:
        if masked_compile and not compiled and r["name"] == "aten::embedding":
            events.append({"ph": "X", "cat": "user_annotation", "name": "Torch-Compiled Region: 0/0", "pid": 1,
                           "tid": 1, "ts": sim.h, "dur": 1.0, "args": {}})
            compiled = True
        emit(r)
    marker["dur"] = sim.h - marker["ts"]
    next(e for e in reversed(events) if e["name"].startswith("Optimizer.step#"))["dur"] += 60.0
    out = {"schemaVersion": 1, "deviceProperties": [H200], "traceEvents": events + sim.out}
    if fsdp:
        out["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 2}
    path.write_bytes(gzip.compress(json.dumps(out).encode()))
    return path
