"""Perf models of GEMM and attention ops from recorded inputs, checked against problems
built directly (and, for GEMMs, against what torch really computes)."""

from __future__ import annotations

import pytest
import torch

from primus_perf.kernels.gemm import problem_of
from primus_perf.problems import AttentionProblem, GemmProblem
from primus_perf.tracelens.load import ShapeArgs
from primus_perf.tracelens.perf_models import model_op

BF16 = "c10::BFloat16"


def _args(tensors, extra_types=(), concrete=()) -> ShapeArgs:
    """What the profiler records for these inputs (tensors as torch tensors or None)."""
    dims = [list(t.shape) if t is not None else [] for t in tensors]
    strides = [list(t.stride()) if t is not None else [] for t in tensors]
    types = [BF16 if t is not None else "" for t in tensors] + list(extra_types)
    return ShapeArgs(dims=dims, types=types, strides=strides, concrete=list(concrete))


def _bf(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("at,bt", [(False, False), (True, False), (False, True), (True, True)])
def test_mm_reads_transposes_from_strides_like_the_dispatch(at: bool, bt: bool) -> None:
    M, N, K = 96, 80, 64
    a = _bf(K, M).t() if at else _bf(M, K)
    b = _bf(N, K).t() if bt else _bf(K, N)
    m = model_op("aten::mm", _args([a, b]))
    assert m is not None and m.kind == "gemm"
    assert m.problem == problem_of(a, b)
    assert m.flops == 2 * M * N * K


def test_addmm_bias_bmm_baddbmm_linear_matmul() -> None:
    x, w, bias = _bf(32, 64), _bf(128, 64), _bf(128)
    m = model_op("aten::addmm", _args([bias, x, w.t()]))
    assert m.problem == GemmProblem.from_row_major(32, 128, 64, b_transposed=True, epilogue="bias")
    m = model_op("aten::bmm", _args([_bf(4, 32, 64), _bf(4, 64, 16)]))
    assert m.problem.batch == 4 and m.flops == 2 * 4 * 32 * 16 * 64
    m = model_op("aten::baddbmm", _args([_bf(4, 32, 16), _bf(4, 32, 64), _bf(4, 64, 16)]))
    assert m.problem.batch == 4 and m.problem.row_major_shapes()[:3] == (32, 16, 64)
    m = model_op("aten::linear", _args([_bf(2, 16, 64), w, bias]))
    assert m.problem == GemmProblem.from_row_major(32, 128, 64, b_transposed=True, epilogue="bias")
    m = model_op("aten::matmul", _args([_bf(2, 16, 64), _bf(64, 8)]))
    assert m.problem.row_major_shapes()[:3] == (32, 8, 64) and m.problem.batch == 1
    m = model_op("aten::matmul", _args([_bf(3, 2, 16, 64), _bf(3, 2, 64, 8)]))
    assert m.problem.batch == 6 and m.flops == 2 * 6 * 16 * 8 * 64


def test_scaled_mm_is_fp8_with_bf16_output() -> None:
    s = ShapeArgs(dims=[[64, 128], [128, 32], [], []], types=["c10::Float8_e4m3fn"] * 2 + ["float", "float"],
                  strides=[[128, 1], [1, 128], [], []], concrete=[])
    m = model_op("aten::_scaled_mm", s)
    assert m.problem.dtype_a == "f8e4m3" and m.problem.dtype_d == "bf16" and m.problem.trans_a


def test_sdpa_ops_fwd_bwd_causal_gqa_layouts() -> None:
    q, kv = _bf(2, 32, 512, 128), _bf(2, 8, 512, 128)  # bhsd, GQA
    expected = AttentionProblem(2, 32, 8, 512, 512, 128, "bf16", True, "bshd")
    concrete = ["", "", "", "", "0.", "True", "", "False"]
    m = model_op("aten::scaled_dot_product_attention", _args([q, kv, kv], concrete=concrete))
    assert m.problem == expected and m.direction == "fwd" and m.flops == expected.forward_flops
    # cuDNN op: is_causal is input 6
    c = ["", "", "", "", "True", "0.", "False", "False", ""]
    m = model_op("aten::_scaled_dot_product_cudnn_attention", _args([q, kv, kv], concrete=c))
    assert m.problem.causal is False
    # backward: grad_out first, is_causal at 11 (flash)
    cb = [""] * 15
    cb[11] = "True"
    m = model_op("aten::_scaled_dot_product_flash_attention_backward", _args([q, q, kv, kv, q], concrete=cb))
    assert m.problem == expected and m.direction == "bwd" and m.flops == expected.backward_flops
    # flash_attn's own ops record bshd tensors
    qf, kf = _bf(2, 512, 32, 128), _bf(2, 512, 8, 128)
    cf = ["", "", "", "0.0", "0.088", "True"]
    m = model_op("flash_attn::_flash_attn_forward", _args([qf, kf, kf], concrete=cf))
    assert m.problem == expected


def test_unmodeled_or_malformed_inputs_give_none() -> None:
    assert model_op("aten::add", _args([_bf(4, 4), _bf(4, 4)])) is None
    assert model_op("aten::mm", None) is None
    assert model_op("aten::mm", ShapeArgs(dims=[[4, 5], [6, 7]], types=[BF16] * 2, strides=[], concrete=[])) is None
    assert model_op("aten::mm", ShapeArgs(dims=[[4, "x"], [5]], types=[BF16] * 2, strides=[], concrete=[])) is None
    assert model_op("aten::mm", ShapeArgs(dims=[[4, 5], [5, 6]], types=["c10::ComplexFloat"] * 2, strides=[],
                                          concrete=[])) is None
    assert model_op("aten::scaled_dot_product_attention",
                    ShapeArgs(dims=[[1, 3, 8, 4], [1, 2, 8, 4], [1, 2, 8, 4]], types=[BF16] * 3, strides=[],
                              concrete=[])) is None  # 3 q heads over 2 kv heads
