"""Classes of public traces the analyzer read misleadingly, one synthetic trace each, built
from the structure of the real ones: FlashAttention-3's own ops (dense and varlen), several
ranks merged into one file, fp32 convolutions with layout transposes, and data parallelism
with a sharded optimizer (ZeRO-1/2, Megatron's distributed optimizer)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_analysis_next import BF16, _kernel, _launch, _step, _write, _x
from test_tracelens_kernel_classes import FA3_BWD, FA3_FWD

from primus_perf.problems import AttentionProblem
from primus_perf.tracelens import compare as cmp
from primus_perf.tracelens.analyze import analyze

INT = "int"


def _call(name: str, ts: float, dur: float, args: list[tuple[Any, str, str]], tid: int = 1) -> dict[str, Any]:
    """A cpu_op with its inputs as the profiler records them: (dims, type, concrete) each;
    a None optional is ``([], "", "")``, a scalar ``([], "Scalar", "value")``."""
    return _x("cpu_op", name, ts, dur, tid=tid, **{"Input Dims": [a[0] for a in args],
                                                     "Input type": [a[1] for a in args],
                                                     "Input Strides": [[] for _ in args],
                                                     "Concrete Inputs": [a[2] for a in args]})


NONE = ([], "", "")


def _scalar(v: Any) -> tuple[list, str, str]:
    return [], "Scalar", str(v)


def _t(dims: list[int], typ: str = BF16) -> tuple[list[int], str, str]:
    return dims, typ, ""


# ------------------------------------------------------------------ I. FlashAttention-3's own ops

def fa3_fwd(q: list[int], k: list[int], causal: bool, cu: int | None = None, max_seqlen: int | None = None
            ) -> list[tuple[Any, str, str]]:
    """``flash_attn_3::fwd``'s 35 inputs (hopper/flash_api.cpp): q, k, v, ..., cu_seqlens_q at
    7, cu_seqlens_k at 8, max_seqlen_q/k at 12/13, softmax_scale at 23, is_causal at 24."""
    args = [_t(q), _t(k), _t(k), NONE, NONE, NONE, NONE]
    args += [_t([cu], INT), _t([cu], INT)] if cu else [NONE, NONE]
    args += [NONE, NONE, NONE]
    args += [_scalar(max_seqlen), _scalar(max_seqlen)] if max_seqlen else [NONE, NONE]
    args += [NONE] * 9 + [_scalar(0.088), _scalar(causal), _scalar(-1), _scalar(-1), _scalar(0), _scalar(0.0),
                          _scalar(False), NONE, _scalar(1), NONE, _scalar(0)]
    assert len(args) == 34
    return args


def fa3_bwd(q: list[int], k: list[int], causal: bool, cu: int | None = None, max_seqlen: int | None = None
            ) -> list[tuple[Any, str, str]]:
    """``flash_attn_3::bwd``'s inputs: dout, q, k, v, out, softmax_lse, dq, dk, dv,
    cu_seqlens_q/k at 9/10, seqused at 11/12, max_seqlen_q/k at 13/14, is_causal at 16."""
    lse = [q[0], q[1]] if cu else [q[0], q[2], q[1]]
    args = [_t(q), _t(q), _t(k), _t(k), _t(q), _t(lse, "float"), _t(q), _t(k), _t(k)]
    args += [_t([cu], INT), _t([cu], INT)] if cu else [NONE, NONE]
    args += [NONE, NONE]
    args += [_scalar(max_seqlen), _scalar(max_seqlen)] if max_seqlen else [NONE, NONE]
    args += [_scalar(0.088), _scalar(causal), _scalar(-1), _scalar(-1), _scalar(0.0), _scalar(False), _scalar(0)]
    return args


def _fa3_step(path: Path, varlen: bool) -> Path:
    """A training step on an H100 under FlashAttention-3's own ops: the forward op and, in the
    backward node, the backward op; packed (varlen: 4 sequences, 8192 tokens, cu_seqlens and
    max_seqlen recorded) or batched (2 x 4096)."""
    if varlen:
        q, k = [8192, 32, 128], [8192, 8, 128]
        fwd, bwd = fa3_fwd(q, k, True, cu=5, max_seqlen=4096), fa3_bwd(q, k, True, cu=5, max_seqlen=4096)
    else:
        q, k = [2, 4096, 32, 128], [2, 4096, 8, 128]
        fwd, bwd = fa3_fwd(q, k, True), fa3_bwd(q, k, True)
    ev = [_step(0, 20_000), _call("flash_attn_3::fwd", 10, 20, fwd), _launch(1, 12), _kernel(1, 100, 2000, FA3_FWD),
          _x("cpu_op", "autograd::engine::evaluate_function: FlashAttnFuncBackward", 100, 50, tid=2),
          _call("flash_attn_3::bwd", 105, 40, bwd, tid=2), {**_launch(2, 110), "tid": 2}, _kernel(2, 5000, 5000, FA3_BWD)]
    return _write(path, ev)


@pytest.mark.parametrize("varlen", [False, True])
def test_flash_attention_3_ops_have_flops_and_their_pass(tmp_path: Path, varlen: bool) -> None:
    a = analyze([_fa3_step(tmp_path / "fa3.json.gz", varlen)])
    p = a.attention_problems.set_index("direction")
    assert set(p.index) == {"fwd", "bwd"}
    want = AttentionProblem(batch=4 if varlen else 2, heads_q=32, heads_kv=8, seq_q=2048 if varlen else 4096,
                            seq_kv=2048 if varlen else 4096, head_dim=128, causal=True)
    assert p.loc["fwd", "problem"] == want == p.loc["bwd", "problem"]
    assert p.loc["fwd", "flops"] == want.forward_flops and p.loc["bwd", "flops"] == want.backward_flops
    assert a.totals["attention_flops_per_step"] == want.forward_flops + want.backward_flops
    assert 0 < p.loc["fwd", "pct_roofline"] < 1 and 0 < p.loc["bwd", "pct_roofline"] < 1
    assert p.loc["bwd", "time_s"] == pytest.approx(5000e-6)
    if varlen:  # what the trace does not record is said: the split of the tokens over the sequences
        assert "varlen: 4 packed sequences" in p.loc["fwd", "label"] and "equal lengths of 2,048" in p.loc["fwd", "label"]
    else:
        assert "varlen" not in p.loc["fwd", "label"]
    by = a.category_seconds()
    assert by["attention_fwd"] == pytest.approx(2000e-6) and by["attention_bwd"] == pytest.approx(5000e-6)


def test_compare_puts_the_flash_attention_3_backward_under_attention_bwd(tmp_path: Path) -> None:
    """FA3 against torch's SDPA flash path on the same problem: each pass one row, matched by
    its problem; and a backward op without recorded shapes is still a backward."""
    fa3 = analyze([_fa3_step(tmp_path / "fa3.json.gz", False)])
    q, k = [2, 32, 4096, 128], [2, 8, 4096, 128]  # SDPA's bhsd
    sdpa_fwd = [_t(q), _t(k), _t(k), _scalar(0.0), _scalar(True), _scalar(False), NONE]
    sdpa_bwd = [_t(q), _t(q), _t(k), _t(k), _t(q), _t([2, 32, 4096], "float"), NONE, NONE, _scalar(4096),
                _scalar(4096), _scalar(0.0), _scalar(True), NONE, NONE, NONE]
    ev = [_step(0, 20_000), _call("aten::_scaled_dot_product_flash_attention", 10, 20, sdpa_fwd), _launch(1, 12),
          _kernel(1, 100, 2500, "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>(Params)"),
          _x("cpu_op", "autograd::engine::evaluate_function: ScaledDotProductFlashAttentionBackward0", 100, 50, tid=2),
          _call("aten::_scaled_dot_product_flash_attention_backward", 105, 40, sdpa_bwd, tid=2),
          {**_launch(2, 110), "tid": 2},
          _kernel(2, 5000, 6000, "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Traits>(Params)")]
    sdpa = analyze([_write(tmp_path / "sdpa.json.gz", ev)])
    d = cmp.compare_analyses(sdpa, fa3)
    attn = {r["family"]: r for r in d["ops"] if r["category"].startswith("attention")}
    assert set(attn) == {"attention_fwd", "attention_bwd"}
    assert attn["attention_bwd"]["candidate_op"] == "flash_attn_3::bwd" and attn["attention_bwd"]["side"] == "both"
    assert attn["attention_fwd"]["candidate_op"] == "flash_attn_3::fwd" and attn["attention_fwd"]["side"] == "both"
    assert cmp.op_family("attention_bwd", "flash_attn_3::bwd", False) == "attention_bwd"
    assert cmp.op_family("attention_bwd", "flash_attn_3::_flash_attn_backward", False) == "attention_bwd"
    assert cmp.op_family("memset", "flash_attn_3::bwd", False) == "memset in attention_bwd"


# ------------------------------------------------------------------ G. several ranks in one file

GEMM_942 = ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT256x128x64_MI16x16x1_SN_LDSB1_AFC1_AFEM1_ASEM1_CLR1_GLS0_"
            "ISA942_IU1_K1_LBSPPA1024_LPA16_LPB16_MIAV0_MIWT8_4_MO40_NTn1_WG32_8_1")
RCCL = "ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(int, Fn)"


def _rocm_rank(rank: int, pid: int) -> list[dict[str, Any]]:
    """Two steps of one MI300X rank as ROCm's Kineto writes them (hip_runtime launches, GPU pid
    = device = the rank's GPU): a GEMM, an add, and an all-reduce on its own stream; rank 3's
    GEMM takes longer (the others wait for it in the all-reduce)."""
    ev: list[dict[str, Any]] = []
    gemm = 900 + (300 if rank == 3 else 0)
    for step in range(2):
        t0 = 10_000 * step
        ev += [{**_step(t0, 3000, n=step + 1), "pid": pid}]
        for j, (op, kname, dur, stream) in enumerate((("aten::mm", GEMM_942, gemm, 0), ("aten::add", ELEMENTWISE, 100, 0),
                                                      ("nccl:all_reduce", RCCL, 400, 1))):
            corr = 3 * step + j + 1
            dims = {"Input Dims": [[4096, 4096], [4096, 4096]], "Input type": [BF16, BF16]} if op == "aten::mm" else {}
            ev += [{**_x("cpu_op", op, t0 + 10 + 30 * j, 20, **dims), "pid": pid},
                   {**_x("hip_runtime", "hipLaunchKernel", t0 + 15 + 30 * j, 3, correlation=corr), "pid": pid},
                   {"ph": "X", "cat": "kernel", "name": kname, "pid": rank, "tid": stream, "ts": t0 + 100 + 1100 * j,
                    "dur": dur, "args": {"correlation": corr, "stream": stream, "device": rank}}]
    return ev


def _fused(ranks: list[list[dict[str, Any]]], how: str) -> list[dict[str, Any]]:
    """The ranks' events in one list as a merging tool writes them: ``args`` (TraceLens's trace
    fusion: args.rank on every event, pid and correlation offset by the rank, no
    deviceProperties), ``pid`` (SGLang's merger: "[TP03] 4121", correlation ids as they were)
    or ``offset`` (pids offset by rank x 10^6, no rank in the events)."""
    out = []
    for r, events in enumerate(ranks):
        for e in events:
            e = {**e, "args": dict(e.get("args") or {})}
            if how == "args":
                e["args"]["rank"] = r
                e["args"]["pid_raw"] = e["pid"]
                e["pid"] += r * 1_000_000
                if "correlation" in e["args"]:
                    e["args"]["correlation"] += r * 100
            elif how == "pid":
                e["pid"] = f"[TP{r:02d}] {e['pid']}"
            else:
                e["pid"] += r * 1_000_000
            out.append(e)
    return out


@pytest.mark.parametrize("how", ["args", "pid", "offset"])
def test_a_file_of_four_merged_ranks_is_four_ranks_on_an_inferred_mi300x(tmp_path: Path, how: str) -> None:
    path = tmp_path / "merged.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": _fused([_rocm_rank(r, 4000 + r) for r in range(4)],
                                                                      how)}).encode()))
    a = analyze([path])
    assert a.ranks == [0, 1, 2, 3] and a.world_size == 4
    assert a.device["peaks"] == "mi300x" and a.device["name"].startswith("AMD Instinct MI300X (inferred")
    assert a.device["inferred_from"] == "kernel names (gfx942)"
    assert any("one file of 4 ranks" in n for n in a.notes), a.notes
    assert any("inferred from kernel names (gfx942 in 1 of 3 kernel names)" in n and "MI325X" in n for n in a.notes)
    t = a.temporal
    assert len(t) == 8 and set(t["rank"]) == {0, 1, 2, 3}  # two steps of each rank
    by_rank = a.kernels[a.kernels["category"] == "gemm"].groupby("rank")["dur_us"].sum()
    assert by_rank.to_dict() == {0: 1800.0, 1: 1800.0, 2: 1800.0, 3: 2400.0}
    assert a.gemm_problems["calls"].iloc[0] == 1  # per step and rank, not four times one rank's
    assert 0 < a.gemm_problems["pct_roofline"].iloc[0] < 1
    assert set(a.collective_bandwidth["ranks"]) == {4}


def test_merged_ranks_read_in_small_pieces_are_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each piece of the file says whether its events carry a rank (a sample of them): the
    same ranks whatever the pieces."""
    from primus_perf.tracelens import load as L
    from primus_perf.tracelens.ranks import event_ranks

    path = tmp_path / "merged.json"
    path.write_text(json.dumps({"traceEvents": _fused([_rocm_rank(r, 4000 + r) for r in range(4)], "args")}))
    whole = L.load(path)
    monkeypatch.setattr(L, "READ_BYTES", 100)
    small = L.load(path, chunk_bytes=512)
    assert len(whole) == len(small) and set(np.unique(whole.event_rank)) == {0, 1, 2, 3}
    assert (event_ranks(whole)[0] == event_ranks(small)[0]).all()


@pytest.mark.parametrize(("names", "arch", "peaks"), [
    ([GEMM_942, ELEMENTWISE], "gfx942", "mi300x"),
    (["Cijk_Ailk_Bjlk_SB_Bias_AS_SAV_UserArgs_MT64x16x16_MI16x16x1_SN_GSUAMB_ISA90a_IU1_K1"], "gfx90a", "mi250"),
    (["void ck::kernel_gemm_xdl_cshuffle_v3<gfx950>(Arg)"], "gfx950", "mi355x"),
    (["sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x32", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tile"
      "size128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"], "sm_90", "h100-sxm"),
    (["bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32_cga1x1x1_16dp256b_rM_TN_sm100f",
      "fmhaSm100aKernel_QkvE4m3OBfloat16H64PagedKvCausalP16VarSeqQ128Kv128PersistentContext"], "sm_100", "b200"),
    (["void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)"], "sm_80",
     "a100-sxm"),
    (["sm89_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize64x64x64"], "sm_89", None),  # an L4 or an L40S: no roof
])
def test_the_device_is_inferred_from_kernel_names(names: list[str], arch: str, peaks: str | None) -> None:
    from primus_perf.base.devices import lookup_peaks
    from primus_perf.tracelens.device_arch import infer_device

    got = infer_device([*names, "void at::native::reduce_kernel<512, 1>(Params)"])
    assert got is not None and got.arch == arch and got.of == len(names) + 1
    # the names that carry the architecture (an sm80 kernel runs on an H100, not the reverse)
    assert got.kernels == (1 if arch in ("sm_90", "gfx942") else len(names))
    found = lookup_peaks(got.name)
    assert (found.key if found else None) == peaks
    assert "inferred from kernel names" in got.name and "inferred" in got.note
    assert infer_device(["void at::native::reduce_kernel<512, 1>(Params)", "nvjet_tst_128x256_64x4_1x2_h_bz"]) is None


# ------------------------------------------------------------------ H. fp32 convolutions, NCHW

CONV_IN, CONV_W = [64, 64, 224, 224], [64, 64, 3, 3]  # a VGG block: 3x3, stride 1, padding 1
CONV_FLOPS = 2 * (64 * 64 * 224 * 224) * (64 * 3 * 3)
CONV_BYTES = (2 * 64 * 64 * 224 * 224 + 64 * 64 * 9) * 4
SGEMM_CONV = "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int)"
TO_NHWC = "void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, (cudnnKernelDataType_t)2>(Params)"
TO_NCHW = "void cudnn::ops::nhwcToNchwKernel<float, float, float, true, false, (cudnnKernelDataType_t)0>(Params)"
WGRAD = "void cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 8, 3, 3, 5, false, 512>(int, int, int, float const*)"
ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::PointwiseOpScalarFunctor<float, 4, 4, 0>>")
FWD_US, BWD_US = 6_000.0, 44_000.0  # the convolution kernels alone: 59% and 16% of the fp32 roof on an H100


def _vgg_step(path: Path, device: str) -> Path:
    """A VGG-style training step in fp32: a cuDNN convolution forward (its input converted to
    NHWC and its output back around the kernel, as cuDNN does for NCHW tensors), its backward,
    and a foreach Adam step."""
    conv = [_t(CONV_IN, "float"), _t(CONV_W, "float"), ([], "GenericList", "[1, 1]"), ([], "GenericList", "[1, 1]"),
            ([], "GenericList", "[1, 1]"), _scalar(1), _scalar(False), _scalar(False), _scalar(True)]
    back = [_t(CONV_IN, "float"), _t(CONV_IN, "float"), _t(CONV_W, "float"), ([], "GenericList", "[64]"),
            ([], "GenericList", "[1, 1]"), ([], "GenericList", "[1, 1]"), ([], "GenericList", "[1, 1]"), _scalar(False),
            ([], "GenericList", "[0, 0]"), _scalar(1), ([], "GenericList", "[True, True, False]")]
    ev = [_step(0, 80_000), _call("aten::cudnn_convolution", 10, 40, conv)]
    ev += [_launch(1, 12), _kernel(1, 100, 2000, TO_NHWC), _launch(2, 20), _kernel(2, 2100, FWD_US, SGEMM_CONV),
           _launch(3, 30), _kernel(3, 8100, 1000, TO_NCHW)]
    ev += [_x("cpu_op", "autograd::engine::evaluate_function: ConvolutionBackward0", 100, 50, tid=2),
           _call("aten::convolution_backward", 105, 40, back, tid=2), {**_launch(4, 110), "tid": 2},
           _kernel(4, 9200, BWD_US, WGRAD)]
    ev += [_x("user_annotation", "Optimizer.step#Adam.step", 200, 40), _x("cpu_op", "aten::_foreach_add_", 205, 20),
           _launch(5, 210), _kernel(5, 53_300, 3600, ADAM)]
    return _write(path, ev, deviceProperties=[{"id": 0, "name": device}])


def _at_roof(flops: float, nbytes: float, peak: float, hbm: float, fraction: float) -> float:
    """Seconds of ``flops`` at ``fraction`` of min(peak, intensity x HBM)."""
    return flops / (fraction * min(peak, flops / nbytes * hbm) * 1e12)


def test_fp32_convolutions_get_precision_and_channels_last_advice(tmp_path: Path) -> None:
    from primus_perf.base.devices import lookup_peaks

    a = analyze([_vgg_step(tmp_path / "vgg.json.gz", "NVIDIA H100 80GB HBM3")])
    r = a.recommendations.set_index("lever")
    assert {"tf32", "bf16 autocast", "channels_last", "optimizer=fused"} <= set(r.index)
    cl = r.loc["channels_last"]
    assert cl["estimated_saving_ms"] == pytest.approx(3.0) and not cl["changes_numerics"]
    assert "nchwToNhwcKernel" in cl["evidence"] and "channels_last" in cl["action"]
    p = lookup_peaks("NVIDIA H100 80GB HBM3")
    fwd_frac = CONV_FLOPS / (FWD_US * 1e-6) / 1e12 / min(p.tflops["f32"], CONV_FLOPS / CONV_BYTES * p.hbm_tb_s)
    bwd_frac = 2 * CONV_FLOPS / (BWD_US * 1e-6) / 1e12 / min(p.tflops["f32"], CONV_FLOPS / CONV_BYTES * p.hbm_tb_s)
    assert fwd_frac == pytest.approx(0.59, abs=0.01) and bwd_frac == pytest.approx(0.16, abs=0.01)
    for lever, peak, nbytes in (("tf32", p.tflops["tf32"], CONV_BYTES), ("bf16 autocast", p.tflops["bf16"],
                                                                          CONV_BYTES / 2)):
        want = (FWD_US * 1e-6 - _at_roof(CONV_FLOPS, nbytes, peak, p.hbm_tb_s, fwd_frac)
                + BWD_US * 1e-6 - _at_roof(2 * CONV_FLOPS, 2 * nbytes, peak, p.hbm_tb_s, bwd_frac))
        row = r.loc[lever]
        assert row["estimated_saving_ms"] == pytest.approx(want * 1e3, rel=1e-6), lever
        assert row["changes_numerics"] and "16%-59% of their roofline" in row["evidence"]
        assert "an estimate" in row["method"] and "fraction of the roofline" in row["method"]
    assert "torch.autocast(device_type='cuda', dtype=torch.bfloat16)" in r.loc["bf16 autocast", "action"]
    assert "allow_tf32" in r.loc["tf32", "action"]
    # ranked: what keeps the numerics first (channels_last, the fused optimizer), then by saving
    order = list(a.recommendations["lever"])
    assert order.index("channels_last") < order.index("bf16 autocast") and order.index("tf32") > order.index(
        "optimizer=fused")


def test_a_device_without_tf32_or_bf16_is_advised_fp16_with_a_grad_scaler(tmp_path: Path) -> None:
    a = analyze([_vgg_step(tmp_path / "vgg.json.gz", "Tesla V100-SXM2-16GB")])
    r = a.recommendations.set_index("lever")
    assert "tf32" not in r.index and "bf16 autocast" not in r.index
    assert "GradScaler" in r.loc["f16 autocast", "action"] and "float16" in r.loc["f16 autocast", "action"]
    assert r.loc["f16 autocast", "estimated_saving_ms"] > 0 and "channels_last" in r.index


# ------------------------------------------------------------------ F. a sharded optimizer, no FSDP

GEMM_H100 = "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN"
RS_KERNEL = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
AG_KERNEL = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
FUSED_ADAMW = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>"
BUCKET = 64 << 20  # elements of one gradient bucket: 128 MB of bf16, 16 MB a rank's shard over 8 ranks


def _sharded_dp_rank(path: Path, rank: int, style: str) -> Path:
    """One step of one of 8 data-parallel H100 ranks that shard the optimizer without FSDP:
    a forward and a backward GEMM, the gradients reduce-scattered (c10d's base collective: an
    eighth out of the bucket in), a fused AdamW on the shard, the parameters all-gathered.
    ``hand``: a hand-written optimizer, both collectives under its own annotations, after the
    backward pass and after the optimizer step; ``overlap``: Megatron-style, the reduce-scatter
    from a gradient hook in the backward pass, the all-gather in a forward pre-hook's region
    before the forward's GEMMs; ``zero3``: parameters gathered again in the backward pass."""
    big = [[8192, 4096], [4096, 4096]]
    ev: list[dict[str, Any]] = [_step(0, 10_000)]
    corr = iter(range(1, 100))

    def launch(op: str, host: float, gpu: float, dur: float, kernel: str, stream: int = 7, tid: int = 1,
               dims: list | None = None, under: str | None = None) -> None:
        c = next(corr)
        if under:
            ev.append(_x("user_annotation", under, host - 2, 16, tid=tid))
        ev.append(_call(op, host, 10, [_t(d) for d in dims or []], tid=tid))
        ev.extend([{**_launch(c, host + 1), "tid": tid}, _kernel(c, gpu, dur, kernel, stream=stream)])

    gather = [[BUCKET], [BUCKET // 8]]  # _allgather_base_(output, input)
    scatter = [[BUCKET // 8], [BUCKET]]  # _reduce_scatter_base_(output, input)
    if style in ("overlap", "zero3"):
        launch("c10d::_allgather_base_", 10, 100, 500, AG_KERNEL, stream=9, dims=gather, under="forward_pre_hook")
    launch("aten::mm", 40, 700, 800, GEMM_H100, dims=big)
    ev.append(_x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 60, 30, tid=2))
    if style == "zero3":
        launch("c10d::_allgather_base_", 62, 1600, 400, AG_KERNEL, stream=9, tid=2, dims=gather,
               under="pre_backward_hook")
    launch("aten::mm", 80, 2000, 400, GEMM_H100, tid=2, dims=big)
    if style == "hand":
        launch("c10d::_reduce_scatter_base_", 150, 2500, 600, RS_KERNEL, stream=9, dims=scatter, under="reduce_grads")
    else:
        ev.append(_x("cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 94, 12, tid=2))
        launch("c10d::_reduce_scatter_base_", 95, 2500, 600, RS_KERNEL, stream=9, tid=2, dims=scatter,
               under="grad_hook")
    ev.append(_x("user_annotation", "Optimizer.step#AdamW.step", 200, 40))
    launch("aten::_fused_adamw_", 205, 3200, 300, FUSED_ADAMW)
    if style == "hand":
        launch("c10d::_allgather_base_", 260, 3600, 500, AG_KERNEL, stream=9, dims=gather, under="gather_params")
    return _write(path, ev, distributedInfo={"rank": rank, "world_size": 8, "pg_config": [{"pg_size": 8}]})


def _sharded_dp(out: Path, style: str = "hand") -> list[Path]:
    return [_sharded_dp_rank(out / f"{style}_rank{r}.json.gz", r, style) for r in (0, 1)]


@pytest.mark.parametrize("style", ["hand", "overlap"])
def test_a_sharded_optimizer_is_data_parallel_not_tensor_parallel(tmp_path: Path, style: str) -> None:
    from primus_perf.tracelens.analyses.workload import summary

    a = analyze(_sharded_dp(tmp_path, style))
    w = a.workload
    assert (w["tensor_parallel"], w["data_parallel"], w["sharded"], w["sharding"]) == (1, 8, True, "optimizer")
    assert w["sharded_by"].startswith("the collectives' pattern: gradients reduce-scattered "
                                      + ("after" if style == "hand" else "in") + " the backward pass (1 a step, 134 MB")
    assert "a sharded optimizer" in w["sharded_by"]
    assert w["mode_evidence"].startswith("a backward pass, an optimizer step")
    assert "8 data-parallel ranks, optimizer sharded (the collectives' pattern)" in summary(w)
    assert "tensor parallel" not in summary(w)
    e = a.collective_events
    assert set(e["role"]) == {"parameters"} and set(e["group_size"]) == {8}
    r = a.recommendations.set_index("category")
    comm = r.loc["communication"]
    assert "tensor" not in comm["action"] and "tensor" not in comm["condition"]
    assert "--overlap-grad-reduce" in comm["action"] and "--overlap-param-gather" in comm["action"]
    assert "overlap_comm" in comm["action"] and "bucket" in comm["action"]
    # nothing runs beside either collective: all of each is exposed
    assert "exposed: the gradients' reduce-scatter 0.6 ms, the parameters' all-gather 0.5 ms" in comm["evidence"]
    assert comm["estimated_saving_ms"] == pytest.approx(1.1)
    assert "sharding" not in set(a.recommendations["lever"])  # the optimizer is sharded already
    assert "the optimizer alone is sharded" in r.loc["fp8", "condition"]  # no per-layer gathers: FP8 not ruled out


def test_parameters_gathered_in_the_backward_pass_are_sharded_parameters(tmp_path: Path) -> None:
    a = analyze(_sharded_dp(tmp_path, "zero3"))
    w = a.workload
    assert (w["tensor_parallel"], w["data_parallel"], w["sharding"]) == (1, 8, "parameters")
    assert "ZeRO-3/FSDP-style" in w["sharded_by"]
    r = a.recommendations.set_index("category")
    assert "fp8" not in r.index  # per-layer gathers: FSDP2 + FP8 measured slower
    assert "prefetch" in r.loc["communication", "action"]
