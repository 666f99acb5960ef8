"""The reference trainer on the CPU: loss falls, TP=2 and DP=2 reproduce one process,
config errors are one line with exit code 2, dispatch routes every GEMM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inprocess import completed, one_process_losses
from primus_perf.base.errors import ConfigError
from primus_perf.kernels.gemm import problem_of
from primus_perf.problems import GemmProblem
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import gemm_flops_per_step, model_gemms
from primus_perf.trainer.loop import Trainer
from trainer_runs import _losses, _run, routing

DATA = Path(__file__).parents[1] / "data" / "corpus.txt"


def test_tiny_loss_falls_over_30_steps(tmp_path: Path) -> None:
    log = tmp_path / "tiny.jsonl"
    result = _run(["--config", "tiny", "--json-log", str(log)])
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) >= 30
    for row in rows:
        assert {"step", "loss", "step_time_s", "tokens_per_s", "mfu"} <= set(row)
        assert row["mfu"] is None  # CPU: MFU n/a
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert "MFU n/a" in result.stdout


@pytest.mark.parametrize(
    "parallel_args,single_args",
    [
        (["parallel.tp=2"], []),  # TP=2: same batch, sharded weights
        ([], ["train.micro_batch=8"]),  # DP=2 at micro-batch 4 = one process at 8
    ],
    ids=["tp2", "dp2"],
)
def test_two_processes_reproduce_one(
    tmp_path: Path, parallel_args: list[str], single_args: list[str]
) -> None:
    common = ["--config", "tiny", "--steps", "5", "train.micro_batch=4"]
    two = tmp_path / "two.jsonl"
    r2 = _run([*common, *parallel_args, "--json-log", str(two)], nproc=2)
    assert r2.returncode == 0, r2.stderr
    a, b = one_process_losses("tiny", "train.steps=5", "train.micro_batch=4", *single_args), _losses(two)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-4 * abs(x), (a, b)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["train.bogus=1"], "train.bogus"),
        (["train.steps=abc"], "train.steps"),
        (["parallel.tp=3"], "tp"),
        (["--config", "no-such-preset"], "no-such-preset"),
    ],
)
def test_bad_config_is_one_line_exit_2(args: list[str], needle: str) -> None:
    cmd = args if args[0] == "--config" else ["--config", "tiny", *args]
    result = completed(["train", *cmd])  # refused before any work: in this process
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert needle in lines[0] and "Traceback" not in result.stderr


def test_bad_yaml_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    result = completed(["train", "--config", str(bad)])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(bad) in result.stderr


def test_unknown_key_and_wrong_type_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="model.nope"):
        load_config("tiny", ["model.nope=1"])
    with pytest.raises(ConfigError, match="train.lr"):
        load_config("tiny", ["train.lr=fast"])
    with pytest.raises(ConfigError, match="heads|tp"):
        load_config("llama3-8b", ["parallel.tp=5"])


def test_presets_load_with_layer_override() -> None:
    for name in ("tiny", "llama3-8b", "llama3-70b", "qwen2.5-7b"):
        cfg = load_config(name, ["model.n_layers=2"])
        assert cfg.model.n_layers == 2
    big = load_config("llama3-70b")
    assert (big.model.dim, big.model.n_layers, big.model.n_heads) == (8192, 80, 64)


def test_text_data_path_trains(tmp_path: Path) -> None:
    log = tmp_path / "text.jsonl"
    result = _run(
        ["--config", "tiny", "--steps", "8", f"data.path={DATA}", "model.vocab_size=256",
         "--json-log", str(log)]
    )
    assert result.returncode == 0, result.stderr
    losses = _losses(log)
    assert len(losses) == 8 and all(x == x for x in losses)  # no NaN


def test_every_training_gemm_goes_through_dispatch() -> None:
    """A router in the GEMM dispatch sees the forward, input-gradient and weight-gradient GEMM
    of every linear layer (the model's plain ``F.linear`` reaching the aten overrides), and
    their problems are exactly the model's GEMM list."""
    cfg = load_config("tiny", ["train.steps=1", "model.n_layers=2", "train.micro_batch=2"])
    seen: list[GemmProblem] = []

    class Router:
        def route(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None):
            problem = problem_of(a, b)
            seen.append(problem)
            return problem.key(), None  # fall back to torch

    trainer = Trainer(cfg)
    try:
        with routing("gemm", Router()):
            trainer.train_step()
    finally:
        trainer.close()
    expected = model_gemms(cfg.model, cfg.train.micro_batch, cfg.train.seq_len, dtype="f32")
    assert sorted(p.key() for p in seen) == sorted(c.problem.key() for c in expected)
    assert sum(p.flops for p in seen) == gemm_flops_per_step(
        cfg.model, cfg.train.micro_batch, cfg.train.seq_len
    )


def test_router_output_is_used() -> None:
    """A routed answer is what the program's GEMM returns (``torch.mm`` and ``F.linear``
    through the aten overrides); with the overrides released it is torch's again."""
    a, b = torch.randn(4, 3), torch.randn(3, 5)

    class Sevens:
        def route(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None):
            return "sevens", lambda: torch.full((x.shape[0], y.shape[1]), 7.0)

    with routing("gemm", Sevens()) as d:
        d.reset()
        assert torch.equal(torch.mm(a, b), torch.full((4, 5), 7.0))
        assert torch.equal(torch.nn.functional.linear(a, b.t()), torch.full((4, 5), 7.0))
        assert d.summary()["routed"] == {"sevens": 2}
    torch.testing.assert_close(torch.mm(a, b), a @ b)


def test_problem_of_matches_row_major_mapping() -> None:
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    w = torch.randn(5, 4, dtype=torch.bfloat16)
    assert problem_of(x, w.t()) == GemmProblem.from_row_major(6, 5, 4, b_transposed=True)
    with pytest.raises(ValueError):
        problem_of(x[:, ::2], w.t()[::2])
