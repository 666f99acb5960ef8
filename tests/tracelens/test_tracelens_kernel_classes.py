"""Kernels are classed by what they compute, not by the template library they are built on:
FlashAttention-3's CUTLASS kernels are attention, FlashInfer's CuTe RMSNorm and CK's
rmsnorm are norms, and a graph replay's kernels each have a hotspot row of their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_tracelens_unseen import _kernel, _launch, _op, _step, _write

from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.categories import classify

# kernel names as the profiler writes them (DeepSeek-V3 training on H800, SGLang/vLLM decode on B300
# and MI300X), each with what it computes
FA3_BWD = ("void cutlass::device_kernel<flash::FlashAttnBwd<flash::CollectiveMainloopBwd<2, cute::tuple<cute::C<1>, "
           "cute::C<1>, cute::C<1> >, cute::tuple<cute::C<64>, cute::C<128>, cute::C<96> >, cutlass::bfloat16_t, float, "
           "cutlass::arch::Sm90, false, true, true, false, false, 1, 2, 1>, flash::CollectiveEpilogueBwd<cute::tuple<"
           "cute::C<64>, cute::C<128>, cute::C<96> >, cutlass::bfloat16_t, 256, true>, flash::SingleTileSchedulerBwd> >"
           "(flash::FlashAttnBwd<>::Params)")
FA3_FWD = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
           "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
           "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false>, flash::CollectiveEpilogueFwd<>, "
           "flash::StaticPersistentTileScheduler<4, 256, true> > > >(flash::FlashAttnFwdSm90<>::Params)")
KERNELS = {
    FA3_BWD: "attention_bwd",
    FA3_FWD: "attention_fwd",
    "void cutlass::device_kernel<flash::FlashAttnBwdPreprocess<cute::tuple<cute::C<64>, cute::C<128> >, "
    "cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false> >(Params)": "attention_bwd",
    "void cutlass::device_kernel<flash::FlashAttnBwdPostprocessConvertdQ<cute::tuple<cute::C<64> > > >(Params)":
        "attention_bwd",
    "void flash::prepare_varlen_num_blocks_kernel(int, int, int, int const*, int const*, int*)": "attention_fwd",
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm100FlashAttentionBackwardSm100_object_at__tensor0000o1110":
        "attention_bwd",
    "kernel_cutlass_kernel_flashinfernormkernelsrmsnormRMSNormKernel_object_at__tensor0000o11101213_tensor0000o1_1e06":
        "normalization",
    "_ZN7ck_tile6kentryILi1ENS_12Rmsnorm2dFwdINS_27Rmsnorm2dFwdPipelineOnePassINS_27Rmsnorm2dFwdPipelineProblemIDF16b"
    "DF16bfDF16bDF16bDF16bffNS_19Generic2dBlockShapeINS_8sequenceIJLi1ELi3072EEEEEEEEEEvDpT1_": "normalization",
    "void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*)":
        "normalization",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<>>(Params)": "attention_fwd",
    # GEMMs stay GEMMs, whether their name says gemm or only names the library
    "void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cute::tuple<int, int, int, int>, "
    "cutlass::gemm::collective::CollectiveMma<> > >(Params)": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas":
        "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_32x1_nn_align2>(Params)": "gemm",
    "void deep_gemm::fp8_gemm_kernel<128u, 128u, 128u, 4u>(__nv_bfloat16*, float*, int*, unsigned int)": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "void cutlass::device_kernel<cutlass::epilogue::impl::Sm90TmaWarpSpecialized<> >(Params)": "gemm",
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernels_are_classed_by_what_they_compute(name: str) -> None:
    assert classify("kernel", name, None, None, False) == KERNELS[name]
    # an op the rules do not know (a custom extension's) leaves it to the kernel's name
    assert classify("kernel", name, None, "my_ext::run", False) == KERNELS[name]


def _deepseek_step(path: Path) -> Path:
    """A training step on an H800: FA3 forward and backward under custom ops (and the
    backward autograd node), GEMMs, FlashInfer's RMSNorm."""
    ev: list[dict[str, Any]] = [_step(1, 0, 10_000)]
    ev += [_op("flash_attn_3::fwd", 10, 20), _launch(1, 12), _kernel(1, 100, 2000, FA3_FWD)]
    ev += [_op("aten::mm", 30, 20), _launch(2, 32), _kernel(2, 2100, 3000, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT")]
    ev += [_op("my_norm::rmsnorm", 60, 20), _launch(3, 62),
           _kernel(3, 5100, 400, "kernel_cutlass_kernel_flashinfernormkernelsrmsnormRMSNormKernel_object_at__t1")]
    ev += [_op("autograd::engine::evaluate_function: FlashAttnFuncBackward", 100, 50),
           _op("flash_attn_3::bwd", 105, 40), _launch(4, 110), _kernel(4, 5600, 4000, FA3_BWD)]
    return _write(path, ev, deviceProperties=[{"id": 0, "name": "NVIDIA H800"}])


def test_flash_attention_3_and_cute_rmsnorm_are_not_gemm(tmp_path: Path) -> None:
    a = analyze([_deepseek_step(tmp_path / "ds.json.gz")])
    by = a.category_seconds()
    assert by["gemm"] == pytest.approx(3000e-6)
    assert by["attention_fwd"] == pytest.approx(2000e-6) and by["attention_bwd"] == pytest.approx(4000e-6)
    assert by["normalization"] == pytest.approx(400e-6)


def test_a_step_that_is_one_graph_replay_has_a_row_per_kernel(tmp_path: Path) -> None:
    """SGLang decode: the step annotation launches one hipGraph replay of every kernel of
    the model; the hotspots list the kernels, not one row for the step's annotation."""
    names = ["_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1", "kernel_unified_attention_2d",
             "void vllm::reshape_and_cache_flash_kernel<__hip_bfloat16, __hip_bfloat16, (vllm::Fp8KVCacheDataType)0>"
             "(__hip_bfloat16 const*, __hip_bfloat16 const*, __hip_bfloat16*, __hip_bfloat16*, long const*)",
             "_ZN7ck_tile6kentryILi1ENS_12Rmsnorm2dFwdINS_27Rmsnorm2dFwdPipelineOnePassIvEEEEvDpT1_"]
    ev: list[dict[str, Any]] = [{"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=16]", "pid": 1,
                                 "tid": 1, "ts": 0, "dur": 500}, {**_launch(1, 10), "name": "hipGraphLaunch"}]
    ev += [_kernel(1, 20 + 30 * i, 25, n) for i, n in enumerate(names)]
    a = analyze([_write(tmp_path / "decode.json.gz", ev)])
    h = a.hotspots.set_index("op")
    assert len(h) == len(names) and set(h.index) == set(names)
    assert h.loc[names[0], "category"] == "gemm" and h.loc[names[1], "category"] == "attention_fwd"
    assert h.loc[names[3], "category"] == "normalization"
    assert h["share"].max() == pytest.approx(0.25)
