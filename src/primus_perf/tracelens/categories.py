"""Kernel categories, decided from the launching op and, as a fallback, the kernel name.

The rules are data: each is a category and a regular expression, tried in order. A GPU
event gets the first category that matches

1. its kind (memcpy, memset),
2. a communication kernel or op (NCCL/RCCL kernels, the kernels of the expert-parallel
   and GPU-initiated communication libraries by namespace: :data:`COMMUNICATION_RULES`;
   ``c10d::``/``nccl:`` ops),
3. the op it is attributed to (a GEMM, convolution or attention op with a perf model) and
   then the op that launched it (the leaf op: ``aten::native_layer_norm``, ``aten::add``,
   ``vllm::unified_attention``, ``aiter::mha_fwd``, ...); an elementwise kernel of an
   elementwise op inside a GEMM op (autocast's weight cast under ``aten::linear``) is
   elementwise, not the GEMM's,
4. an optimizer step around it (``Optimizer.step#...`` annotations, fused ops; ``_foreach_``
   ops in a training trace: in an inference trace they are sampling or other list work, and
   inside FSDP2's hooks the shards' copies into the all-gather's buffer),
5. the kernel name by what it computes (traces without CPU events or with unknown ops:
   flash/aiter/cuDNN/vLLM/FlashInfer attention, cuDNN/MIOpen convolutions, cuBLAS/hipBLASLt
   GEMMs (``nvjet_*``, ``Cijk_*``), batched, grouped and MoE GEMMs (trtllm-gen ``bmm_*``,
   Triton ``*mm*`` templates), norms, ``elementwise_kernel``, ...), and last the template
   library a kernel is built on (CUTLASS/CuTe, CK, XMMA: GEMM),

else "other".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GEMM = "gemm"
CONVOLUTION = "convolution"
ATTENTION_FWD = "attention_fwd"
ATTENTION_BWD = "attention_bwd"
COMMUNICATION = "communication"
MEMCPY = "memcpy"
MEMSET = "memset"
ELEMENTWISE = "elementwise"
NORMALIZATION = "normalization"
REDUCTION = "reduction"
OPTIMIZER = "optimizer"
OTHER = "other"

COMPUTE = frozenset({GEMM, CONVOLUTION, ATTENTION_FWD, ATTENTION_BWD, ELEMENTWISE, NORMALIZATION, REDUCTION,
                     OPTIMIZER, OTHER})
MODELED = frozenset({GEMM, CONVOLUTION, ATTENTION_FWD, ATTENTION_BWD})  # decided by the op when it has a model

DISPATCH, COMBINE, ALL_TO_ALL = "dispatch", "combine", "all_to_all"  # expert-parallel token exchanges


@dataclass(frozen=True)
class CommRule:
    """Kernels that move data between GPUs, recognized by a namespace or token pattern of
    their (demangled) name. ``collective``: what an expert-parallel kernel of the rule does
    (``dispatch``/``combine`` when its name says, else ``all_to_all``), None for the
    collective libraries (their collective comes from the ops and names:
    ``analyses.collectives``); ``reason``: why the pattern is communication."""

    pattern: re.Pattern[str]
    reason: str
    expert_parallel: bool = False


def _rule(rx: str, reason: str, ep: bool = False) -> CommRule:
    return CommRule(re.compile(rx, re.I), reason, ep)


# Communication kernels by rule (first match wins). Kernels of the expert-parallel (EP)
# libraries are named by their C++ namespace, e.g. ``void deep_ep::internode::dispatch<...>(...)``,
# ``deep_ep::intranode::notify_dispatch``, ``deep_ep::internode_ll::combine``,
# ``pplx::(anonymous namespace)::dispatchKernel``, ``mori::moe::EpDispatchIntraNodeKernel``,
# ``mscclpp::ep::internode_ll::dispatch``; whatever a library's namespace holds moves tokens
# or synchronizes ranks, except DeepEP's ``layout`` kernels (local counting of tokens per rank).
COMMUNICATION_RULES: tuple[CommRule, ...] = (
    _rule(r"nccl|rccl|msccl(?!pp)", "NCCL and RCCL (and MSCCL) collective and point-to-point kernels"),
    _rule(r"\bdeep_?ep::(?!layout::)", "DeepEP: expert-parallel dispatch/combine over NVLink and RDMA "
          "(intranode, internode, internode_ll low-latency)", ep=True),
    _rule(r"\buccl\w*::", "UCCL (collectives and UCCL-EP, DeepEP's interface on other NICs/GPUs)", ep=True),
    _rule(r"\bpplx::", "pplx-kernels: MoE all-to-all dispatch/combine over NVSHMEM", ep=True),
    _rule(r"\bmscclpp::", "MSCCL++: GPU-initiated collectives, channels and its EP kernels", ep=True),
    _rule(r"\bmori::|\bEp(Dispatch|Combine)\w*Kernel", "MORI (AMD): EP dispatch/combine over shmem and RDMA",
          ep=True),
    _rule(r"\bnccl_ep::", "NCCL EP: expert-parallel dispatch/combine", ep=True),
    _rule(r"\bnvshmem|\brocshmem|\bishmem", "NVSHMEM/rocSHMEM kernels (puts, gets, barriers, collectives)"),
    _rule(r"\b(intra|inter)node(_ll)?::\w*(dispatch|combine|notify)|low_latency_(dispatch|combine)"
          r"|\bep::\w*(dispatch|combine)|\b(cached_)?notify_(dispatch|combine)\b",
          "an expert-parallel library's intranode/internode/low-latency dispatch or combine kernel", ep=True),
    _rule(r"cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|sendrecv|multimem",
          "vLLM/SGLang/AITER custom all-reduce, symmetric-memory and all-to-all kernels"),
)
COMMUNICATION_KERNEL = re.compile("|".join(f"(?:{r.pattern.pattern})" for r in COMMUNICATION_RULES), re.I)
_EP_KIND = re.compile(r"(?P<combine>combine)|(?P<dispatch>dispatch)", re.I)


def communication_rule(kernel_name: str) -> CommRule | None:
    """The communication rule a kernel name matches, or None."""
    if not COMMUNICATION_KERNEL.search(kernel_name):
        return None
    return next(r for r in COMMUNICATION_RULES if r.pattern.search(kernel_name))


def expert_parallel_kind(kernel_name: str) -> str | None:
    """``dispatch``, ``combine`` or ``all_to_all`` for a kernel of an expert-parallel
    library (the first of the words in the kernel's name before its parameter list, whose
    types may name the other: ``EpDispatchIntraNodeKernel(EpDispatchCombineArgs)``;
    ``all_to_all`` when it says neither), None for any other kernel."""
    rule = communication_rule(kernel_name)
    if rule is None or not rule.expert_parallel:
        return None
    m = _EP_KIND.search(kernel_name.replace("(anonymous namespace)", "").split("(")[0])
    return m.lastgroup if m else ALL_TO_ALL
COMMUNICATION_OP = re.compile(r"^(c10d::|nccl:|gloo:|record_param_comms|_c10d_functional::|c10d_functional::"
                              r"|symm_mem::|vllm::\w*all_reduce|_C_custom_ar::)")

_ATTN = r"(attn|attention|sdpa|fmha|mha|flash|paged_attention|mla_decode)"
# op name -> category (first match wins)
OP_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(rx)) for cat, rx in (
        (ATTENTION_BWD, r"^aten::_(scaled_dot_product|flash|efficient|cudnn)\w*attention\w*backward"
                        r"|^(flash_attn|_flash_attn\w*|aiter|transformer_engine\w*|te|sglang|vllm)::\w*"
                        + _ATTN + r"\w*(bwd|backward)|" + _ATTN + r"\w*(Backward|_bwd)\w*$"
                        r"|^_?flash_attn\w*::\w*(bwd|backward)"),
        (ATTENTION_FWD, r"^aten::(_?scaled_dot_product\w*attention\w*|_flash_attention_forward"
                        r"|_efficient_attention_forward|_cudnn_attention_forward)$"
                        r"|^(flash_attn|_flash_attn\w*|_vllm_fa\d_C|aiter|transformer_engine\w*|te|sglang|vllm|_C"
                        r"|cudnn\w*)::\w*" + _ATTN + r"|^(FlashAttnFunc|FusedAttnFunc|FlashAttnVarlenFunc)$"
                        r"|^_?flash_attn\w*::|^flashinfer::\w*(prefill|decode|attention|mla)"),
        (CONVOLUTION, r"^aten::\w*conv(?!ert)|^(miopen|cudnn)\w*::\w*conv"),
        (GEMM, r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|_addmm_activation"
               r"|_int_mm|_grouped_mm|_scaled_grouped_mm|_weight_int\w*mm\w*)$|^primus_perf::gemm$"
               r"|^(?!aten::)\w+::\w*(gemm|gemv|scaled_mm|grouped_mm|_bmm|_matmul)"),
        (OPTIMIZER, r"^aten::_fused_(adam|adamw|sgd|adagrad)_?|^Optimizer\.step"),
        (NORMALIZATION, r"(batch|layer|group|instance|rms|l2)_?norm"),
        (REDUCTION, r"^aten::(sum|mean|max|min|amax|amin|argmax|argmin|norm|linalg_vector_norm|prod|std"
                    r"|var|cumsum|logsumexp|_?softmax|_?log_softmax|_softmax_backward_data"
                    r"|_log_softmax_backward_data|nll_loss\w*|cross_entropy_loss|topk|sort|all|any|\w*pool\w*"
                    r"|mse_loss_backward|bincount|histc|unique\w*)$"),
        (ELEMENTWISE, r"^aten::"),  # remaining aten ops that launch kernels: copies, pointwise, fills
    )
)

# the kernels that convert a convolution's tensors between NCHW and NHWC (cuDNN's
# ``nchwToNhwcKernel``/``nhwcToNchwKernel`` around its tensor-core kernels on NCHW tensors):
# what a channels_last model does not run
LAYOUT_TRANSPOSE = re.compile(r"nchw_?(?:to|2)_?nhwc|nhwc_?(?:to|2)_?nchw", re.I)

# kernel name -> category, for kernels whose op is unknown or missing: by what the kernel
# computes, its name's own words first (attention, convolution, GEMM, norm, ...), and only
# then the template library it is built on (CUTLASS/CuTe, CK, XMMA: FlashAttention-3's
# ``cutlass::device_kernel<flash::FlashAttnBwd<...>>`` is attention, FlashInfer's CuTe
# RMSNorm a norm, CK's ``ck_tile::kentry<...Rmsnorm2dFwd...>`` a norm)
KERNEL_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(rx, re.I)) for cat, rx in (
        (ATTENTION_BWD, r"flash_bwd|fmha\w*bwd|bprop\w*sdpa|sdpa\w*bprop|attn_bwd|_bwd_preprocess|_bwd_dkdv"
                        r"|_bwd_dq|attention_backward|dot_do_o|convert_dq|mha_bwd|" + _ATTN + r"\w*_bwd"
                        r"|(flash|attn|attention)\w*(bwd|backward)"),
        (ATTENTION_FWD, r"flash_fwd|fmha|fprop\w*sdpa|sdpa|attn_fwd|attention|flash_attn|mha_fwd|paged_attention"
                        r"|_fwd_kernel_stage|decode_attention|mla_|unified_attention|FlashAttn|flashinfer::\w*(Prefill|Decode)"
                        r"|BatchPrefill|BatchDecode|\bflash::"),
        (CONVOLUTION, r"conv(?!ert)|scudnn|winograd|wgrad|dgrad|implicit_?gemm|igemm|miopenSp|xdlops_conv"
                      r"|cudnn::cnn|naive_conv|" + LAYOUT_TRANSPOSE.pattern),
        (GEMM, r"gemm|gemv|nvjet|Cijk_|_mm_|matmul|^bmm_|_bmm_|triton_tem_fused\w*mm|mm_kernel|splitKreduce"
               r"|grouped_mm|moe_align_block|fused_moe_kernel"),
        (OPTIMIZER, r"adam|FusedOptimizer|fused_sgd|multi_tensor_apply_kernel<\w*::?\w*FusedOptimizer"),
        (NORMALIZATION, r"layer_?norm|rms_?norm|GammaBeta|batch_?norm|group_?norm|bn_fw|bn_bw|triton_(red|per)_\w*rsqrt"),
        (REDUCTION, r"reduce|LpNorm|lpnorm|SoftMax|softmax|nll_loss|cross_entropy|cumsum|topk|pool|cub::Device"
                    r"|RadixSort|scan|histogram|routing|bitmatrix|argmax|triton_(red|per)_"),
        (ELEMENTWISE, r"elementwise|Functor|copy|fill|CatArray|triton_poi|triton__|index|indices|gather|scatter"
                      r"|where|embedding|cast|transpose|permute|quant|rotary|reshape_and_cache|OpTensor"
                      r"|TensorOp|pad|Memcpy|act_and_mul|silu|gelu|relu|dropout|unrolled|vectorized"),
        # the GEMM libraries' templates, when the name says nothing of what the kernel computes
        (GEMM, r"cutlass|\bcute|xmma|wgmma|hipblaslt|rocblas|ck_tile|epilogue::impl"),
    )
)


FOREACH = "aten::_foreach_"


def first_match(rules: tuple[tuple[str, re.Pattern[str]], ...], text: str) -> str | None:
    """The name of the first rule whose pattern ``text`` matches, or None."""
    return next((cat for cat, rx in rules if rx.search(text)), None)


def op_category(op_name: str) -> str | None:
    """Category of an op name alone, or None for ops the rules do not know."""
    if COMMUNICATION_OP.search(op_name):
        return COMMUNICATION
    return first_match(OP_RULES, op_name)


def kernel_category(kernel_name: str) -> str | None:
    """Category from a kernel name alone (the fallback), or None."""
    if COMMUNICATION_KERNEL.search(kernel_name):
        return COMMUNICATION
    return first_match(KERNEL_RULES, kernel_name)


def classify(kind: str, kernel_name: str, model_op: str | None, leaf_op: str | None,
             in_optimizer: bool, training: bool = True, in_sharding: bool = False) -> str:
    """The category of one GPU event (see the module docstring for the order); ``training``:
    the trace has a backward pass or an optimizer step (a ``_foreach_`` op is an optimizer's
    there, and sampling or other per-tensor-list work in an inference trace); ``in_sharding``:
    launched inside a data-parallel sharding hook (FSDP2's ``_foreach_copy_`` of the shards into
    the all-gather's buffer is a copy, not an optimizer step)."""
    if kind == "memcpy":
        return MEMCPY
    if kind == "memset":
        return MEMSET
    if COMMUNICATION_KERNEL.search(kernel_name):
        return COMMUNICATION
    for op in (model_op, leaf_op):
        if op:
            cat = op_category(op)
            if cat == GEMM and leaf_op and leaf_op != op and op_category(leaf_op) == ELEMENTWISE \
                    and kernel_category(kernel_name) == ELEMENTWISE:
                return ELEMENTWISE  # a cast or a copy inside a GEMM op (autocast's weight cast): not the GEMM
            if cat == COMMUNICATION or cat in MODELED:
                return cat
    if in_optimizer or (training and not in_sharding and leaf_op and leaf_op.startswith(FOREACH)):
        return OPTIMIZER
    if leaf_op:
        cat = op_category(leaf_op)
        if cat is not None and cat != ELEMENTWISE:
            return cat
        by_kernel = kernel_category(kernel_name)
        if cat == ELEMENTWISE and by_kernel not in MODELED:
            return cat
        if by_kernel is not None:
            return by_kernel
        return cat or OTHER
    return kernel_category(kernel_name) or OTHER
