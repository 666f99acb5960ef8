"""The recipe holds while the speed knobs move: one global batch split as micro-batch x
accumulation (1x8, 2x4, 4x2, 8x1) gives the same losses over 20 optimizer steps, in one
process and under FSDP2 and expert parallelism over gloo; the split is checked in one line;
the metrics are per optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest

from inprocess import one_process_losses
from primus_perf.base.errors import ConfigError
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer
from trainer_runs import _losses, _run

STEPS = 20
RTOL = 2e-5  # fp32: the micro-batches' gradients summed in another order


def _train(preset: str, overrides: list[str]) -> list[float]:
    return one_process_losses(preset, f"train.steps={STEPS}", *overrides)


@pytest.fixture(scope="module")
def one_pass() -> dict[str, list[float]]:
    """The global batch of 8 in one forward/backward a step, per preset (MoE: bias-balanced, so
    no loss term depends on how the batch is split)."""
    return {"tiny": _train("tiny", ["train.micro_batch=8"]),
            "tiny-moe": _train("tiny-moe", ["train.micro_batch=8", "model.moe.balance=bias"])}


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == STEPS
    for x, y in zip(a, b):
        assert abs(x - y) <= RTOL * abs(x), (a, b)


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_one_process_any_split_of_the_global_batch(one_pass: dict, micro: int) -> None:
    _close(one_pass["tiny"], _train("tiny", [f"train.micro_batch={micro}", "train.global_batch=8"]))


@pytest.mark.parametrize(("preset", "parallel"), [
    ("tiny", ["parallel.dp_shard=2"]),
    ("tiny-moe", ["parallel.ep=2", "model.moe.balance=bias"]),
], ids=["fsdp2", "ep2"])
@pytest.mark.parametrize("micro", [1, 4])
def test_two_ranks_any_split_of_the_global_batch(tmp_path: Path, one_pass: dict, preset: str,
                                                 parallel: list[str], micro: int) -> None:
    """2 ranks x micro-batch x accumulation = 8 sequences a step: accumulation 4 and 1."""
    log = tmp_path / "two.jsonl"
    r = _run(["--config", preset, "--steps", str(STEPS), f"train.micro_batch={micro}", "train.global_batch=8",
              *parallel, "--json-log", str(log)], nproc=2)
    assert r.returncode == 0, r.stderr
    _close(one_pass[preset], _losses(log))


def test_the_split_is_checked_in_one_line_and_metrics_are_per_optimizer_step() -> None:
    with pytest.raises(ConfigError, match=r"'train.global_batch' \(12\) must be a multiple of train.micro_batch \(8\)"):
        Trainer(load_config("tiny", ["train.global_batch=12"]))
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_config("tiny", ["train.global_batch=-8"])
    trainer = Trainer(load_config("tiny", ["train.micro_batch=2", "train.global_batch=8"]))
    try:
        m = trainer.train_step()
    finally:
        trainer.close()
    assert trainer.accumulation == 4 and m.micro_batches == 4
    assert m.tokens_per_s == pytest.approx(8 * 128 / m.step_time_s)
    assert 0 < m.optimizer_s < m.step_time_s and m.micro_step_s == pytest.approx((m.step_time_s - m.optimizer_s) / 4)
