"""The default grouped backend (the ``auto`` rule) and the grouped backends' own GEMMs, which
an installed dense GEMM router never re-routes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import primus_perf
from enable_fakes import FAKE_KINDS, gemm_entry, launched
from primus_perf.base.devices import current_device
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.gemm import problem_of
from primus_perf.kernels.grouped import (
    AUTO,
    BACKENDS,
    DEFAULT_RULE,
    backends,
    default_backend,
    in_grouped,
)
from primus_perf.kinds import GROUPED
from primus_perf.runtime import dispatch
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer
from primus_perf.trainer.moe import grouped_mm
from trainer_runs import routing

CPU = torch.device("cpu")


def test_the_rule_picks_grouped_mm_for_many_experts_on_nvidia_bf16(monkeypatch) -> None:
    assert default_backend(CPU, torch.bfloat16, 128, [(64, 64)]) == "loop"  # the CPU keeps the loop
    monkeypatch.setattr(backends, "_vendor", lambda device: "nvidia")
    min_groups = DEFAULT_RULE[("nvidia", torch.bfloat16)][0][0]
    assert default_backend(CPU, torch.bfloat16, min_groups, [(64, 128), (64, 64)]) == "grouped_mm"
    assert default_backend(CPU, torch.bfloat16, min_groups - 1, [(64, 64)]) == "loop"  # few, large experts
    assert default_backend(CPU, torch.float16, 128, [(64, 64)]) == "loop"  # no row for fp16
    # a shape grouped_mm cannot run (K not a multiple of 8) falls through to the loop
    assert default_backend(CPU, torch.bfloat16, 128, [(60, 64)]) == "loop"
    # where torch has no grouped_mm: the loop
    cannot = dataclasses.replace(BACKENDS["grouped_mm"], unsupported=lambda *a: "torch has no _grouped_mm")
    monkeypatch.setitem(BACKENDS, "grouped_mm", cannot)
    assert default_backend(CPU, torch.bfloat16, min_groups, [(64, 64)]) == "loop"
    monkeypatch.setattr(backends, "_vendor", lambda device: "amd")
    assert default_backend(CPU, torch.bfloat16, 128, [(64, 64)]) == "loop"


def test_trainer_default_is_auto_and_explicit_backends_still_work() -> None:
    cfg = load_config("tiny-moe", ["train.steps=1", "train.micro_batch=2", "train.seq_len=32"])
    assert cfg.model.moe.grouped_gemm_backend == AUTO
    losses = {}
    for name in (AUTO, "loop"):
        trainer = Trainer(load_config("tiny-moe", ["train.micro_batch=2", "train.seq_len=32",
                                                   f"model.moe.grouped_gemm_backend={name}"]))
        try:
            losses[name] = trainer.train_step().loss
            assert trainer.grouped == "loop"  # auto resolves to the rule's choice here
            grouped = dispatch.of(GROUPED.name)  # the MoE layers' torch._grouped_mm calls run it
            assert grouped.backend == "loop" and grouped.intercepting
        finally:
            trainer.close()
        assert grouped.backend == "grouped_mm" and not grouped.intercepting  # released at close
    assert losses[AUTO] == losses["loop"]


def test_padded_bmm_under_a_dense_router_is_not_re_routed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    counts = [3, 5, 2]
    x, w = torch.randn(sum(counts), 64), torch.randn(len(counts), 64, 64)
    longest = max(counts)
    xp = torch.zeros(len(counts), longest, 64)
    bmm_problem = problem_of(xp, w)  # the batched GEMM padded_bmm runs in its forward
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(gemm_entry(bmm_problem, current_device()))
    with routing(GROUPED.name, backend="loop"):
        ref = grouped_mm(x, w, counts)
    launched.clear()
    with (primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None),
          routing(GROUPED.name, backend="padded_bmm")):
        y = grouped_mm(x, w, counts)
        assert launched[bmm_problem.key()] == 0 and not in_grouped()
        torch.bmm(xp, w)  # the same GEMM called by the program itself is routed
        assert launched[bmm_problem.key()] == 1
    torch.testing.assert_close(y, ref)


def test_the_loops_own_gemms_run_inside_the_guard(monkeypatch) -> None:
    seen = []
    real = torch.mm

    def spy(*args, **kwargs):
        seen.append(in_grouped())
        return real(*args, **kwargs)

    monkeypatch.setattr(backends.torch, "mm", spy)
    with routing(GROUPED.name, backend="loop"):
        grouped_mm(torch.randn(6, 16), torch.randn(3, 16, 16), [2, 2, 2])
    assert seen == [True, True, True] and not in_grouped()
