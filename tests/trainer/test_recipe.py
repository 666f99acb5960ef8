"""The trainer's speed knobs that keep the recipe: recompute none|selective|full, compile
off|pointwise|block, the optimizer's implementation, and running out of memory as a result;
the memory estimate follows each knob."""

from __future__ import annotations

import pytest
import torch

import primus_perf
from enable_fakes import FAKE_KINDS, gemm_entry, launched
from primus_perf.base.devices import current_device
from primus_perf.base.errors import OutOfMemory
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.gemm import problem_of
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer
from primus_perf.trainer.resources import estimate_memory
from trainer_runs import _run

STEPS = 4


def _losses(preset: str, *overrides: str) -> list[float]:
    torch.set_num_threads(1)
    trainer = Trainer(load_config(preset, [*overrides, f"train.steps={STEPS}"]))
    try:
        return [trainer.train_step().loss for _ in range(STEPS)]
    finally:
        trainer.close()


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_every_recompute_mode_trains_the_same(preset: str) -> None:
    """Recompute changes what is kept, not a number (fp32 on the CPU)."""
    none = _losses(preset, "train.recompute=none")
    for mode in ("selective", "full"):
        assert _losses(preset, f"train.recompute={mode}") == pytest.approx(none, rel=1e-6), mode
    assert load_config("tiny", ["train.recompute=true"]).train.recompute == "full"  # the old bool
    assert load_config("tiny", ["train.compile=true"]).train.compile == "pointwise"


def test_optimizer_choices_train_alike_and_bf16_keeps_its_moments_in_bf16() -> None:
    auto = _losses("tiny", "train.optimizer=auto")
    assert _losses("tiny", "train.optimizer=foreach") == pytest.approx(auto, rel=1e-6)
    assert _losses("tiny", "train.optimizer=fused") == pytest.approx(auto, rel=1e-5)
    assert _losses("tiny", "train.optimizer=bf16") == pytest.approx(auto, rel=1e-2)  # its moments rounded
    trainer = Trainer(load_config("tiny", ["train.optimizer=bf16"]))
    try:
        trainer.train_step()
        states = list(trainer.optimizer.state.values())
    finally:
        trainer.close()
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in states)


def test_bf16_moments_step_fsdp2_shards_as_it_steps_whole_tensors(monkeypatch) -> None:
    """Under FSDP2 the parameters are DTensors, for which torch has no sharding rule of
    ``_foreach_copy_`` (seen on 2 H100s: train.optimizer=bf16 failed in the step): each rank
    steps its own shard, bit for bit the step of the whole tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from primus_perf.trainer.optim import Bf16StateAdamW
    from trainer_runs import _free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
        whole = torch.nn.Parameter(w.clone())
        shard = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
        for p in (whole, shard):
            opt = Bf16StateAdamW([p], lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
            for i in range(3):
                g = torch.full_like(w, 0.5 + i)
                p.grad = distribute_tensor(g, mesh, [Shard(0)]) if p is shard else g
                opt.step()
        assert torch.equal(whole.detach(), shard.detach().full_tensor()) and not torch.equal(whole.detach(), w)
        assert opt.state[shard]["exp_avg"].to_local().dtype == torch.bfloat16
    finally:
        dist.destroy_process_group()


def test_compiled_blocks_route_their_gemms_through_the_runtimes_pass(tmp_path) -> None:
    """``train.compile=block`` compiles each block with its GEMMs; an enabled cache still routes
    them (the Inductor pass swaps them for the routed op), with the eager losses."""
    torch.set_num_threads(1)
    cfg = load_config("tiny", ["model.n_layers=1", "train.micro_batch=2", "train.seq_len=32"])
    m = cfg.model
    x = torch.randn(2 * 32, m.dim)
    w = torch.randn((m.n_heads + 2 * m.n_kv_heads) * m.head_dim, m.dim)  # the fused Q/K/V projection
    problem = problem_of(x, w.t())
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(gemm_entry(problem, current_device()))
    eager = _losses("tiny", "model.n_layers=1", "train.micro_batch=2", "train.seq_len=32")
    launched.clear()
    torch._dynamo.reset()
    with primus_perf.enable(cache, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS, log=None) as tuned:
        compiled = _losses("tiny", "model.n_layers=1", "train.micro_batch=2", "train.seq_len=32", "train.compile=block")
        routed = tuned.summary()["gemm"]["routed"]
    torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert routed > 0 and sum(launched.values()) == routed


def test_compiled_moe_blocks_do_not_recompile_as_the_routing_changes() -> None:
    """The tokens each expert gets change every step; compiled, they stay outside the graph
    (a host count compiled in would be a new graph each step, then the recompile limit)."""
    torch._dynamo.reset()
    overrides = ("model.n_layers=2", "train.seq_len=32", "train.micro_batch=2")  # layer 2 is MoE
    eager = _losses("tiny-moe", *overrides)
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        compiled = _losses("tiny-moe", *overrides, "train.compile=block")
    torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_out_of_memory_is_one_line_with_the_estimate_and_the_peak(monkeypatch) -> None:
    trainer = Trainer(load_config("tiny", ["train.micro_batch=2"]))

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer, "_forward", full)
    try:
        with pytest.raises(OutOfMemory) as err:
            trainer.train_step()
    finally:
        trainer.close()
    text = str(err.value)
    assert "\n" not in text and text.startswith("out of memory at step 1: host RAM")
    assert "the estimate for this config about" in text and "train.recompute=selective or full" in text


def test_a_config_the_estimate_says_cannot_fit_is_one_line_and_exit_2() -> None:
    r = _run(["--config", "tiny", "--steps", "1", "model.n_layers=100000"])  # one layer would fit
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs about" in r.stderr, r.stderr
    assert r.stderr.startswith("error: config key 'model.n_layers'"), r.stderr


def test_the_memory_estimate_follows_every_knob() -> None:
    def est(*overrides: str):
        return estimate_memory(load_config("llama3-8b", ["model.n_layers=4", *overrides]), "cuda")

    none, selective, full = (est(f"train.recompute={m}") for m in ("none", "selective", "full"))
    assert none.activations > selective.activations > full.activations
    assert est("train.micro_batch=2").activations == 2 * none.activations
    assert est("train.micro_batch=1", "train.global_batch=64").total == none.total  # accumulation: one micro-batch's
    assert est("parallel.dp_shard=2").params < 0.6 * none.params  # FSDP2 shards weights, gradients, moments
    assert est("train.optimizer=bf16").params == none.params - 4 * _param_count()  # two bf16 moments
    assert est("train.fp8=tensorwise").params > none.params


def _param_count() -> int:
    from primus_perf.trainer.resources import _params

    dense, experts = _params(load_config("llama3-8b", ["model.n_layers=4"]))
    return dense + experts


def test_the_recipe_sweep_runs_in_smoke_mode(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "sweep.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer" / "recipe_sweep.py"
    for extra in ([], ["--equality"]):
        r = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out), *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [(r["config"], r["micro_batches"]) for r in doc["rows"]] == [("default", 1), ("mb2", 4)]
    assert all(r["tokens_per_s"] > 0 and 0 < r["optimizer_share"] < 1 for r in doc["rows"])
    assert max(doc["equality"]["max_rel_diff_vs_8x1"].values()) < 1e-5
