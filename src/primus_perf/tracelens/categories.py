"""Kernel categories, decided from the launching op and, as a fallback, the kernel name.

The rules are data: each is a category and a regular expression, tried in order. A GPU
event gets the first category that matches

1. its kind (memcpy, memset),
2. a communication kernel or op (NCCL/RCCL kernels, ``c10d::``/``nccl:`` ops),
3. the op it is attributed to (a GEMM or attention op with a perf model) and then the op
   that launched it (the leaf op: ``aten::native_layer_norm``, ``aten::add``, ...),
4. an optimizer step around it (``Optimizer.step#...`` annotations, fused/foreach ops),
5. the kernel name (traces without CPU events or with unknown ops: ``nvjet_*``,
   ``Cijk_*``, ``flash_fwd_*``, ``elementwise_kernel``, ...),

else "other".
"""

from __future__ import annotations

import re

GEMM = "gemm"
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

COMPUTE = frozenset({GEMM, ATTENTION_FWD, ATTENTION_BWD, ELEMENTWISE, NORMALIZATION, REDUCTION,
                     OPTIMIZER, OTHER})

COMMUNICATION_KERNEL = re.compile(r"nccl|rccl|cross_device_reduce|all_?reduce|all_?gather|reduce_?scatter"
                                  r"|alltoall|sendrecv", re.I)
COMMUNICATION_OP = re.compile(r"^(c10d::|nccl:|gloo:|record_param_comms|_c10d_functional::)")

# op name -> category (first match wins)
OP_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(rx)) for cat, rx in (
        (ATTENTION_BWD, r"^aten::_(scaled_dot_product|flash|efficient|cudnn)\w*attention\w*backward"
                        r"|^flash_attn::\w*backward|^FlashAttn\w*Backward"),
        (ATTENTION_FWD, r"^aten::(_?scaled_dot_product\w*attention\w*|_flash_attention_forward"
                        r"|_efficient_attention_forward|_cudnn_attention_forward)$|^flash_attn::\w*forward"),
        (GEMM, r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmv|mv|_addmm_activation"
               r"|_int_mm|_grouped_mm|_scaled_grouped_mm)$|^primus_perf::gemm$"),
        (OPTIMIZER, r"^aten::_fused_(adam|adamw|sgd|adagrad)_?|^aten::_foreach_|^Optimizer\.step"),
        (NORMALIZATION, r"^aten::(native_)?(layer_norm|rms_norm|_fused_rms_norm|batch_norm|group_norm"
                        r"|instance_norm|native_batch_norm|cudnn_batch_norm|_fused_rms_norm_backward"
                        r"|native_layer_norm_backward|native_group_norm)|rms_?norm|layer_?norm"),
        (REDUCTION, r"^aten::(sum|mean|max|min|amax|amin|argmax|argmin|norm|linalg_vector_norm|prod|std"
                    r"|var|cumsum|logsumexp|_?softmax|_?log_softmax|_softmax_backward_data"
                    r"|_log_softmax_backward_data|nll_loss\w*|cross_entropy_loss|topk|sort|all|any)$"),
        (ELEMENTWISE, r"^aten::"),  # remaining aten ops that launch kernels: copies, pointwise, fills
    )
)

# kernel name -> category, for kernels whose op is unknown or missing
KERNEL_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (cat, re.compile(rx, re.I)) for cat, rx in (
        (ATTENTION_BWD, r"flash_bwd|fmha\w*bwd|bprop|attn_bwd|_bwd_preprocess|_bwd_dkdv|_bwd_dq"
                        r"|attention_backward|dot_do_o|convert_dq"),
        (ATTENTION_FWD, r"flash_fwd|fmha|fprop\w*sdpa|sdpa\w*fprop|attn_fwd|attention_forward|flash_attn"),
        (GEMM, r"gemm|nvjet|Cijk_|cutlass|xmma|sm\d+_xmma|_mm_|matmul|wgmma|hipblaslt|rocblas|ck_tile"),
        (OPTIMIZER, r"adam|FusedOptimizer|fused_sgd|multi_tensor_apply_kernel<\w*::?\w*FusedOptimizer"),
        (NORMALIZATION, r"layer_norm|rms_?norm|GammaBeta|batch_norm|group_norm"),
        (REDUCTION, r"reduce_kernel|LpNorm|lpnorm|SoftMax|softmax|nll_loss|cross_entropy|cumsum|topk"),
        (ELEMENTWISE, r"elementwise|Functor|copy|fill|CatArray|triton_poi|index|gather|scatter|where"
                      r"|embedding|cast|transpose"),
    )
)


def _match(rules: tuple[tuple[str, re.Pattern[str]], ...], text: str) -> str | None:
    for cat, rx in rules:
        if rx.search(text):
            return cat
    return None


def op_category(op_name: str) -> str | None:
    """Category of an op name alone, or None for ops the rules do not know."""
    if COMMUNICATION_OP.search(op_name):
        return COMMUNICATION
    return _match(OP_RULES, op_name)


def kernel_category(kernel_name: str) -> str | None:
    """Category from a kernel name alone (the fallback), or None."""
    if COMMUNICATION_KERNEL.search(kernel_name):
        return COMMUNICATION
    return _match(KERNEL_RULES, kernel_name)


def classify(kind: str, kernel_name: str, model_op: str | None, leaf_op: str | None,
             in_optimizer: bool) -> str:
    """The category of one GPU event (see the module docstring for the order)."""
    if kind == "memcpy":
        return MEMCPY
    if kind == "memset":
        return MEMSET
    if COMMUNICATION_KERNEL.search(kernel_name):
        return COMMUNICATION
    for op in (model_op, leaf_op):
        if op:
            cat = op_category(op)
            if cat == COMMUNICATION or cat in (GEMM, ATTENTION_FWD, ATTENTION_BWD):
                return cat
    if in_optimizer:
        return OPTIMIZER
    if leaf_op:
        cat = op_category(leaf_op)
        if cat is not None and cat != ELEMENTWISE:
            return cat
        by_kernel = kernel_category(kernel_name)
        if cat == ELEMENTWISE and by_kernel not in (GEMM, ATTENTION_FWD, ATTENTION_BWD):
            return cat
        if by_kernel is not None:
            return by_kernel
        return cat or OTHER
    return kernel_category(kernel_name) or OTHER
