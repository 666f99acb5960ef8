"""Advice that fits the workload: each recommendation states the condition it rests on and is
not made where it does not hold. Synthetic traces built from real kernel and op names, one
class each: inference (decode, prefill) against training, sharded against replicated data
parallelism, an embedding all-to-all against MoE token exchange, a step that waits on its
DataLoader, GEMMs beside NCCL kernels, per-parameter work at a larger micro-batch, FP8's
casts, and the step tuner's measured savings beside the estimates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_analysis_next import BF16, _kernel, _launch, _op, _step, _write, _x
from typer.testing import CliRunner

from primus_perf.cli.profile import app
from primus_perf.tracelens.analyses.recommendations import CAST_BYTES, FP8_GEMM_SPEEDUP, fp8_casts
from primus_perf.tracelens.analyze import analyze

GEMM = "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN"
BIG = [[8192, 4096], [4096, 4096]]  # an FP8 candidate: every dimension >= 1024
MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16>>(int, Fn)"
FOREACH = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
           "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>>")
FUSED_ADAM = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>"
ALL_TO_ALL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
REDUCE_SCATTER = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


class Trace:
    """Events of one rank: ops each launching one kernel, numbered launches."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.corr = 0

    def call(self, op: str | None, host: float, gpu: float, dur: float, kernel: str, stream: int = 7,
             dims: list | None = None, under: list[str] = ()) -> Trace:
        """``op`` (inside the annotations ``under``) launching ``kernel`` at ``gpu`` for ``dur`` us."""
        self.corr += 1
        for i, name in enumerate(under):
            self.events.append(_x("user_annotation", name, host - 5 + i, 20 - 2 * i))
        if op is not None:
            self.events.append(_op(op, host, 10, dims, [BF16] * len(dims) if dims else None))
        self.events += [_launch(self.corr, host + 1), _kernel(self.corr, gpu, dur, kernel, stream=stream)]
        return self

    def add(self, *events: dict[str, Any]) -> Trace:
        self.events += events
        return self

    def write(self, path: Path, **head: Any) -> Path:
        return _write(path, self.events, **head)


def _cats(a: Any) -> set[str]:
    return set(a.recommendations["category"])


# --------------------------------------------------------------------------- inference

def _decode(t0: float = 0) -> Trace:
    """A decode step: GEMMs, then sampling with _foreach_ ops (no backward, no optimizer)."""
    tr = Trace().add(_x("user_annotation", "execute_model", t0, 900))
    for i in range(4):
        tr.call("aten::mm", t0 + 10 + 10 * i, t0 + 100 + 150 * i, 140, GEMM, dims=BIG)
    tr.call("aten::_foreach_mul_", t0 + 60, t0 + 720, 40, FOREACH)
    tr.call("aten::_foreach_add_", t0 + 70, t0 + 770, 40, FOREACH)
    return tr


def test_an_inference_trace_gets_no_training_advice(tmp_path: Path) -> None:
    a = analyze([_decode().write(tmp_path / "decode.json.gz")])
    assert a.workload["mode"] == "inference"
    k = a.kernels
    assert set(k.loc[k["name"] == FOREACH, "category"].astype(str)) == {"elementwise"}  # sampling, not an optimizer
    assert "optimizer" not in _cats(a)
    fp8 = a.recommendations.set_index("category").loc["fp8"]
    assert "loss curve" not in fp8["action"] and "evaluation set" in fp8["action"]
    assert "inference" in fp8["condition"]
    text = " ".join(a.recommendations["action"])
    assert "micro_batch" not in text and "AdamW" not in text


def test_foreach_ops_of_a_training_step_are_the_optimizers(tmp_path: Path) -> None:
    tr = _decode().add(_x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 300, 20))
    tr.call("aten::mm", 305, 850, 10, GEMM, dims=BIG)
    a = analyze([tr.write(tmp_path / "train.json.gz")])
    assert a.workload["mode"] == "training"
    assert set(a.kernels.loc[a.kernels["name"] == FOREACH, "category"].astype(str)) == {"optimizer"}


# --------------------------------------------------------------------------- the parallel layout

