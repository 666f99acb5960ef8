"""FP8 training on the CPU (torch._scaled_mm runs there): the recipes' numerics against an
fp32 reference, the vendor format table, the plan tuner's layer choice from injected step
times, its cache entries and their identity check, the refusal after a failed loss check,
``train.fp8`` in the trainer (config errors, the FP8 GEMMs it really runs, FSDP2 with FP8
all-gather) and ``primus_perf.fp8.apply`` on plain ``nn.Linear`` models."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("torchao")

from primus_perf.base.devices import DeviceIdentity
from primus_perf.base.errors import UserError
from primus_perf.cache.store import TuningCache
from primus_perf.fp8 import apply, find_plan, tune_plan
from primus_perf.kernels.fp8.linear import Fp8Linear
from primus_perf.kernels.fp8.plan import Fp8Plan, Fp8PlanProblem
from primus_perf.kernels.fp8.recipes import RECIPES, fp8_formats
from primus_perf.trainer.fp8 import group_of
from primus_perf.tuner.fp8 import GroupMeasurement, choose, layer_groups

CPU = torch.device("cpu")


class Ops:
    """Counts the calls of ``torch._scaled_mm`` (with its operands' dtypes) and ``torch.mm``
    in a region (torchao and the trainer call both through the ``torch`` module)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[torch.dtype]]] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> Ops:
        for name in ("_scaled_mm", "mm"):
            real = getattr(torch, name)
            self._saved[name] = real

            def wrapper(*args, _real=real, _name=name, **kwargs):
                self.calls.append((_name, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
                return _real(*args, **kwargs)

            setattr(torch, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(torch, name, real)

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)


class AtenGemms(TorchDispatchMode):
    """Counts the aten GEMMs (``mm``, ``addmm``, ``bmm``, ``_scaled_mm``) a region runs, by
    name: the trainer's model calls ``F.linear``, which reaches ``aten::mm`` below the
    ``torch`` module."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "_scaled_mm"):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().float().norm() / b.detach().float().norm())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_numerics_against_fp32(name: str) -> None:
    """Forward, input and weight gradients of each recipe within FP8 rounding of fp32,
    through three torch._scaled_mm calls (two for the recipe with a bf16 weight gradient)."""
    torch.manual_seed(0)
    x = torch.randn(128, 256, requires_grad=True)
    w = (torch.randn(192, 256) * 0.05).requires_grad_()
    dy = torch.randn(128, 192)
    ref = x @ w.t()
    gx_ref, gw_ref = torch.autograd.grad(ref, (x, w), dy)
    with Ops() as ops:
        y = Fp8Linear(name, CPU)(x, w)
        gx, gw = torch.autograd.grad(y, (x, w), dy)
    assert _rel(y, ref) < 0.08 and _rel(gx, gx_ref) < 0.15 and _rel(gw, gw_ref) < 0.15, name
    assert ops.count("_scaled_mm") == (2 if RECIPES[name].weight_grad_hp else 3)
    f8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    assert all(set(d[:2]) <= f8 for n, d in ops.calls if n == "_scaled_mm")
    grads = {d[0] for n, d in ops.calls if n == "_scaled_mm"}
    want = torch.float8_e5m2 if RECIPES[name].grad == "e5m2" else torch.float8_e4m3fn
    assert want in grads


def test_fp8_formats_are_vendor_data() -> None:
    assert fp8_formats("nvidia") == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_formats("amd", "gfx942") == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    assert fp8_formats("amd", "gfx950") == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert fp8_formats("amd", "gfx90a") is None  # MI250: no FP8 GEMMs


def test_choose_keeps_bf16_where_fp8_loses_or_is_noise() -> None:
    groups = {"mlp.w13": ["layers.0.mlp.w13", "layers.1.mlp.w13"], "attention.wo": ["layers.0.attention.wo"],
              "output": ["output"]}
    ms = [
        GroupMeasurement("mlp.w13", "tensorwise", [0.100, 0.101], [0.095, 0.096]),  # saves 5 ms
        GroupMeasurement("mlp.w13", "rowwise", [0.100, 0.101], [0.097, 0.098]),  # saves 3 ms
        GroupMeasurement("attention.wo", "tensorwise", [0.100, 0.100], [0.101, 0.102]),  # loses
        GroupMeasurement("output", "tensorwise", [0.100, 0.104], [0.1025, 0.0995]),  # within noise
    ]
    layers, summary = choose(groups, ms)
    assert layers == {"layers.0.mlp.w13": "tensorwise", "layers.1.mlp.w13": "tensorwise",
                      "layers.0.attention.wo": "bf16", "output": "bf16"}
    assert summary["mlp.w13"]["choice"] == "tensorwise" and len(summary["mlp.w13"]["candidates"]) == 2
    # "output" wins its median by 1%, past min_gain: the noise of its blocks is what keeps bf16
    noisy = ms[3].verdict()
    assert noisy.status == "dropped" and noisy.speedup > 1.002 and noisy.threshold > noisy.speedup - 1
    # a saving below min_gain of the step is not taken
    small = [GroupMeasurement("output", "tensorwise", [0.100, 0.100], [0.0999, 0.0999])]
    assert choose({"output": ["output"]}, small)[0] == {"output": "bf16"}


LAYERS = (("layers.0.attention.wqkv", 768, 256), ("layers.0.attention.wo", 256, 256),
          ("layers.0.mlp.w13", 2048, 256), ("layers.0.mlp.w2", 256, 1024),
          ("layers.1.attention.wqkv", 768, 256), ("layers.1.attention.wo", 256, 256),
          ("layers.1.mlp.w13", 2048, 256), ("layers.1.mlp.w2", 256, 1024), ("output", 1000, 256))
# injected per-layer cost in ms: (bf16, tensorwise, rowwise); FP8 loses on the small ones
COST = {"attention.wqkv": (3.0, 2.2, 2.5), "attention.wo": (1.0, 1.3, 1.4), "mlp.w13": (8.0, 5.5, 5.0),
        "mlp.w2": (4.0, 3.0, 3.1), "output": (2.0, 2.0, 2.1)}


class FakeSession:
    """A training step whose time is the sum of its layers' injected costs under the plan
    (with a little deterministic jitter) and whose loss moves by ``fp8_loss_shift`` when
    any layer runs FP8."""

    made = 0

    def __init__(self, fp8_loss_shift: float = 0.0) -> None:
        self.plan: dict[str, str] = {}
        self.shift = fp8_loss_shift
        self.n = 0
        self.closed = False
        FakeSession.made += 1

    def set_fp8(self, layers: dict[str, str]) -> None:
        self.plan = dict(layers)

    def train_step(self) -> SimpleNamespace:
        self.n += 1
        col = {"bf16": 0, "tensorwise": 1, "rowwise": 2}
        ms = sum(COST[group_of(n)][col[self.plan.get(n, "bf16")]] for n, _, _ in LAYERS)
        ms += 0.01 * (self.n % 3)
        fp8 = any(r != "bf16" for r in self.plan.values())
        return SimpleNamespace(step_time_s=ms / 1e3, loss=5.0 - 0.01 * self.n + (self.shift if fp8 else 0.0))

    def close(self) -> None:
        self.closed = True


PROBLEM = Fp8PlanProblem(LAYERS, tokens=4096)


def _tune(tmp_path: Path, shift: float = 0.0, **kw):
    return tune_plan(lambda: FakeSession(shift), lambda _s: PROBLEM, group_of, cache=tmp_path / "c.json",
                     check_steps=10, **kw)


def test_tuner_picks_fp8_where_it_wins_and_writes_the_entry(tmp_path: Path) -> None:
    assert set(layer_groups(PROBLEM, group_of)) == set(COST)
    res = _tune(tmp_path)
    want = {"attention.wqkv": "tensorwise", "attention.wo": "bf16", "mlp.w13": "rowwise",
            "mlp.w2": "tensorwise", "output": "bf16"}
    assert {group_of(n): r for n, r in res.plan.layers.items()} == want
    assert res.refused is None and res.loss is not None and res.loss.passed
    assert res.timing is not None and res.timing.speedup == pytest.approx(34.0 / 24.4, rel=0.01)
    (entry,) = TuningCache(tmp_path / "c.json").entries()
    assert entry.kind == "fp8_plan" and entry.problem_key == PROBLEM.key()
    assert entry.solution["config"]["layers"] == res.plan.layers
    assert entry.solution["config"]["loss_check"]["passed"] is True
    assert entry.error == pytest.approx(res.loss.rel_diff)
    assert entry.times["default_ms"] > entry.times["tuned_ms"] and "tuned_max_ms" in entry.times
    assert {"torch", "torchao"} <= set(entry.versions)
    assert any("attention.wo" in line and ": bf16" in line for line in res.lines())
    # the plan comes back for the same layers on the same device and versions ...
    plan = find_plan(tmp_path / "c.json", list(LAYERS), 4096)
    assert plan.layers == res.plan.layers
    with pytest.raises(UserError, match="no FP8 plan"):  # other layers: no plan
        find_plan(tmp_path / "c.json", list(LAYERS[:-1]), None)


def test_entry_of_other_hardware_is_not_used(tmp_path: Path) -> None:
    _tune(tmp_path)
    cache = TuningCache(tmp_path / "c.json", report_stale=lambda _m: None)
    (entry,) = cache.entries()
    entry.device = DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132).to_dict()
    other = TuningCache(tmp_path / "other.json")
    other.put(entry)
    with pytest.raises(UserError, match="other hardware or library versions"):
        find_plan(TuningCache(tmp_path / "other.json", report_stale=lambda _m: None), list(LAYERS), 4096)


def test_plan_refused_after_failed_loss_check(tmp_path: Path) -> None:
    res = _tune(tmp_path, shift=0.2)  # the FP8 side's loss is 0.2 higher: ~4% relative
    assert res.refused is not None and res.refused.startswith("FP8 plan refused: ")
    assert "\n" not in res.refused and "beyond the 1.5% threshold" in res.refused
    assert res.written is None and not (tmp_path / "c.json").exists()
    # a looser threshold accepts the same plan
    assert _tune(tmp_path, shift=0.2, threshold=0.1).written is not None


def test_no_winning_group_writes_an_all_bf16_plan_without_a_loss_check(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(COST, "attention.wqkv", (3.0, 3.5, 3.5))
    for g in ("mlp.w13", "mlp.w2"):
        monkeypatch.setitem(COST, g, (4.0, 4.5, 4.5))
    made = FakeSession.made
    res = _tune(tmp_path)
    assert set(res.plan.layers.values()) == {"bf16"} and res.loss is None and res.timing is None
    assert FakeSession.made == made + 1  # no A/B sessions
    assert TuningCache(tmp_path / "c.json").entries()[0].solution["config"]["layers"] == res.plan.layers


def test_apply_converts_the_planned_linears(tmp_path: Path) -> None:
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 8))
    layers = (("0", 128, 64), ("2", 64, 128), ("3", 8, 64))
    plan = Fp8Plan(Fp8PlanProblem(layers, 32), {"0": "tensorwise", "2": "rowwise", "3": "bf16"})
    x = torch.randn(32, 64)
    ref = model(x)
    apply(model, plan)
    assert isinstance(model[0], Float8Linear) and isinstance(model[2], Float8Linear)
    assert type(model[3]) is nn.Linear
    assert model[2].config.cast_config_input.scaling_granularity.value == "axiswise"
    with Ops() as ops:
        out = model(x)
    assert ops.count("_scaled_mm") == 2 and _rel(out, ref) < 0.1
    # through the cache: an entry for exactly these layers
    with pytest.raises(UserError, match="no FP8 plan"):
        apply(nn.Sequential(nn.Linear(64, 128)), tmp_path / "none.json")


# ---- the trainer ------------------------------------------------------------------------

SMALL = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128", "train.seq_len=32",
         "train.micro_batch=2"]


# the FP8 GEMMs run on the CPU at about 70 tokens/s: the trainer tests take few tokens a step
FEW_TOKENS = ["train.seq_len=32"]


def _train(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    from trainer_runs import _run

    return _run(args, nproc=nproc)


@pytest.mark.parametrize(("override", "needle"), [
    (["train.fp8=fast"], "config key 'train.fp8' must be one of off, auto, tensorwise"),
    (["train.fp8=auto"], "config key 'train.fp8' is auto but tuning.cache is not set"),
    (["train.fp8=1"], "config key 'train.fp8' must be str"),
])
def test_train_fp8_config_errors_are_one_line_exit_2(override: list[str], needle: str) -> None:
    from inprocess import completed

    r = completed(["train", "--config", "tiny", "--steps", "1", *override])  # the config refused: no trainer
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_train_fp8_auto_without_a_plan_is_one_line_exit_2(tmp_path: Path) -> None:
    cache = tmp_path / "c.json"
    cache.write_text(json.dumps({"schema": 1, "entries": []}))
    r = _train(["--config", "tiny", "--steps", "1", "train.fp8=auto", f"tuning.cache={cache}"])
    assert r.returncode == 2 and "has no FP8 plan for this model's 9 linear layers" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_trainer_runs_block_linears_in_fp8_and_keeps_the_head_bf16() -> None:
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    losses = {}
    for mode in ("off", "tensorwise"):
        trainer = Trainer(load_config("tiny", [*SMALL, f"train.fp8={mode}"]))
        try:
            with Ops() as ops:
                losses[mode] = [trainer.train_step().loss for _ in range(3)]
            if mode == "off":
                assert trainer.fp8 == {} and ops.count("_scaled_mm") == 0
            else:
                assert trainer.fp8["output"] == "bf16"
                assert {r for n, r in trainer.fp8.items() if n != "output"} == {"tensorwise"}
                # 8 FP8 layers x 3 GEMMs x 3 steps
                assert ops.count("_scaled_mm") == 8 * 3 * 3
        finally:
            trainer.close()
    for a, b in zip(losses["off"], losses["tensorwise"]):
        assert abs(a - b) <= 0.01 * a


def test_trainer_set_fp8_switches_layers_in_place() -> None:
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import Trainer

    trainer = Trainer(load_config("tiny", SMALL))
    try:
        trainer.set_fp8({"layers.0.mlp.w13": "rowwise"})
        with Ops() as ops:
            trainer.train_step()
        assert ops.count("_scaled_mm") == 3
        trainer.set_fp8({})
        with Ops() as ops, AtenGemms() as gemms:
            trainer.train_step()
        assert ops.count("_scaled_mm") == 0 and gemms.calls["_scaled_mm"] == 0
        assert gemms.calls["mm"] + gemms.calls["addmm"] > 0  # the layers' GEMMs, plain again
        with pytest.raises(ValueError, match="does not have"):
            trainer.set_fp8({"layers.9.mlp.w13": "rowwise"})
    finally:
        trainer.close()


def test_fsdp_float8_all_gather_wraps_tensorwise_weights() -> None:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.fp8 import apply_plan, recipe_plan
    from primus_perf.trainer.moe import build_model

    model = build_model(load_config("tiny", SMALL).model)
    model.layers[0].attention.wqkv.tp_sharded = True
    apply_plan(model, recipe_plan(model, "tensorwise"), CPU, fsdp_float8_all_gather=True)
    w = model.layers[0].attention.wqkv
    assert isinstance(w.data, WeightWithDynamicFloat8CastTensor) and w.tp_sharded
    assert not isinstance(model.output.data, WeightWithDynamicFloat8CastTensor)


def test_fsdp2_with_fp8_reproduces_one_process(tmp_path: Path) -> None:
    from inprocess import one_process_losses

    many = tmp_path / "many.jsonl"
    common = ["--config", "tiny", "--steps", "3", "train.fp8=tensorwise", *FEW_TOKENS]
    r2 = _train([*common, "train.micro_batch=2", "parallel.dp_shard=2", "--json-log", str(many)], nproc=2)
    assert r2.returncode == 0, r2.stderr
    assert "FP8: 8 of 9 linear layers (tensorwise)" in r2.stdout
    a = one_process_losses("tiny", "train.steps=3", "train.fp8=tensorwise", *FEW_TOKENS, "train.micro_batch=4")
    b = [json.loads(x)["loss"] for x in many.read_text().splitlines()]
    assert len(a) == len(b) == 3 and all(abs(x - y) <= 1e-4 * x for x, y in zip(a, b)), (a, b)


class TimedTrainer:
    """The real trainer with an injected step time: 10 ms less per FP8 layer of the MLP's
    gate/up projection, 10 ms more per other FP8 layer (CPU timings mean nothing)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.cfg, self.model, self.autocast = trainer, trainer.cfg, trainer.model, trainer.autocast

    def set_fp8(self, layers: dict[str, str]) -> None:
        self.trainer.set_fp8(layers)

    def train_step(self) -> SimpleNamespace:
        m = self.trainer.train_step()
        fp8 = [n for n, r in self.trainer.fp8.items() if r != "bf16"]
        t = 1.0 - 0.01 * sum(1 if n.endswith("mlp.w13") else -1 for n in fp8)
        return SimpleNamespace(step_time_s=t, loss=m.loss)

    def close(self) -> None:
        self.trainer.close()


def test_tuned_plan_runs_with_train_fp8_auto(tmp_path: Path) -> None:
    """The real trainer tuned (its step time injected), the plan written, then used by
    primus-train with train.fp8=auto."""
    from primus_perf.tuner.fp8 import trainer_problem, trainer_sessions

    cache = tmp_path / "c.json"
    make = trainer_sessions("tiny", SMALL)
    res = tune_plan(lambda: TimedTrainer(make()), trainer_problem, group_of, cache=cache, blocks=1,
                    block_steps=1, settle=0, plan_blocks=1, check_steps=3, candidates=["rowwise"])
    assert res.written == cache and res.loss is not None and res.loss.passed
    assert res.plan.fp8_layers == {"layers.0.mlp.w13": "rowwise", "layers.1.mlp.w13": "rowwise"}
    assert res.plan.problem.tokens == 64 and res.plan.problem.dtype == "fp32"
    r = _train(["--config", "tiny", "--steps", "2", *SMALL, "train.fp8=auto", f"tuning.cache={cache}"])
    assert r.returncode == 0, r.stderr
    assert "FP8: 2 of 9 linear layers (rowwise)" in r.stdout
    # another batch size has no plan: one line, exit 2
    r = _train(["--config", "tiny", "--steps", "1", *SMALL, "train.micro_batch=4", "train.fp8=auto",
                f"tuning.cache={cache}"])
    assert r.returncode == 2 and "at 128 tokens" in r.stderr, r.stderr


def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8" / "fp8_loop.py"
    r = subprocess.run([sys.executable, str(bench), "--smoke", "--out", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [row["name"] for row in doc["configs"]] == ["tiny", "tiny-moe"]
    for row in doc["configs"]:
        assert {"plan", "groups", "tokens_per_s", "loss", "speedup"} <= set(row)
        assert row["loss"]["steps"] == doc["settings"]["loss_steps"]
        assert sum(g["layers"] for g in row["groups"].values()) == len(row["plan"])


def test_fp8_grouped_backend_says_why_not_on_cpu() -> None:
    from primus_perf.kernels.grouped.fp8 import FP8_BACKENDS, _column_major

    why = FP8_BACKENDS["fp8_rowwise"].unsupported(CPU, torch.bfloat16, 64, 64)
    assert why is not None and "no CPU kernel for _scaled_grouped_mm" in why
    w = torch.randn(3, 32, 48)
    cm = _column_major(w)
    assert cm.stride() == (32 * 48, 1, 32) and torch.equal(cm, w)
    assert _column_major(w.transpose(1, 2)).data_ptr() == w.data_ptr()  # dgrad's operand: no copy


def test_plan_slower_in_the_whole_step_falls_back_to_bf16(tmp_path: Path) -> None:
    """Groups that each win alone but lose together (injected: any FP8 layer costs 20 ms
    once per step) leave an all-bf16 plan, with no loss check."""

    class Overhead(FakeSession):
        def train_step(self) -> SimpleNamespace:
            m = super().train_step()
            if any(r != "bf16" for r in self.plan.values()):
                m.step_time_s += 0.020 if sum(r != "bf16" for r in self.plan.values()) > 2 else 0.0
            return m

    res = tune_plan(lambda: Overhead(), lambda _s: PROBLEM, group_of, cache=tmp_path / "c.json", check_steps=5)
    assert set(res.plan.layers.values()) == {"bf16"} and res.timing is None and res.loss is None
    assert res.plan.groups["mlp.w13"]["choice"] == "rowwise"  # the group's own measurement stays on record


def test_apply_from_the_cache_to_an_hf_model(tmp_path: Path) -> None:
    """A transformers Llama: a plan for its nn.Linear layers, written as a cache entry, is
    found by its layer set and applied; its MLP projections then run torch._scaled_mm."""
    transformers = pytest.importorskip("transformers")
    from primus_perf.runtime.fp8 import linear_layers
    from primus_perf.tuner.fp8 import plan_entry

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    layers = linear_layers(model)
    assert len(layers) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer and the head
    plan = Fp8Plan(Fp8PlanProblem(tuple(layers), 64),
                   {n: "tensorwise" if ".mlp." in n else "bf16" for n, _, _ in layers})
    TuningCache(tmp_path / "c.json").put(plan_entry(plan, None, None))
    got = apply(model, tmp_path / "c.json")
    assert got.fp8_layers == plan.fp8_layers
    ids = torch.randint(0, 128, (2, 32))
    with Ops() as ops:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    assert ops.count("_scaled_mm") == 2 * 3 * 3  # 2 layers x 3 MLP projections x 3 GEMMs


def test_fp8_gemm_counts_against_the_fp8_peak() -> None:
    """A profiled torch._scaled_mm is an f8e4m3 GEMM (perf_models) and the roofline takes
    the FP8 peak of devices.py for it: the same time reaches half the fraction of a bf16 one."""
    import numpy as np

    from primus_perf.base.devices import lookup_peaks
    from primus_perf.tracelens.perf_models import ShapeArgs, model_op
    from primus_perf.tracelens.roofline import roofline

    n = 8192
    s = ShapeArgs(dims=[[n, n], [n, n], [], []], types=["c10::Float8_e4m3fn"] * 2 + ["float", "float"],
                  strides=[[n, 1], [1, n], [], []], concrete=[])
    m = model_op("aten::_scaled_mm", s)
    assert m.dtype == "f8e4m3"
    peaks = lookup_peaks("NVIDIA H100 80GB HBM3")
    assert peaks.peak_tflops("f8e4m3") == pytest.approx(2 * peaks.peak_tflops("bf16"), rel=0.01)
    t = m.flops / (peaks.peak_tflops("bf16") * 1e12)  # bf16 peak speed
    _, pct = roofline(np.array([m.flops] * 2), np.array([m.bytes] * 2), np.array([t, t]), ["f8e4m3", "bf16"], peaks)
    assert pct[1] == pytest.approx(1.0, rel=0.01) and pct[0] == pytest.approx(0.5, rel=0.01)


@pytest.mark.parametrize(("extra", "nproc", "tol"), [
    (["train.recompute=true"], 1, 1e-6),  # recomputation quantizes the same tensors again
    (["parallel.tp=2"], 2, 1e-2),  # each rank scales its own shard: close, not equal
], ids=["recompute", "tp2"])
def test_train_fp8_composes_with_recompute_and_tp(tmp_path: Path, extra: list[str], nproc: int, tol: float) -> None:
    base, other = tmp_path / "base.jsonl", tmp_path / "other.jsonl"
    common = ["--config", "tiny", "--steps", "3", "train.fp8=tensorwise", *FEW_TOKENS, "train.micro_batch=2"]
    r1 = _train([*common, "--json-log", str(base)])
    r2 = _train([*common, *extra, "--json-log", str(other)], nproc=nproc)
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    assert "FP8: 8 of 9 linear layers (tensorwise)" in r2.stdout
    a = [json.loads(x)["loss"] for x in base.read_text().splitlines()]
    b = [json.loads(x)["loss"] for x in other.read_text().splitlines()]
    assert len(a) == len(b) == 3 and all(abs(x - y) <= tol * x for x, y in zip(a, b)), (a, b)
