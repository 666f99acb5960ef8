"""The MoE model on the CPU: tiny-moe trains, EP=2 (and TP=2) reproduce one process,
dispatch conserves every token, balancing works, every expert GEMM reaches the grouped-GEMM
dispatch (the model's ``torch._grouped_mm`` through its aten override), MFU counts active
parameters, bad MoE keys are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inprocess import completed, one_process_rows
from primus_perf.base.errors import ConfigError
from primus_perf.kernels.gemm import problem_of as gemm_problem_of
from primus_perf.kernels.grouped import problem_of
from primus_perf.kinds import GROUPED
from primus_perf.problems import GroupedGemmProblem
from primus_perf.trainer.config import load_config
from primus_perf.trainer.flops import (
    flops_per_token,
    gemm_flops_per_step,
    matmul_params,
    model_expert_gemms,
    model_gemms,
    routed_active_params,
)
from primus_perf.trainer.loop import Trainer
from primus_perf.trainer.moe import MoE, permute, unpermute, update_router_biases
from trainer_runs import _run, routing


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_moe_trains_loss_falls_under_30_s(tmp_path: Path) -> None:
    """30 steps whose step times add up to under 30 s (the process start-up, imports and
    model set-up, is not counted: on a loaded 2-core machine it varies the most)."""
    log = tmp_path / "moe.jsonl"
    result = _run(["--config", "tiny-moe", "--json-log", str(log)])
    assert result.returncode == 0, result.stderr
    rows = _rows(log)
    train_s = sum(r["step_time_s"] for r in rows)
    assert len(rows) >= 30 and train_s < 30, (len(rows), train_s)
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    cfg = load_config("tiny-moe")
    n_moe = cfg.model.n_layers - cfg.model.moe.first_k_dense
    tokens = cfg.train.micro_batch * cfg.train.seq_len * cfg.model.moe.top_k
    for row in rows:
        counts = row["tokens_per_expert"]
        assert len(counts) == n_moe and all(len(c) == cfg.model.moe.n_experts for c in counts)
        assert all(sum(c) == tokens for c in counts)
        assert row["aux_loss"] > 0


@pytest.mark.parametrize(
    "parallel_args,single_args",
    [
        (["parallel.ep=2", "train.micro_batch=4"], ["train.micro_batch=8"]),  # EP=2 x DP=2
        (["parallel.tp=2"], []),  # TP=2: shared experts sharded, routed ones replicated
    ],
    ids=["ep2", "tp2"],
)
def test_two_processes_reproduce_one(
    tmp_path: Path, parallel_args: list[str], single_args: list[str]
) -> None:
    """Losses, gradient norms (which see the expert-gradient scaling that Adam's
    normalization hides from the loss) and tokens per expert of 5 steps."""
    common = ["--config", "tiny-moe", "--steps", "5", "train.micro_batch=4"]
    two = tmp_path / "two.jsonl"
    r2 = _run([*common, *parallel_args, "--json-log", str(two)], nproc=2)
    assert r2.returncode == 0, r2.stderr
    a, b = one_process_rows("tiny-moe", "train.steps=5", "train.micro_batch=4", *single_args), _rows(two)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert abs(x[key] - y[key]) <= 1e-4 * abs(x[key]), (key, a, b)
        assert x["tokens_per_expert"] == y["tokens_per_expert"]


def test_permute_unpermute_conserves_every_token() -> None:
    g = torch.Generator().manual_seed(0)
    n, d, k, E = 37, 8, 3, 6
    x = torch.randn(n, d, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    experts[:5] = torch.tensor([0, 1, 2])  # crowd a few experts, leave none empty or some
    rows, order, counts = permute(x, experts, E)
    assert rows.shape == (n * k, d) and int(counts.sum()) == n * k
    assert counts.tolist() == torch.bincount(experts.reshape(-1), minlength=E).tolist()
    sorted_experts = experts.reshape(-1)[order]
    assert torch.equal(sorted_experts, sorted_experts.sort().values)  # grouped by expert
    assert torch.equal(rows, x[order // k])
    assert sorted((order // k).tolist()) == sorted(list(range(n)) * k)  # each token k times
    weights = torch.rand(n, k, generator=g)
    weights = weights / weights.sum(dim=1, keepdim=True)
    torch.testing.assert_close(unpermute(rows, order, weights, n), x)  # weights sum to 1
    ones = torch.ones(n, k)
    torch.testing.assert_close(unpermute(rows, order, ones, n), k * x)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_router_weights_and_selection(router: str) -> None:
    cfg = load_config("tiny-moe", [f"model.moe.router={router}", "model.moe.routed_scale=2.5"])
    torch.manual_seed(0)
    layer = MoE(cfg.model)
    layer.reset_parameters(0.02, 0.02)
    x = torch.randn(50, cfg.model.dim)
    weights, experts, probs = layer.router(x)
    assert experts.shape == (50, 2) and bool((experts >= 0).all() & (experts < 8).all())
    torch.testing.assert_close(weights.sum(dim=1), torch.full((50,), 2.5))
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(50))
    layer.router.bias[3] = 100.0  # the bias steers selection only, not the weights
    weights_b, experts_b, _ = layer.router(x)
    assert (experts_b == 3).any(dim=1).all()
    unbiased = probs.gather(1, experts_b)
    torch.testing.assert_close(weights_b, 2.5 * unbiased / unbiased.sum(dim=1, keepdim=True))


def test_bias_balancing_moves_towards_the_mean_load() -> None:
    cfg = load_config(
        "tiny-moe", ["model.moe.balance=bias", "model.moe.bias_update_rate=0.01", "train.steps=1"]
    )
    trainer = Trainer(cfg)
    try:
        metrics = trainer.train_step()
        layer = next(m for m in trainer.model.modules() if isinstance(m, MoE))
        load = torch.tensor(metrics.tokens_per_expert[0], dtype=torch.float32)
        expected = 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(layer.router.bias, expected)
        assert metrics.aux_loss is None
        update_router_biases(trainer.model)  # twice the step
        torch.testing.assert_close(layer.router.bias, 2 * expected)
    finally:
        trainer.close()


def test_every_expert_gemm_goes_through_the_dispatches() -> None:
    """Dense GEMMs (attention, router, shared experts, head) through the GEMM dispatch and the
    routed experts' fwd/dgrad/wgrad through the grouped-GEMM dispatch (both reached by the
    model's plain torch ops), exactly the model's lists; the trainer's backend runs them."""
    cfg = load_config("tiny-moe", ["train.steps=1", "train.micro_batch=2"])
    dense, grouped = [], []

    class GemmRouter:
        def route(self, a, b, bias=None):
            dense.append(gemm_problem_of(a, b))
            return dense[-1].key(), None

    class GroupedRouter:
        def route(self, phase, a, b, offsets, baseline):
            grouped.append(problem_of(phase, a, b, offsets.counts()))
            assert baseline == trainer.grouped  # what an unrouted call runs: the trainer's backend
            return grouped[-1].key(), None

    trainer = Trainer(cfg)
    try:
        with routing("gemm", GemmRouter()), routing(GROUPED.name, GroupedRouter()):
            metrics = trainer.train_step()
    finally:
        trainer.close()
    t = cfg.train
    expected_dense = model_gemms(cfg.model, t.micro_batch, t.seq_len, dtype="f32")
    assert sorted(p.key() for p in dense) == sorted(c.problem.key() for c in expected_dense)
    assert sum(p.flops for p in dense) == gemm_flops_per_step(cfg.model, t.micro_batch, t.seq_len)
    calls = model_expert_gemms(cfg.model, metrics.tokens_per_expert, dtype="f32")
    assert sorted(p.key() for p in grouped) == sorted(c.problem.key() for c in calls)
    tokens = t.micro_batch * t.seq_len
    assert sum(c.flops for c in calls) == 6 * tokens * routed_active_params(cfg.model)