def _data_parallel(path: Path, rank: int, fsdp: bool) -> Path:
    """One training step on 2 ranks: forward and backward GEMMs, a fused AdamW step, and the
    data-parallel collectives, exposed: FSDP2's all-gather and reduce-scatter (under its
    annotations) or DDP's all-reduce in the backward pass."""
    tr = Trace().add(_step(0, 5000))
    if fsdp:
        tr.call("c10d::_allgather_base_", 10, 100, 400, ALL_GATHER, stream=9, under=["FSDP::pre_forward"])
    tr.call("aten::mm", 40, 500, 800, GEMM, dims=BIG)
    tr.add(_x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 60, 30))
    tr.call("aten::mm", 62, 1300, 800, GEMM, dims=BIG)
    grads = ["FSDP::post_backward_reduce"] if fsdp else ["autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"]
    tr.call("c10d::reduce_scatter_" if fsdp else "c10d::allreduce_", 100, 2100, 600,
            REDUCE_SCATTER if fsdp else ALL_REDUCE, stream=9, under=grads)
    tr.add(_x("user_annotation", "Optimizer.step#AdamW.step", 200, 40))
    tr.call("aten::_fused_adamw_", 205, 2800, 900, FUSED_ADAM)
    return tr.write(path, distributedInfo={"rank": rank, "world_size": 2})


@pytest.mark.parametrize("fsdp", [True, False])
def test_sharding_is_advised_only_where_the_ranks_do_not_shard(tmp_path: Path, fsdp: bool) -> None:
    a = analyze([_data_parallel(tmp_path / f"rank{r}.json.gz", r, fsdp) for r in (0, 1)])
    w = a.workload
    assert w["mode"] == "training" and w["data_parallel"] == 2 and w["sharded"] == fsdp
    r = a.recommendations.set_index("category")
    comm = r.loc["communication"]
    if fsdp:
        assert "optimizer" not in r.index  # FSDP already shards the optimizer state
        assert "prefetch" in comm["action"] and "FSDP::" in comm["condition"]
        assert "fp8" not in r.index  # FSDP2 + FP8 measured slower: not advised
    else:
        assert "shard the optimizer state" in r.loc["optimizer", "action"]
        assert "2 data-parallel ranks" in r.loc["optimizer", "condition"]
        assert "bucket_cap_mb" in comm["action"]
    assert "expert" not in comm["action"]


def test_tensor_parallel_ranks_are_not_data_parallel() -> None:
    """The committed 2-rank tensor-parallel H200 run (llama3-8b, tp=2): its collectives run
    inside the model's ops, in groups of 2: one data-parallel rank, nothing to shard."""
    a = analyze([Path(__file__).parents[1] / "data" / "traces" / "h200_tp2"])
    assert a.workload["tensor_parallel"] == 2 and a.workload["data_parallel"] == 1
    r = a.recommendations.set_index("category")
    assert "optimizer" not in r.index
    assert "tensor or sequence parallelism" in r.loc["communication", "condition"]
    assert "gradient" not in r.loc["communication", "action"]


def _all_to_all(path: Path, moe: bool) -> Path:
    """A step whose all-to-all nothing overlaps: DLRM's embedding lookup (fbgemm's table-batched
    embedding) or an MoE layer's token exchange (a grouped GEMM beside it)."""
    tr = Trace().add(_step(0, 3000))
    if moe:
        tr.call("aten::_grouped_mm", 10, 100, 500, "void cutlass::device_kernel<GroupedGemmKernel>(Params)",
                dims=[[4096, 2048], [8, 2048, 1024], [8]])
    else:
        tr.call("fbgemm::split_embedding_codegen_lookup_rowwise_adagrad_function", 10, 100, 500,
                "void split_embedding_codegen_forward_unweighted_kernel<float, c10::Half, int>(Params)")
    tr.call("c10d::alltoall_base_", 40, 700, 800, ALL_TO_ALL, stream=9,
            under=["## sparse_data_dist ##"] if not moe else ["MoE.dispatch"])
    tr.call("aten::mm", 60, 1600, 400, GEMM, dims=BIG)
    return tr.write(path, distributedInfo={"rank": 0, "world_size": 8})


@pytest.mark.parametrize("moe", [False, True])
def test_moe_advice_only_for_an_moe_all_to_all(tmp_path: Path, moe: bool) -> None:
    a = analyze([_all_to_all(tmp_path / "a2a.json.gz", moe)])
    comm = a.recommendations.set_index("category").loc["communication"]
    assert a.workload["embedding_all_to_all"] == (not moe) and a.workload["expert_parallel"] == moe
    if moe:
        assert "expert-parallel" in comm["action"] and "MoE" in comm["condition"]
    else:
        assert "expert" not in comm["action"] and "shared expert" not in comm["action"]
        assert "TrainPipelineSparseDist" in comm["action"] and "embedding" in comm["condition"]


