"""A running trainer's speed knobs switched in place between optimizer steps
(``trainer.knobs.reconfigure``): at a fixed global batch the losses are those of a trainer that ran
the new settings from the start; what cannot change in place is one line naming the key,
before anything changed."""

from __future__ import annotations

import json

import pytest
import torch

from primus_perf.base.errors import ConfigError
from primus_perf.cache.store import SCHEMA_VERSION
from primus_perf.trainer import resources
from primus_perf.trainer.config import SCHEMA, load_config, with_settings
from primus_perf.trainer.knobs import FREE, SWITCHES, NotSwitchable, changed, reconfigure
from primus_perf.trainer.loop import Trainer

BASE = ["train.global_batch=8", "train.micro_batch=2", "train.steps=6", "model.n_layers=2"]


def _losses(preset: str, switch_at: int | None = None, to: tuple[str, ...] = (), steps: int = 5) -> list[float]:
    torch.set_num_threads(1)
    trainer = Trainer(load_config(preset, BASE))
    try:
        out = []
        for i in range(steps):
            if i == switch_at:
                assert reconfigure(trainer, load_config(preset, [*BASE, *to]))
            out.append(trainer.train_step().loss)
        return out
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def fixed() -> dict[str, list[float]]:
    return {p: _losses(p) for p in ("tiny", "tiny-moe")}


@pytest.mark.parametrize(("preset", "to"), [
    ("tiny", ("train.micro_batch=4", "train.recompute=selective", "train.optimizer=foreach")),
    ("tiny", ("train.micro_batch=8", "train.recompute=full", "train.optimizer=fused", "train.compile=pointwise")),
    ("tiny-moe", ("train.micro_batch=1", "model.moe.grouped_gemm_backend=loop", "train.compile=block")),
], ids=["mb4-selective-foreach", "mb8-full-fused-pointwise", "moe-mb1-loop-block"])
def test_switched_in_place_the_losses_are_the_fixed_recipes(fixed: dict, preset: str, to: tuple[str, ...]) -> None:
    torch._dynamo.reset()
    switched = _losses(preset, 2, to)
    torch._dynamo.reset()
    assert switched == pytest.approx(fixed[preset], rel=2e-5)


def test_the_optimizer_takes_over_the_state_in_the_dtype_it_keeps() -> None:
    torch.set_num_threads(1)
    trainer = Trainer(load_config("tiny", BASE))
    try:
        trainer.train_step()
        before = {id(p): s["exp_avg"].clone() for p, s in trainer.optimizer.state.items()}
        reconfigure(trainer, load_config("tiny", [*BASE, "train.optimizer=bf16"]))
        states = trainer.optimizer.state
        assert len(states) == len(before)
        assert all(s["exp_avg"].dtype == torch.bfloat16 and s["step"] == 1 for s in states.values())
        for p, s in states.items():
            assert torch.allclose(s["exp_avg"].float(), before[id(p)], rtol=1e-2, atol=1e-6)
        trainer.train_step()
        reconfigure(trainer, load_config("tiny", [*BASE, "train.optimizer=fused"]))
        assert all(s["exp_avg"].dtype == torch.float32 and float(s["step"]) == 2 for s in trainer.optimizer.state.values())
        assert torch.isfinite(torch.tensor(trainer.train_step().loss))
    finally:
        trainer.close()


def test_what_cannot_change_in_place_is_one_line_before_anything_changed(tmp_path, monkeypatch) -> None:
    torch.set_num_threads(1)
    (tmp_path / "cache.json").write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": []}))
    trainer = Trainer(load_config("tiny", BASE))
    try:
        cfg = trainer.cfg
        with pytest.raises(NotSwitchable, match="config key 'model.dim' cannot change while the trainer runs"):
            reconfigure(trainer, load_config("tiny", [*BASE, "model.dim=64", "train.micro_batch=4"]))
        with pytest.raises(ConfigError, match="'train.fp8': tuning cache .* has no FP8 plan"):
            reconfigure(trainer, load_config("tiny", [*BASE, "train.fp8=auto", "train.micro_batch=4",
                                                     f"tuning.cache={tmp_path / 'cache.json'}"]))
        monkeypatch.setattr(resources, "device_memory", lambda *_: (2**20, "host RAM"))
        with pytest.raises(ConfigError, match="needs about .* more than host RAM"):  # the memory estimate
            reconfigure(trainer, load_config("tiny", [*BASE, "train.micro_batch=8"]))
        monkeypatch.undo()
        assert trainer.cfg is cfg and trainer.accumulation == 4 and trainer.model.recompute == "none"
        assert changed(cfg, load_config("tiny", [*BASE, "train.compile=block"])) == ["train.compile"]
    finally:
        trainer.close()


def test_compile_scopes_switch_back_without_compiling_again(tmp_path) -> None:
    torch.set_num_threads(1)
    (tmp_path / "cache.json").write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": []}))
    torch._dynamo.reset()
    trainer = Trainer(load_config("tiny", [*BASE, "train.compile=block"]))
    try:
        model = trainer.model
        compiled = [b._compiled_call_impl for b in model.layers]
        assert all(c is not None for c in compiled)
        reconfigure(trainer, load_config("tiny", BASE))
        assert all(b._compiled_call_impl is None for b in model.layers) and model.compile_scope == "off"
        reconfigure(trainer, load_config("tiny", [*BASE, "train.compile=pointwise"]))
        assert all("forward" in n.__dict__ for n in (model.norm, model.layers[0].mlp_norm))
        reconfigure(trainer, load_config("tiny", [*BASE, "train.compile=block"]))
        assert [b._compiled_call_impl for b in model.layers] == compiled  # the same compiled callables
        assert "forward" not in model.norm.__dict__
        # a kernel cache routes a block's GEMMs when Inductor compiles it: not switched in place
        # once blocks are compiled (the step tuner builds a trainer of that setting instead)
        with pytest.raises(NotSwitchable, match="'tuning.cache' cannot change in place once blocks are compiled"):
            reconfigure(trainer, load_config("tiny", [*BASE, "train.compile=off", f"tuning.cache={tmp_path / 'cache.json'}"]))
    finally:
        trainer.close()
        torch._dynamo.reset()


def test_the_switches_are_the_schemas_keys_and_a_setting_is_read_by_it() -> None:
    """One schema of the config's keys: what switches in place names its keys, and a typed
    setting over a config is read (and refused, naming the key) by it."""
    assert set(SWITCHES) | set(FREE) <= set(SCHEMA)
    key = SCHEMA["train.micro_batch"]
    assert (key.type, key.default, key.positive) == (int, 8, True)
    assert SCHEMA["train.compile"].choices == ("off", "pointwise", "block")
    cfg = load_config("tiny", BASE)
    assert with_settings(cfg, {"train.micro_batch": 4, "train.compile": True}).train.compile == "pointwise"
    assert cfg.train.micro_batch == 2  # the config it started from stays
    with pytest.raises(ConfigError, match="'train.micro_batch' must be positive"):
        with_settings(cfg, {"train.micro_batch": 0})
    with pytest.raises(ConfigError, match="'train.compile' must be one of off, pointwise, block"):
        with_settings(cfg, {"train.compile": "fast"})
    with pytest.raises(ConfigError, match="unknown config key 'train.nope'"):
        with_settings(cfg, {"train.nope": 1})
