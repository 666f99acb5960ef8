"""FP8 training on a CUDA GPU with FP8 GEMMs (Hopper and later; MI300 with the fnuz
formats): the recipes under bf16 autocast, compiled and eager, against bf16; the trainer
with ``train.fp8`` composed with compile and recompute; the plan tuner writing an entry
that ``train.fp8=auto`` runs; FSDP2 with FP8 all-gather on two GPUs; the analyzer counting
the FP8 GEMMs of a profiled run against the FP8 peak and the report naming the layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("torchao")

from primus_perf.kernels.fp8.linear import Fp8Linear  # noqa: E402
from primus_perf.kernels.fp8.recipes import RECIPES  # noqa: E402

SMALL = ["model.dim=512", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1536", "model.vocab_size=2048",
         "train.seq_len=512", "train.micro_batch=4"]


def _fp8_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    if torch.version.cuda and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 GEMMs before sm_89")


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compile"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_matches_bf16_on_gpu(name: str, compile_: bool) -> None:
    _fp8_gpu()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(1024, 2048, device=dev, requires_grad=True)
    w = (torch.randn(4096, 2048, device=dev) * 0.02).requires_grad_()
    dy = torch.randn(1024, 4096, device=dev, dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = x @ w.t()
        y = Fp8Linear(name, dev, compile=compile_)(x, w)
    assert y.dtype == torch.bfloat16
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w), dy)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    for a, b in ((y, ref), (gx, gx_ref), (gw, gw_ref)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 0.1


def _run(args, nproc=1):
    from trainer_runs import _run as run

    return run(args, nproc=nproc, timeout=600)


@pytest.mark.parametrize("extra", [["train.compile=true"], ["train.recompute=true"],
                                   ["train.compile=true", "train.fp8=rowwise"]], ids=["compile", "recompute", "rowwise"])
def test_trainer_fp8_composes(tmp_path: Path, extra: list[str]) -> None:
    _fp8_gpu()
    logs = {}
    for mode in ("off", "tensorwise"):
        log = tmp_path / f"{mode}.jsonl"
        args = ["--config", "tiny", "--steps", "20", *SMALL, f"train.fp8={mode}", *extra, "--json-log", str(log)]
        if mode == "off":
            args = [a for a in args if a != "train.fp8=rowwise"]
        r = _run(args)
        assert r.returncode == 0, r.stderr
        logs[mode] = [json.loads(x)["loss"] for x in log.read_text().splitlines()]
    a, b = logs["off"][-1], logs["tensorwise"][-1]
    assert abs(a - b) <= 0.03 * a, (logs["off"][-3:], logs["tensorwise"][-3:])


def test_plan_tuned_on_gpu_runs_with_auto(tmp_path: Path) -> None:
    _fp8_gpu()
    from primus_perf.fp8 import tune_trainer

    cache = tmp_path / "c.json"
    res = tune_trainer("tiny", [*SMALL, "train.compile=true"], cache, blocks=2, block_steps=2, check_steps=20)
    assert res.refused is None, res.refused
    assert res.written == cache
    doc = json.loads(cache.read_text())
    (entry,) = [e for e in doc["entries"] if e["kind"] == "fp8_plan"]
    assert "torchao" in entry["versions"] and entry["device"]["vendor"] in ("nvidia", "amd")
    r = _run(["--config", "tiny", "--steps", "3", *SMALL, "train.fp8=auto", f"tuning.cache={cache}"])
    assert r.returncode == 0, r.stderr
    assert f"FP8: {len(res.plan.fp8_layers)} of" in r.stdout


def test_fsdp2_fp8_all_gather_on_two_gpus(tmp_path: Path) -> None:
    _fp8_gpu()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    common = ["--config", "tiny", "--steps", "10", *SMALL, "train.fp8=tensorwise"]
    r1 = _run([*common, "train.micro_batch=8", "--json-log", str(one)])
    r2 = _run([*common, "parallel.dp_shard=2", "--json-log", str(many)], nproc=2)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    a = [json.loads(x)["loss"] for x in one.read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in many.read_text().splitlines()]
    assert all(abs(x - y) <= 0.02 * x for x, y in zip(a, b)), (a, b)


def test_analyzer_counts_fp8_gemms_and_report_names_layers(tmp_path: Path) -> None:
    _fp8_gpu()
    from primus_perf.profiler.capture import Schedule, capture_trainer
    from primus_perf.tracelens.analyze import analyze
    from primus_perf.tracelens.report import report_from_analysis

    run = tmp_path / "run"
    capture_trainer("tiny", [*SMALL, "train.fp8=tensorwise"], run, Schedule(active=2, warmup=1, wait=1))
    a = analyze([run])
    fp8 = a.gemm_problems[a.gemm_problems["dtype"].astype(str).str.startswith("f8")]
    assert len(fp8) > 0, a.gemm_problems[["label", "dtype"]]
    rep = report_from_analysis(a)
    assert rep["header"]["fp8_layers"]["layers.0.mlp.w13"] == "tensorwise"
    assert "output" not in rep["header"]["fp8_layers"]


def test_fp8_grouped_backend_matches_fp32() -> None:
    _fp8_gpu()
    from primus_perf.kernels.grouped.fp8 import FP8_BACKENDS, TOLERANCE

    backend = FP8_BACKENDS["fp8_rowwise"]
    dev = torch.device("cuda")
    counts = [0, 1, 300, 77, 0, 129, 8, 1]
    k, n = 256, 512
    why = backend.unsupported(dev, torch.bfloat16, k, n)
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(0)
    x = torch.randn(sum(counts), k, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(len(counts), k, n, device=dev) * 0.05).to(torch.bfloat16)
    dy = torch.randn(sum(counts), n, device=dev, dtype=torch.bfloat16)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    y_ref = torch.cat([x[starts[g]:starts[g + 1]].float() @ w[g].float() for g in range(len(counts))])
    dx_ref = torch.cat([dy[starts[g]:starts[g + 1]].float() @ w[g].float().t() for g in range(len(counts))])
    for got, want in ((backend.mm(x, w, counts), y_ref), (backend.mm(dy, w.transpose(1, 2), counts), dx_ref)):
        assert got.dtype == torch.bfloat16
        assert float((got.float() - want).norm() / want.norm()) < TOLERANCE