def test_flops_count_active_parameters() -> None:
    cfg = load_config("mixtral-8x7b").model
    dim, e = cfg.dim, cfg.moe.expert_dim
    assert routed_active_params(cfg) == cfg.n_layers * 2 * 3 * dim * e
    total = matmul_params(cfg) + routed_active_params(cfg)
    assert 12.5e9 < total < 13.0e9  # Mixtral 8x7B: about 12.9B active parameters
    dense = load_config("mixtral-8x7b", ["model.moe.n_experts=0"]).model
    assert flops_per_token(dense, 4096) - 6 * matmul_params(dense) == pytest.approx(
        flops_per_token(cfg, 4096) - 6 * total
    )  # attention is the same; only the MLP part changes
    dsv3 = load_config("deepseek-v3").model
    assert routed_active_params(dsv3) == (61 - 3) * 8 * 3 * 7168 * 2048


def test_moe_presets_load_with_overrides() -> None:
    for name in ("tiny-moe", "mixtral-8x7b", "deepseek-v3", "qwen3-30b-a3b"):
        cfg = load_config(name, ["model.n_layers=4", "model.moe.n_experts=8", "model.moe.top_k=2"])
        assert cfg.model.n_layers == 4 and cfg.model.moe.n_experts == 8
    qwen = load_config("qwen3-30b-a3b").model
    assert (qwen.moe.n_experts, qwen.moe.top_k, qwen.moe.expert_dim, qwen.dim) == (
        128,
        8,
        768,
        2048,
    )
    up = GroupedGemmProblem.from_counts([128] * 128, qwen.dim, 2 * qwen.moe.expert_dim)
    assert (up.k, up.n) == (2048, 1536)  # the Qwen3-30B-A3B "up" case of the benchmark


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.moe.router=relu", "model.moe.router"),
        ("model.moe.balance=magic", "model.moe.balance"),
        ("model.moe.top_k=9", "model.moe.top_k"),
        ("model.moe.expert_dim=0", "model.moe.expert_dim"),
        ("model.moe.first_k_dense=7", "model.moe.first_k_dense"),
        ("model.moe.grouped_gemm_backend=cublas", "model.moe.grouped_gemm_backend"),
        ("model.moe.aux_loss_coef=-1", "model.moe.aux_loss_coef"),
        ("model.moe.bogus=1", "model.moe.bogus"),
        ("parallel.ep=3", "parallel.ep"),
    ],
)
def test_bad_moe_key_is_one_line_naming_it(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")) as info:
        load_config("tiny-moe", [override])
    assert "\n" not in str(info.value)


def test_bad_moe_key_on_the_command_line_exits_2() -> None:
    result = completed(["train", "--config", "tiny-moe", "model.moe.top_k=0"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "model.moe.top_k" in lines[0]


@pytest.mark.parametrize("backend", ["grouped_mm", "padded_bmm", "triton"])
def test_tiny_moe_trains_on_every_backend_like_the_loop(backend: str) -> None:
    """Same losses (fp32 on the CPU) whichever backend runs the expert GEMMs."""
    common = ["train.steps=2", "train.micro_batch=2", "train.seq_len=32"]
    losses = {}
    for name in ("loop", backend):
        trainer = Trainer(
            load_config("tiny-moe", [*common, f"model.moe.grouped_gemm_backend={name}"])
        )
        try:
            losses[name] = [trainer.train_step().loss for _ in range(2)]
        finally:
            trainer.close()
    assert losses[backend] == pytest.approx(losses["loop"], rel=1e-5)


def test_backend_that_cannot_run_is_a_config_error() -> None:
    cfg = load_config(
        "tiny-moe", ["model.moe.grouped_gemm_backend=grouped_mm", "model.moe.expert_dim=30"]
    )
    with pytest.raises(ConfigError, match=r"model\.moe\.grouped_gemm_backend.*multiples of 4"):
        Trainer(cfg)  # at set-up, before any step


def test_ep_needs_an_moe_model_and_a_divisible_world() -> None:
    with pytest.raises(ConfigError, match="parallel.ep"):
        load_config("tiny", ["parallel.ep=2"])
    cfg = load_config("tiny-moe", ["parallel.ep=2"])  # valid config, but one process
    with pytest.raises(ConfigError, match="parallel.ep"):
        Trainer(cfg)