# --------------------------------------------------------------------------- what the step waits on

def test_a_dataloader_bound_step_is_not_told_to_capture_cuda_graphs(tmp_path: Path) -> None:
    """ResNet-50 with num_workers=0 (the Kineto sample's shape): the host spends 50 ms of each
    step in DataLoader.__next__, then launches the convolutions."""
    tr = Trace()
    for s in range(3):
        t = s * 70_000
        tr.add(_step(t, 70_000, s + 1),
               _x("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", t + 10, 50_000))
        for i in range(20):
            tr.call("aten::cudnn_convolution", t + 50_100 + 50 * i, t + 50_200 + 800 * i, 700,
                    "sm80_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64")
    a = analyze([tr.write(tmp_path / "resnet.json.gz")])
    assert a.workload["data_loading_s"] == pytest.approx(0.05)
    r = a.recommendations
    assert r.iloc[0]["category"] == "data loading" and r.iloc[0]["estimated_saving_ms"] == pytest.approx(50, rel=0.1)
    assert "num_workers" in r.iloc[0]["action"]
    launches = r[r["category"] == "host: launches"]
    assert launches.empty or (launches["estimated_saving_ms"] < 5).all()


def test_per_parameter_work_stays_at_a_larger_micro_batch(tmp_path: Path) -> None:
    """A GPU-bound step on 2 data-parallel ranks: 1 ms of GEMM per micro-batch, then 0.5 ms of
    gradient all-reduce and 0.3 ms of optimizer: twice the micro-batch doubles the GEMM only."""
    run = tmp_path / "run"
    run.mkdir()
    for rank in (0, 1):
        tr = Trace().add(_step(0, 3000))
        tr.call("aten::mm", 10, 100, 1000, GEMM, dims=BIG)
        tr.add(_x("cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 20, 10))
        tr.call("c10d::allreduce_", 22, 1100, 500, ALL_REDUCE)
        tr.add(_x("user_annotation", "Optimizer.step#AdamW.step", 40, 10))
        tr.call("aten::_fused_adamw_", 42, 1600, 300, FUSED_ADAM)
        tr.write(run / f"rank{rank}.json.gz", distributedInfo={"rank": rank, "world_size": 2})
    a = analyze([run])
    rp = a.host_replay
    assert (rp["double_gpu_s"] - rp["replay_s"]).to_numpy() == pytest.approx([1000e-6] * 2, abs=1e-9)


COPY = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
        "::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}>(int)")
ADD_F32 = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
WEIGHT = [4096, 4096]


def _accumulating(path: Path, global_batch: int, micro_batch: int) -> Path:
    """One step of 4 micro-batches: per micro-batch a linear (autocast's weight cast, then the
    GEMM), a per-token mul and the gradient's accumulation into the fp32 grad; then fused
    AdamW over the two parameters. The cast (200 us) and the accumulation (100 us) are on
    the weight's shape; the mul (50 us) on the tokens'."""
    path.mkdir()
    tr = Trace().add(_step(0, 20000))
    for i in range(4):
        h, g = 10 + 400 * i, 100 + 3000 * i
        tr.add(_op("aten::linear", h, 60, [[1, 8192, 4096], WEIGHT], [BF16, "float"]))
        tr.call("aten::copy_", h + 2, g, 200, COPY, dims=[WEIGHT, WEIGHT])
        tr.call("aten::mm", h + 20, g + 210, 1500, GEMM, dims=BIG)
        tr.call("aten::mul", h + 80, g + 1720, 50, MUL, dims=[[8192, 4096], [8192, 4096]])
        tr.add(_x("cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", h + 200, 40))
        tr.call("aten::add_", h + 210, g + 1800, 100, ADD_F32, dims=[WEIGHT, WEIGHT])
    tr.add(_x("user_annotation", "Optimizer.step#AdamW.step", 1800, 40))
    tr.call("aten::_fused_adamw_", 1805, 13000, 300, FUSED_ADAM, dims=[[WEIGHT, [4096]], [WEIGHT, [4096]]])
    tr.write(path / "rank0.json.gz")
    config = {"model": {"name": "llama3-8b"}, "train": {"compile": "block", "micro_batch": micro_batch,
                                                         "global_batch": global_batch}, "parallel": {"tp": 1}}
    (path / "manifest.json").write_text(json.dumps({"traces": {"0": "rank0.json.gz"}, "config": config}))
    return path


def test_a_run_that_accumulates_gradients_is_advised_a_larger_micro_batch(tmp_path: Path) -> None:
    a = analyze([_accumulating(tmp_path / "acc", global_batch=8, micro_batch=2)])
    k = a.kernels
    # the cast under the linear is elementwise, not the GEMM's; on the weight's shape, as the accumulation
    assert set(k.loc[k["name"] == COPY, "category"].astype(str)) == {"elementwise"}
    assert k.loc[k["name"].isin([COPY, ADD_F32]), "param_shaped"].all()
    assert not k.loc[k["name"].isin([MUL, GEMM, FUSED_ADAM]), "param_shaped"].any()
    assert a.gemm_problems["time_s"].sum() == pytest.approx(4 * 1500e-6)  # the cast is not GEMM time
    acc = a.recommendations.set_index("category").loc["accumulation"]
    assert acc["lever"] == "train.micro_batch=4" and acc["action"].startswith("set train.micro_batch=4 (now 2; 2 ")
    assert acc["estimated_saving_ms"] == pytest.approx(4 * (0.2 + 0.1) / 2)
    assert "4 micro-batches a step (global batch 8 = micro-batch 2 x 4)" in acc["evidence"]
    # the lever as data beside its text: the step tuner takes it typed, as the config's schema reads it
    from primus_perf.tuner.step.search import advised

    assert acc["settings"] == {"train.micro_batch": 4}
    assert ("train.micro_batch", 4) in [(x.key, x.value) for x in advised(a.recommendations)]
    assert ("micro_batch", "4") in [(x.key, x.value) for x in advised(a.recommendations, script=True)]


ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SPLIT_COPY = "at::native::detail::split_with_sizes_copy_out_contiguous_no_cast_kernel(char**, char**, long*, long*, long*, long, long)"
UNSHARDED, SHARD = [14336, 4096], [7168, 4096]


def test_under_fsdp2_the_unsharded_parameters_work_is_per_micro_batch_too(tmp_path: Path) -> None:
    """FSDP2 over 2 ranks, 4 micro-batches: per micro-batch the layer is all-gathered (the
    NCCL kernel alone on the GPU: exposed), copied out of the flat buffer, run (a linear on the
    unsharded weight) and its unsharded gradient accumulated; the optimizer steps the shards,
    whose shape no forward op takes (seen on 2 H100s: llama3-8b's accumulation was not found)."""
    run = tmp_path / "fsdp"
    run.mkdir()
    for rank in (0, 1):
        tr = Trace().add(_step(0, 20000))
        for i in range(4):
            h, g = 10 + 400 * i, 100 + 3000 * i
            tr.call("c10d::_allgather_base_", h, g, 100, ALL_GATHER, stream=20)
            tr.call("aten::split_with_sizes_copy", h + 10, g + 110, 150, SPLIT_COPY, dims=[[2, 16_777_216]])
            tr.add(_op("aten::linear", h + 20, 60, [[1, 8192, 4096], UNSHARDED], [BF16, BF16]))
            tr.call("aten::mm", h + 22, g + 300, 1500, GEMM, dims=BIG)
            tr.call("aten::mul", h + 90, g + 1810, 50, MUL, dims=[[8192, 4096], [8192, 4096]])
            tr.add(_x("cpu_op", "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", h + 200, 40))
            tr.call("aten::add_", h + 210, g + 1870, 100, ADD_F32, dims=[UNSHARDED, UNSHARDED])
        tr.add(_x("user_annotation", "Optimizer.step#AdamW.step", 1800, 40))
        tr.call("aten::_fused_adamw_", 1805, 13000, 300, FUSED_ADAM, dims=[[SHARD, [4096]], [SHARD, [4096]]])
        tr.write(run / f"rank{rank}.json.gz", distributedInfo={"rank": rank, "world_size": 2})
    config = {"model": {"name": "llama3-8b"}, "train": {"compile": "block", "micro_batch": 1, "global_batch": 8},
              "parallel": {"tp": 1, "dp_shard": 2}}
    (run / "manifest.json").write_text(json.dumps({"traces": {"0": "rank0.json.gz", "1": "rank1.json.gz"},
                                                   "config": config}))
    a = analyze([run])
    k = a.kernels
    assert k.loc[k["name"].isin([SPLIT_COPY, ADD_F32]), "param_shaped"].all()
    assert not k.loc[k["name"].isin([MUL, GEMM, FUSED_ADAM, ALL_GATHER]), "param_shaped"].any()
    assert a.chains.empty  # the copy-out, the mul and the accumulation: no chain of per-token ops
    acc = a.recommendations.set_index("category").loc["accumulation"]
    # per step: 4 x (150 + 100) us of per-parameter work and 4 x 100 us of exposed all-gather, halved
    assert acc["estimated_saving_ms"] == pytest.approx((4 * 0.25 + 4 * 0.1) / 2)
    assert "all-gathers and reduce-scatters, once per micro-batch) are exposed 0.4 ms per step" in acc["evidence"]


@pytest.mark.parametrize("global_batch, micro_batch", [(2, 2), (6, 2)], ids=["no accumulation", "4 does not divide 6"])
def test_no_micro_batch_advice_where_nothing_accumulates_or_twice_does_not_divide(
        tmp_path: Path, global_batch: int, micro_batch: int) -> None:
    a = analyze([_accumulating(tmp_path / "acc", global_batch, micro_batch)])
    assert "accumulation" not in _cats(a)


# --------------------------------------------------------------------------- costs

def test_gemms_beside_nccl_kernels_are_left_out_of_tuning(tmp_path: Path) -> None:
    """Two GEMMs at a low fraction of the roofline on an MI300X (no tuning cap), one of them
    under an all-reduce on another stream: only the lone one counts."""
    tr = Trace().add(_step(0, 5000))
    tr.call("aten::mm", 10, 100, 1000, "Cijk_Ailk_Bljk_BBS_BH_MT128x128x64", dims=BIG)
    tr.call("aten::mm", 20, 1200, 1000, "Cijk_Ailk_Bljk_BBS_BH_MT128x128x64", dims=BIG)
    tr.call("c10d::allreduce_", 30, 1150, 1200, "rcclDevKernel_AllReduce_Sum_bf16_RING_LL", stream=9)
    a = analyze([tr.write(tmp_path / "t.json.gz", deviceProperties=[{"id": 0, "name": "AMD Instinct MI300X"}])])
    tuning = a.recommendations.set_index("category").loc["tuning: gemm"]
    g = a.gemm_problems.iloc[0]
    assert tuning["estimated_saving_ms"] == pytest.approx(1.0 * (1 - g["pct_roofline"] / 0.8), rel=0.01)
    assert "1.0 ms of their time runs beside communication kernels and is left out" in tuning["evidence"]


def test_fp8_estimate_counts_the_casts_and_needs_compile(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    tr = Trace().add(_step(0, 20_000))
    tr.call("aten::mm", 10, 100, 4000, GEMM, dims=BIG)
    tr.write(run / "rank0.json.gz")
    config = {"model": {"name": "llama3-8b"}, "train": {"compile": "off", "micro_batch": 2}, "parallel": {"tp": 1}}
    (run / "manifest.json").write_text(json.dumps({"traces": {"0": "rank0.json.gz"}, "config": config}))
    a = analyze([run])
    fp8 = a.recommendations.set_index("category").loc["fp8"]
    per_param, per_token = fp8_casts(a.gemm_problems)
    assert per_param == 2 * 4096 * 4096 and per_token == 2 * (8192 * 4096 + 8192 * 4096)
    cast_ms = (per_param + per_token) * CAST_BYTES / (3.35e12 * 0.88) * 1e3
    assert fp8["estimated_saving_ms"] == pytest.approx(4.0 * (1 - 1 / FP8_GEMM_SPEEDUP) - cast_ms)
    assert fp8["action"].startswith("set train.compile=pointwise train.fp8=tensorwise") and "0.82-0.95x" in fp8["action"]
    assert "torch.compile off" in fp8["condition"] and "per parameter" in fp8["evidence"]


# --------------------------------------------------------------------------- measured beside estimated

def test_the_step_tuners_measurements_are_shown_beside_the_estimates(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    tr = Trace().add(_step(0, 20_000))
    tr.call("aten::mm", 10, 100, 4000, GEMM, dims=BIG)
    for i in range(6):  # a chain of elementwise ops
        tr.call("aten::mul", 20 + i, 4200 + 300 * i, 280, MUL, dims=BIG[:1] * 2)
    tr.write(run / "rank0.json.gz")
    config = {"model": {"name": "llama3-8b"}, "train": {"compile": False, "micro_batch": 2}, "parallel": {"tp": 1}}
    (run / "manifest.json").write_text(json.dumps({"traces": {"0": "rank0.json.gz"}, "config": config}))
    (run / "step_plan.json").write_text(json.dumps({"schema": "primus-perf-step-plan/1", "measured": [
        {"lever": "train.compile", "value": "block", "estimate_ms": 1.4, "measured_ms": 1.1, "kept": True},
        {"lever": "train.compile", "value": "block", "against": "train.micro_batch=4", "measured_ms": 9.0},
        {"lever": "train.compile", "value": "pointwise", "measured_ms": 0.5, "kept": True},
        # measured alone against another incumbent: not the FP8 advice's compile + FP8
        {"lever": "train.compile", "value": "pointwise", "changes": {"train.compile": "pointwise"},
         "against": "train.compile=block", "measured_ms": -24.0},
        {"lever": "train.fp8", "value": "tensorwise", "measured_ms": -31.0, "kept": False}, {"lever": 3}]}))
    a = analyze([run])
    r = a.recommendations.set_index("category")
    # the advice is the scope the estimate counts (block), matched to that scope's measurement only
    assert r.loc["fusion", "lever"] == "train.compile=block" and r.loc["fusion", "measured_saving_ms"] == 1.1
    assert r.loc["fusion", "measured_against"] == "the default"
    # FP8 is advised with compile (train.fp8=tensorwise train.compile=pointwise): not what the tuner measured alone
    assert r.loc["fp8", "lever"] == "train.fp8=tensorwise train.compile=pointwise" and r.loc["fp8", "measured_saving_ms"] != \
        r.loc["fp8", "measured_saving_ms"]
    assert a.to_json()["recommendations"][0]["measured_saving_ms"] == 1.1
    out = CliRunner().invoke(app, ["analyze", str(run)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "measured by the step tuner: 1.10 ms)" in out.output and "because: " in out.output
    # measured only against another setting: the saving is shown with it
    doc = json.loads((run / "step_plan.json").read_text())
    doc["measured"] = [r for r in doc["measured"] if r.get("against") and r["value"] == "block"]
    (run / "step_plan.json").write_text(json.dumps(doc))
    a = analyze([run])
    fusion = a.recommendations.set_index("category").loc["fusion"]
    assert (fusion["measured_saving_ms"], fusion["measured_against"]) == (9.0, "train.micro_batch=4")
    out = CliRunner().invoke(app, ["analyze", str(run)], env={"COLUMNS": "200"})
    assert "measured by the step tuner: 9.00 ms against train.micro_batch=4)" in out.output


def test_a_chains_time_beside_communication_is_left_out_of_the_fusion_estimate(tmp_path: Path) -> None:
    """Six elementwise calls in a chain; in one run an all-gather on another stream covers the
    last three: that half of the chain's time is not counted (on 2 H100s under FSDP2, counting
    it estimated compile=block at 204.6 ms against 143.5-154.2 measured; leaving it out, 143.5)."""
    def run(name: str, gather: bool) -> Any:
        path = tmp_path / name
        path.mkdir()
        tr = Trace().add(_step(0, 5000))
        for i in range(6):
            tr.call("aten::mul", 20 + i, 1000 + 300 * i, 280, MUL, dims=BIG[:1] * 2)
        if gather:
            tr.call("c10d::_allgather_base_", 10, 1900, 900, ALL_GATHER, stream=20)
        tr.write(path / "rank0.json.gz")
        return analyze([path])

    alone, shared = run("alone", False), run("shared", True)
    assert alone.chains["shared_us"].sum() == 0 and shared.chains["shared_us"].sum() == pytest.approx(3 * 280)
    by_alone, by_shared = (a.recommendations.set_index("category").loc["fusion"] for a in (alone, shared))
    assert by_shared["estimated_saving_ms"] == pytest.approx(by_alone["estimated_saving_ms"] / 2)
    assert "0.8 ms of the chains' time runs beside communication kernels and is left out" in by_shared["evidence"]
