"""The step tuner (``primus-tune step``): the search's order, interaction passes, memory rule,
out-of-memory and budget on a step whose time is a known function of its setting; then the
real thing on the CPU: the tiny trainer searched, its plan written, checked and loaded by
``primus-train --plan``, and two gloo ranks under FSDP2 in lockstep."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import ClassVar

import pytest

from primus_perf.base.errors import OutOfMemory
from primus_perf.trainer.config import load_config, read_plan
from primus_perf.tuner.step.levers import (
    LEVERS,
    Lever,
    Setting,
    TrainerContext,
    pick,
    trainer_levers,
)
from primus_perf.tuner.step.search import CANNOT_RUN, DOES_NOT_FIT, OUT_OF_MEMORY, Advice, Search
from primus_perf.tuner.step.tune import interleaved
from trainer_runs import CLI, _free_port

TINY = ["train.global_batch=4", "train.micro_batch=1", "model.n_layers=1", "train.seq_len=32"]


class ModelStep:
    """A session whose step time is a function of the setting, with 0.2% noise: FP8 pays only
    with compiled blocks (tensorwise more than rowwise); micro-batch 4 fits only with full recompute, which costs 5%;
    optimizer=bf16 runs out of memory."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.rng = random.Random(0)
        self.switches = 0

    def cfg_of(self, setting: Setting) -> Setting:
        return setting

    def switch(self, setting: Setting) -> None:
        self.switches += setting.values != self.setting.values
        self.setting = setting

    def step(self) -> float:
        v = self.setting.values
        if v["train.optimizer"] == "bf16":
            raise OutOfMemory("out of memory at step 3: modelled")
        t = 100.0
        t *= {"off": 1.0, "pointwise": 0.97, "block": 0.90}[v["train.compile"]]
        fp8 = {"off": 1.0, "tensorwise": 0.85, "rowwise": 0.88}[v["train.fp8"]]
        t *= fp8 if v["train.compile"] == "block" or fp8 == 1.0 else 1.10
        t *= {1: 1.0, 2: 0.9, 4: 0.8}[v["train.micro_batch"]]
        t *= {"none": 1.0, "selective": 1.02, "full": 1.05}[v["train.recompute"]]
        return t * (1 + self.rng.uniform(-0.001, 0.001))

    def recover(self, setting: Setting) -> None:
        self.setting = setting

    def reset(self, setting: Setting) -> None:
        self.setting = setting

    def measure(self, base: Setting, other: Setting, **blocks: int) -> tuple[list[float], list[float]]:
        return interleaved(self, base, other, **blocks)


def _fits(s: Setting) -> str | None:
    v = s.values
    return "needs about 90 GiB" if v["train.micro_batch"] == 4 and v["train.recompute"] != "full" else None


START = Setting({"train.micro_batch": 1, "train.compile": "off", "train.recompute": "none", "train.fp8": "off",
                 "train.optimizer": "fused"})
WHERE = TrainerContext(load_config("tiny", ["train.global_batch=4", "train.micro_batch=1"]), "cuda", 1, 1, False,
              fp8_formats=True)


def _search(advice=(), deadline=float("inf"), levers=("micro_batch", "compile", "recompute", "fp8", "optimizer")):
    session = ModelStep(START)
    search = Search(session, [LEVERS[n] for n in levers], WHERE, advice=advice, blocks=2, block_steps=2,
                    deadline=deadline, fits=_fits)
    return search.run(START), session


def test_the_search_finds_what_pays_together_through_interaction_passes() -> None:
    """FP8 advised first loses against eager blocks (1.10x slower); once blocks are compiled a
    second pass measures it again and keeps it; micro-batch 4 comes with full recompute."""
    res, session = _search(advice=[Advice("train.fp8", "tensorwise", 15.4, "fp8")])
    assert res.best.values == {"train.micro_batch": 4, "train.compile": "block", "train.recompute": "full",
                               "train.fp8": "tensorwise", "train.optimizer": "fused"}
    first = res.trials[0]
    assert (first.key, first.value, first.status, first.estimate_ms) == ("train.fp8", "tensorwise", "dropped", 15.4)
    assert [t.status for t in res.trials if t.key == "train.fp8" and t.value == "tensorwise"] == ["dropped", "kept"]
    mb4 = next(t for t in res.trials if t.value == 4)
    assert mb4.changes == {"train.micro_batch": 4, "train.recompute": "full"} and mb4.kept
    assert res.passes == 3 and not res.stopped  # the third re-measures the rest against FP8: no change
    oom = [t for t in res.trials if t.value == "bf16"]
    assert oom and all(t.status == OUT_OF_MEMORY and "modelled" in t.reason for t in oom)
    assert session.setting.values == res.best.values  # left on the plan
    # every kept trial beat the rule; every row is what the analyzer reads
    for t in res.trials:
        row = t.row()
        assert row["lever"] == t.key and (row["measured_ms"] is None) == (not t.incumbent_s)
        assert not t.kept or t.speedup > 1 + t.threshold


def test_each_figure_says_what_it_is_measured_against() -> None:
    """A trial's figure is against the best of its time ("of train.compile=block"); the best so
    far against the default is the kept speedups multiplied, said once per change of the best
    and named so; the summary's plan-vs-default line (the figure that counts) is printed once,
    with the search's product beside it."""
    from primus_perf.tuner.decide import Verdict
    from primus_perf.tuner.step.tune import StepTuneResult

    said: list[str] = []
    search = Search(ModelStep(START), [LEVERS[n] for n in ("micro_batch", "compile", "recompute", "fp8", "optimizer")],
                    WHERE, blocks=2, block_steps=2, fits=_fits, log=said.append)
    res = search.run(START)
    product = 1.0
    for t in search.chosen:
        product *= t.speedup
    assert res.chained == pytest.approx(product) and len(search.chosen) >= 3
    best = [line for line in said if line.startswith("best so far: ")]
    assert len(best) == len(search.chosen) and f"about {product:.2f}x the default (the kept speedups multiplied" in best[-1]
    assert not any("the default" in line for line in said if line.startswith("(pass 2)"))  # against the best then
    verdict = Verdict("step", "plan", "plan", "default", "kept", 1.41, 1.39, 1.43, 3, 70.0, 100.0, 0.002, "blocks")
    result = StepTuneResult("tiny", [], res, res.best, verdict, default_s=[0.1], plan_s=[0.07], tokens_per_step=128)
    lines = [line for line in result.lines() if "plan vs default" in line]
    assert lines == [f"plan vs default, measured interleaved: 1.410x [1.390-1.430] tokens/s (1,280 -> 1,829): kept "
                     f"(the search's product of kept speedups said about {product:.2f}x)"]


def test_a_value_that_does_not_fit_even_with_its_companions_is_recorded_unmeasured() -> None:
    session = ModelStep(START)
    search = Search(session, [LEVERS["micro_batch"]], WHERE, blocks=2, block_steps=1, fits=lambda s: "never fits")
    res = search.run(START)
    assert {t.value: t.status for t in res.trials} == {2: DOES_NOT_FIT, 4: DOES_NOT_FIT}
    assert all(t.reason == "never fits" and not t.incumbent_s for t in res.trials) and session.switches == 0


def test_the_budget_stops_the_search_and_says_where() -> None:
    res, _ = _search(deadline=time.monotonic() - 1)
    assert res.trials == [] and res.best.values == START.values
    assert res.stopped.startswith("the budget ran out before any trial (0.0 min left in pass 1, at micro_batch=")


def test_a_budget_too_small_for_one_trial_says_how_much_more_it_needs() -> None:
    # a script's trial is runs of it, start-ups included: 5 runs of 60 s before any ran; the final
    # measurement keeps 2 min back; 1.5 min are left: four trials need 20 + 2 - 1.5, about 21 min more
    session = ModelStep(START)
    search = Search(session, [LEVERS["micro_batch"]], WHERE, blocks=2, block_steps=1, fits=lambda s: None,
                    deadline=time.monotonic() + 90, reserve_s=120, first_trial_s=300)
    res = search.run(START)
    assert res.trials == [] and session.switches <= 1
    assert "a trial takes about 5.0 min and the plan's final measurement keeps 2.0 min back" in res.stopped
    assert res.stopped.endswith("raising --budget-min by about 21 min allows four trials")


def test_levers_say_why_they_do_not_apply_here() -> None:
    cpu = TrainerContext(load_config("tiny"), "cpu", 1, 1, False)
    why = {lv.name: lv.legal(cpu) for lv in LEVERS.values()}
    assert "train.global_batch is 0" in why["micro_batch"]
    assert why["fsdp_reshard"] == why["fsdp_prefetch"] == "FSDP2 is off (parallel.dp_shard=1)"
    assert why["grouped_backend"] == "the model has no MoE layers" and why["fp8"] == "this device has no FP8 GEMMs"
    assert why["kernel_cache"].startswith("no kernel cache") and why["compile"] is None
    assert LEVERS["micro_batch"].values(TrainerContext(load_config("tiny", ["train.global_batch=24"]), "cpu", 2, 1, False)) \
        == [1, 2, 4, 12]
    with pytest.raises(Exception, match="unknown lever nope"):
        pick("compile,nope")
    assert [lv.name for lv in pick("recompute,compile")] == ["compile", "recompute"]


def test_a_levers_key_and_values_are_the_configs_schemas() -> None:
    """A lever of primus-train sets a key of the config's schema, and every value it tries is
    one the schema reads as it is (typed: no text parsed back)."""
    from primus_perf.trainer.config import SCHEMA

    here = TrainerContext(load_config("tiny-moe", ["train.global_batch=8"]), "cuda", 1, 2, True, "c.json", True)
    for lever in trainer_levers():
        assert lever.key in SCHEMA, lever.name
        assert all(SCHEMA[lever.key].read(v) == v for v in lever.values(here) if v is not None), lever.name
    assert LEVERS["grouped_backend"].values(here) == list(SCHEMA["model.moe.grouped_gemm_backend"].choices)


def test_a_lever_is_one_registered_record() -> None:
    from primus_perf.tuner.step import register, unregister

    lever = register(Lever("log_every", "train.log_every", lambda w: [1, 2]))
    try:
        res, _ = _search(levers=("compile",))
        assert "log_every" in LEVERS and res.trials
        with pytest.raises(ValueError, match="registered already"):
            register(lever)
    finally:
        unregister("log_every")
    assert "log_every" not in LEVERS


def test_a_candidate_the_trainer_cannot_run_is_recorded_and_the_search_goes_on() -> None:
    from primus_perf.base.errors import ConfigError

    class Refusing(ModelStep):
        def switch(self, setting: Setting) -> None:
            if setting.values["train.compile"] == "block":
                raise ConfigError("config key 'train.compile': modelled refusal")
            super().switch(setting)

    session = Refusing(START)
    res = Search(session, [LEVERS["compile"]], WHERE, blocks=2, block_steps=1, fits=_fits).run(START)
    statuses = {t.value: t.status for t in res.trials}
    assert statuses["block"] == CANNOT_RUN and statuses["pointwise"] == "kept"


def test_a_candidate_that_diverges_leaves_a_fresh_trainer_and_the_search_goes_on() -> None:
    """optimizer=bf16 makes the loss non-finite and leaves the weights so: every later step
    would diverge too, until the session is rebuilt from its seed."""
    from primus_perf.base.errors import DivergedError

    class Diverging(ModelStep):
        poisoned, resets = False, 0

        def step(self) -> float:
            if self.poisoned or self.setting.values["train.optimizer"] == "bf16":
                self.poisoned = True
                raise DivergedError("loss became nan at step 4")
            return super().step()

        def reset(self, setting: Setting) -> None:
            self.poisoned, self.resets = False, self.resets + 1
            super().reset(setting)

    session = Diverging(START)
    res = Search(session, [LEVERS["optimizer"], LEVERS["compile"]], WHERE, blocks=2, block_steps=1,
                 fits=_fits).run(START)
    statuses = {(t.key, t.value): t.status for t in res.trials}
    bf16 = [t for t in res.trials if t.value == "bf16"]  # measured again in the interaction pass
    assert {t.status for t in bf16} == {CANNOT_RUN} and session.resets == len(bf16)
    assert statuses[("train.compile", "block")] == "kept"  # measured on the fresh trainer


def test_under_torchrun_out_of_memory_is_met_by_every_rank_and_the_search_goes_on() -> None:
    """Every rank of a symmetric layout runs out at the same step (2 H100s under FSDP2: both at
    step 45 of micro-batch 4): the ranks meet in one broadcast, each builds a fresh trainer,
    and the search goes on. Any other failure inside a step stops it in one line."""
    from primus_perf.base.errors import UserError

    met: list[object] = []

    def agree(x: object) -> object:
        met.append(x)
        return x

    class Resetting(ModelStep):
        resets = 0

        def reset(self, setting: Setting) -> None:
            self.resets += 1
            super().reset(setting)

    session = Resetting(START)
    res = Search(session, [LEVERS["optimizer"], LEVERS["compile"]], WHERE, blocks=2, block_steps=1, fits=_fits,
                 distributed=True, agree=agree).run(START)
    bf16 = [t for t in res.trials if t.value == "bf16"]
    assert bf16 and {t.status for t in bf16} == {OUT_OF_MEMORY} and session.resets == len(bf16)
    assert met.count(OUT_OF_MEMORY) == len(bf16) and res.best.values["train.compile"] == "block"

    class Broken(ModelStep):
        def step(self) -> float:
            if self.setting.values["train.compile"] == "block":
                raise NotImplementedError("no sharding strategy registered")
            return super().step()

    search = Search(Broken(START), [LEVERS["compile"]], WHERE, blocks=2, block_steps=1, fits=_fits,
                    distributed=True)
    with pytest.raises(UserError, match=r"train.compile=block failed on this rank \(NotImplementedError: no "
                                        r"sharding.*leave its lever out \(--levers\)"):
        search.run(START)


def test_what_a_lever_kept_before_the_budget_ran_out_inside_it_stays_in_the_plan() -> None:
    """Seen under FSDP2 on 2 H100s: micro-batch 2 kept at 1.15x, micro-batch 4 out of memory,
    the budget gone before micro-batch 8; the plan must hold micro-batch 2."""

    class OneTrial(Search):
        asked = 0

        def over_budget(self, trials: int = 1) -> bool:
            self.asked += 1
            return self.asked > 1

    search = OneTrial(ModelStep(START), [LEVERS["micro_batch"], LEVERS["compile"]], WHERE, blocks=2, block_steps=1,
                      fits=lambda s: None)
    res = search.run(START)
    assert [(t.value, t.status) for t in res.trials] == [(2, "kept")]
    assert res.stopped == "the budget ran out in pass 1, at micro_batch=4"
    assert res.best.values["train.micro_batch"] == 2 and res.best.values["train.compile"] == "off"


class ModelLane:
    """A lane (``tuner.step.lanes.Lane``'s calls) whose GPU is a :class:`ModelStep` of its own;
    ``broken``: its process died (a traceback instead of times)."""

    def __init__(self, name: str, broken: bool = False) -> None:
        self.name, self.broken, self.closed = name, broken, False
        self.session = ModelStep(START)
        self.pending: tuple | None = None
        self.measured: list[dict[str, str]] = []

    def submit(self, incumbent, candidate, blocks, block_steps, settle) -> None:
        self.pending = (Setting(dict(incumbent)), Setting(dict(candidate)), blocks, block_steps, settle)

    def result(self, timeout_s=None):
        from primus_perf.tuner.measure import blocks as measure_blocks

        if self.broken:
            return "broken", "Traceback (most recent call last):\nRuntimeError: CUDA error: modelled"
        inc, cand, blocks, block_steps, settle = self.pending
        self.measured.append(cand.values)
        try:
            t = measure_blocks({"incumbent": lambda: self.session.switch(inc),
                                "candidate": lambda: self.session.switch(cand)},
                               self.session.step, blocks=blocks, block_steps=block_steps, settle=settle)
        except OutOfMemory as exc:
            self.session.recover(inc)
            return "oom", str(exc)
        return "ok", (t["incumbent"], t["candidate"])

    def close(self) -> None:
        self.closed = True


def test_lanes_measure_a_levers_values_at_once_and_a_broken_lane_leaves_the_search() -> None:
    """A lever's values at once: the session's, then a lane's; the first lane breaks on its
    first candidate (measured again on the session, the lane closed), the other measures on;
    a lane's out-of-memory is recorded. The plan is the one the session alone finds."""
    broken, good = ModelLane("GPU 2", broken=True), ModelLane("GPU 1")
    session = ModelStep(START)
    said: list[str] = []
    search = Search(session, [LEVERS[n] for n in ("micro_batch", "compile", "recompute", "fp8", "optimizer")],
                    WHERE, blocks=2, block_steps=2, fits=_fits, lanes=[broken, good], log=said.append)
    res = search.run(START)
    alone, _ = _search()
    assert res.best.values == alone.best.values
    assert broken.closed and search.lanes == [good] and any("GPU 2 left the search" in m for m in said)
    on_lane = [t for t in res.trials if t.measured_on == "GPU 1"]
    assert on_lane and len(good.measured) == len(on_lane)
    bf16 = [t for t in res.trials if t.value == "bf16"]
    assert bf16 and all(t.status == OUT_OF_MEMORY for t in bf16)
    # the same trials in the same order with the same verdicts, whichever device measured each
    assert [(t.key, t.value, t.status) for t in res.trials] == [(t.key, t.value, t.status) for t in alone.trials]


def test_primus_tune_step_lanes_on_the_cpu_measure_in_a_second_process(tmp_path) -> None:
    out = tmp_path / "step"
    r = _cli(["step", "--config", "tiny", "--out", str(out), "--no-profile", "--levers", "micro_batch",
              "--lanes", "2", "--blocks", "2", "--block-steps", "1", "--final-blocks", "2", "--check-steps", "3",
              *TINY])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "measuring on 2 devices at once: the session's and lane 1" in r.stdout
    doc = json.loads((out / "step_plan.json").read_text())
    by = {m["value"]: m for m in doc["measured"]}
    assert set(by) >= {2, 4} and by[4]["measured_on"] == "lane 1" and by[2]["measured_on"] == "", by
    assert "train.micro_batch=4: " in r.stdout and "(on lane 1)" in r.stdout
    assert by[4]["speedup"] and by[4]["candidate_ms"]


def _cli(args: list[str], nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={_free_port()}", "-m", "primus_perf.cli.tune", *args]
    else:
        cmd = [sys.executable, "-m", "primus_perf.cli.tune", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


def test_primus_tune_step_on_the_cpu_writes_a_plan_primus_train_runs(tmp_path) -> None:
    out = tmp_path / "step"
    r = _cli(["step", "--config", "tiny", "--out", str(out), "--levers", "micro_batch,optimizer",
              "--blocks", "2", "--block-steps", "1", "--final-blocks", "2", "--check-steps", "4", *TINY])
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "step_plan.json").read_text())
    assert doc["schema"] == "primus-perf-step-plan/1" and (out / "manifest.json").is_file()
    values = {(m["lever"], m["value"]) for m in doc["measured"]}
    assert {("train.micro_batch", 2), ("train.micro_batch", 4), ("train.optimizer", "foreach")} <= values
    assert "step plan for tiny" in r.stdout and "search took" in r.stdout
    # the plan's figures once, in the summary (not also as the search's progress)
    assert r.stdout.count("plan vs default") == (doc["verdict"] is not None), r.stdout
    assert r.stdout.count("loss guard over") == (doc["loss_guard"] is not None), r.stdout
    assert read_plan(out / "plan.yaml") == doc["plan"]  # typed both, read back by the config's schema
    if doc["plan"]:  # a plan that changed something was checked against the default's loss
        assert doc["loss_guard"]["steps"] == 4
    t = subprocess.run([*CLI, "--config", "tiny", "--plan", str(out / "plan.yaml"), "--steps", "1", *TINY],
                       capture_output=True, text=True, timeout=300)
    assert t.returncode == 0, t.stderr[-2000:]
    if "train.micro_batch" in doc["plan"]:  # the plan's keys win over the overrides it was tuned with
        assert f"(micro-batch {doc['plan']['train.micro_batch']} x" in t.stdout, t.stdout[:500]
    a = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "analyze", str(out), "--json",
                        str(tmp_path / "a.json")], capture_output=True, text=True, timeout=300)
    assert a.returncode == 0, a.stderr[-2000:]


def test_two_ranks_search_fsdp2_in_lockstep_and_rank_0_writes(tmp_path) -> None:
    """Each rank's profile child meets the others' on the port rank 0 picked; then the search."""
    out = tmp_path / "step"
    r = _cli(["step", "--config", "tiny", "--out", str(out), "--levers", "fsdp_reshard,fsdp_prefetch",
              "--blocks", "2", "--block-steps", "1", "--final-blocks", "2", "--check-steps", "3",
              "parallel.dp_shard=2", *TINY], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads((out / "step_plan.json").read_text())
    measured = {(m["lever"], m["value"]) for m in doc["measured"]}
    assert {("parallel.fsdp_reshard_after_forward", False), ("parallel.fsdp_prefetch", 1),
            ("parallel.fsdp_prefetch", 2)} <= measured
    assert r.stdout.count("step plan for tiny") == 1 and r.stdout.count("profiling tiny") == 1  # rank 0 speaks
    assert {p.name for p in out.glob("rank*.pt.trace.json.gz")} == {"rank0.pt.trace.json.gz", "rank1.pt.trace.json.gz"}


def test_the_fp8_plan_per_layer_group_is_measured_under_the_plans_settings(tmp_path) -> None:
    """On the CPU FP8 loses everywhere (its quantization is slow there): each recipe for the
    whole model is dropped, then each layer group in the better one against bf16, none kept."""
    import torch

    from primus_perf.tuner.step import tune_step

    torch.set_num_threads(1)
    said: list[str] = []
    res = tune_step("tiny", [*TINY, "model.dim=64", "model.ffn_dim=128"], out=tmp_path, levers=[LEVERS["fp8"]],
                    blocks=2, block_steps=1, final_blocks=2, check_steps=3, log=said.append)
    assert {t.value: t.status for t in res.search.trials} == {"tensorwise": "dropped", "rowwise": "dropped"}
    groups = [line for line in said if line.startswith(("attention.", "mlp.", "output "))]
    assert len(groups) == 5 and all(line.endswith("dropped") for line in groups)
    assert any("no group pays" in line for line in said) and res.plan.values == {}
    assert not (tmp_path / "tuning_cache.json").exists()


def test_a_trainer_that_cannot_be_built_leaves_the_sessions_own_running() -> None:
    """A candidate run by a new trainer (what cannot switch in place) that fails to build: the
    session's setting is built again before the error goes on, and the session steps on."""
    from primus_perf.tuner.step.tune import StepSession

    session = StepSession("tiny", [*TINY, "train.device=cpu"], Setting())
    try:
        make = session._make

        def failing(cfg):
            if cfg.train.micro_batch == 2:
                raise RuntimeError("modelled: the build ran out of memory")
            return make(cfg)

        session._make = failing
        with pytest.raises(RuntimeError, match="modelled"):
            session._rebuild(session.cfg_of(Setting({"train.micro_batch": 2})))
        assert session.trainer is not None and session.trainer.cfg.train.micro_batch == 1
        assert session.step() > 0
    finally:
        session.close()


def test_the_budget_counts_several_trials_and_what_is_kept_back() -> None:
    """The FP8 plan asks for a trial per layer group at once; the loss guard's trainer builds
    are kept back besides its steps."""
    search = Search(ModelStep(START), [LEVERS["compile"]], WHERE, blocks=2, block_steps=2, settle=1,
                    deadline=time.monotonic() + 100.0, reserve_s=20.0)
    search.step_s = 1.0  # a trial: 2 pairs of blocks of 3 steps each side = 12 s
    assert search.trial_cost_s() == 12.0
    assert not search.over_budget() and not search.over_budget(trials=6)  # 72 + 20 < 100
    assert search.over_budget(trials=7)  # 84 + 20 > 100


def test_on_a_gpu_a_candidate_estimated_within_the_headroom_is_not_tried(monkeypatch) -> None:
    """Estimates at 97.6% and 98.5% of an H100 ran out of memory, 88.7% ran: a candidate past
    95% is recorded as not fitting, with the estimate, and never switched to."""
    import primus_perf.trainer.resources as resources
    from primus_perf.trainer.resources import MemoryEstimate

    gib = 2**30
    need = {1: 60 * gib, 2: 94 * gib, 4: 99 * gib}
    monkeypatch.setattr(resources, "check_fits", lambda cfg, device_type, index=0: None)
    monkeypatch.setattr(resources, "device_memory", lambda device_type, index=0: (100 * gib, "the GPU"))
    monkeypatch.setattr(resources, "estimate_memory",
                        lambda cfg, device_type: MemoryEstimate(need[cfg.values["train.micro_batch"]], 0, 0))
    session = ModelStep(START)
    res = Search(session, [LEVERS["micro_batch"]], WHERE, blocks=2, block_steps=1).run(START)
    status = {t.value: (t.status, t.reason) for t in res.trials}
    assert status[2][0] == "kept" and status[4][0] == DOES_NOT_FIT
    assert status[4][1] == ("the config needs about 99.0 GiB (parameters and optimizer 99.0, activations 0.0, logits"
                              " 0.0), within 5% of the GPU (100.0 GiB): the allocator's fragmentation takes that")
    assert res.best.values["train.micro_batch"] == 2


def test_the_failed_steps_tensors_are_released_before_the_session_gets_back() -> None:
    """The out-of-memory error's traceback holds the failed step's frames and, through them,
    its tensors: the session gets back to the incumbent only once the error is gone (on H100s
    the trial after an out-of-memory one ran out at 74 GiB with an estimate of 36)."""
    import gc
    import weakref

    class Activations:
        pass

    class Failing(ModelStep):
        held: weakref.ref | None = None
        alive_at_recover: ClassVar[list[bool]] = []

        def step(self) -> float:
            if self.setting.values["train.optimizer"] == "bf16":
                activations = Activations()  # what the failed step had allocated
                Failing.held = weakref.ref(activations)
                raise OutOfMemory("out of memory at step 3: modelled")
            return super().step()

        def recover(self, setting: Setting) -> None:
            gc.collect()
            Failing.alive_at_recover.append(Failing.held() is not None)
            super().recover(setting)

    res = Search(Failing(START), [LEVERS["optimizer"]], WHERE, blocks=2, block_steps=1, fits=_fits).run(START)
    assert any(t.status == OUT_OF_MEMORY for t in res.trials)
    assert Failing.alive_at_recover and not any(Failing.alive_at_recover)


def test_an_ordered_lever_leaves_out_the_side_that_lost() -> None:
    """From micro-batch 2, the advised 4 wins: 1, below 2, is not measured, and the log says why.
    Without a winner every value is measured."""
    start = START.with_({"train.micro_batch": 2})
    said: list[str] = []
    search = Search(ModelStep(start), [LEVERS["micro_batch"]], WHERE, advice=[Advice("train.micro_batch", 4, 9.0)],
                    blocks=2, block_steps=2, fits=_fits, log=said.append)
    res = search.run(start)
    assert [(t.value, t.status) for t in res.trials] == [(4, "kept")]
    assert "micro_batch: 1 not measured (4 won against 2: the step is taken to be unimodal in micro_batch)" in said
    assert res.best.values["train.micro_batch"] == 4
    # nothing won (1 loses, 4 does not fit): every value measured
    search = Search(ModelStep(start), [LEVERS["micro_batch"]], WHERE, advice=[Advice("train.micro_batch", 1, 9.0)],
                    blocks=2, block_steps=2, fits=lambda s: "never fits" if s.values["train.micro_batch"] == 4 else None)
    res = search.run(start)
    assert [t.value for t in res.trials] == [1, 4]


def test_each_advised_value_is_measured_before_any_levers_other_values() -> None:
    """With two levers advised, both advised values run first (a short budget gets both), then
    each lever's other values; a win from 1 to 2 leaves 1 out of the micro-batch's next visit."""
    said: list[str] = []
    advice = [Advice("train.compile", "block", 12.0), Advice("train.micro_batch", 2, 9.0)]
    search = Search(ModelStep(START), [LEVERS[n] for n in ("micro_batch", "compile")], WHERE, advice=advice,
                    blocks=2, block_steps=2, fits=_fits, log=said.append)
    res = search.run(START)
    assert [(t.value, t.status) for t in res.trials[:2]] == [("block", "kept"), (2, "kept")]
    assert "the advised values first: compile=block, micro_batch=2" in said
    assert [line.split(")")[0] for line in said if line.startswith("(")][:2] == ["(advised", "(advised"]
    assert "micro_batch: 1 not measured (2 won against 1: the step is taken to be unimodal in micro_batch)" in said
    assert [t.value for t in res.trials if t.key == "train.micro_batch"] == [2, 4]
    assert res.best.values["train.micro_batch"] == 4 and res.best.values["train.compile"] == "block"
    # a budget that ends inside the advised values says so
    late = Search(ModelStep(START), [LEVERS[n] for n in ("micro_batch", "compile")], WHERE, advice=advice,
                  blocks=2, block_steps=2, fits=_fits, deadline=0.0)
    stopped = late.run(START).stopped
    assert stopped.startswith("the budget ran out before any trial (") and "in the advised values, at compile=block" \
        in stopped and not late.trials
    # a script's own value ("", or the config's None) is said as written, not as an empty "compile="
    assert "in pass 1, at compile=(as written)" in late.out_of_budget("pass 1", LEVERS["compile"], "")
    assert Setting({"compile": "", "micro_batch": "8"}).label() == "compile=(as written) micro_batch=8"


def test_an_advised_value_that_lost_is_not_measured_again_against_the_same_incumbent() -> None:
    """FP8 (eager blocks: slower) and selective recompute advised: both lose first; pass 1
    measures each lever's other values only, nothing twice."""
    advice = [Advice("train.fp8", "tensorwise", 15.0), Advice("train.recompute", "selective", 3.0)]
    search = Search(ModelStep(START), [LEVERS[n] for n in ("fp8", "recompute")], WHERE, advice=advice,
                    blocks=2, block_steps=2, fits=_fits)
    res = search.run(START)
    seen = [(t.key, t.value) for t in res.trials]
    assert seen[:2] == [("train.fp8", "tensorwise"), ("train.recompute", "selective")]
    assert len(seen) == len(set(seen)) and ("train.recompute", "full") in seen and res.best == START


class ScaleStep:
    """A script's session: the step time falls with the micro-batch; "" is the script as written
    (its own flag's 2)."""

    def __init__(self) -> None:
        self.setting = Setting({"micro_batch": ""})

    def switch(self, setting: Setting) -> None:
        self.setting = setting

    def measure(self, base: Setting, other: Setting, **_blocks: int) -> tuple[list[float], list[float]]:
        def t(s: Setting) -> float:
            return 100.0 / (int(s.values["micro_batch"] or 2) ** 0.1)
        return [t(base)] * 2, [t(other)] * 2


def test_a_scripts_own_value_spelled_otherwise_is_not_measured_and_rules_out_no_side() -> None:
    """The program's own flag offers 2, 4 and 8 with "" (as written: 2) the incumbent: 2 is not
    measured against it; 4 wins, 8 wins over 4, and nothing else is measured."""
    from primus_perf.tuner.step.levers import ScriptContext

    lever = LEVERS["micro_batch"].for_script()
    where = ScriptContext(found={}, knobs={"micro_batch": {"default": 2, "via": "own"}}, device_type="cuda",
                          own={"micro_batch": ["2", "4", "8"]})
    said: list[str] = []
    search = Search(ScaleStep(), [lever], where, advice=[Advice("micro_batch", "4", 5.0)], blocks=2, block_steps=1,
                    fits=lambda _s: None, log=said.append)
    res = search.run(Setting({"micro_batch": ""}))
    assert [(t.value, t.status) for t in res.trials] == [("4", "kept"), ("8", "kept")], [t.line() for t in res.trials]
    assert res.best.values == {"micro_batch": "8"} and not any("not measured" in line for line in said)


def test_a_value_left_out_against_a_script_as_written_is_said_in_its_own_terms() -> None:
    from primus_perf.tuner.step.levers import ScriptContext

    where = ScriptContext(found={}, knobs={"micro_batch": {"default": 2, "via": "own"}}, device_type="cuda",
                          own={"micro_batch": ["1", "2", "4"]})
    said: list[str] = []
    res = Search(ScaleStep(), [LEVERS["micro_batch"].for_script()], where, advice=[Advice("micro_batch", "4", 5.0)],
                 blocks=2, block_steps=1, fits=lambda _s: None, log=said.append).run(Setting({"micro_batch": ""}))
    assert [t.value for t in res.trials] == ["4"]
    assert "micro_batch: 1 not measured (4 won against 2 (as written): the step is taken to be unimodal" \
           " in micro_batch)" in said, said


def test_a_scripts_micro_batch_scale_reads_as_written_as_its_own_value() -> None:
    from primus_perf.tuner.step.levers import ScriptContext

    lever = LEVERS["micro_batch"].for_script()
    knob = ScriptContext(found={}, knobs={"micro_batch": {"default": 2, "choices": [1, 2, 4, 8]}}, device_type="cuda")
    assert [lever.scale(knob, v) for v in ("", "8", "1")] == [2.0, 8.0, 1.0]
    # a knob asked with no default: 1, as its values take it
    none = ScriptContext(found={}, knobs={"micro_batch": {"default": None}}, device_type="cuda")
    assert lever.scale(none, "") == 1.0
    assert LEVERS["compile"].for_script().scale is None


def test_what_the_plan_keeps_after_its_verdict_and_its_loss() -> None:
    """``checked_plan``, shared by primus-train's and a script's step tuner: the default where
    the step did not bear the plan out or nothing numeric can go; the plan where its loss holds
    or none was seen; else the plan without what changes the numerics (and what goes with it),
    measured again and kept only where it wins."""
    from primus_perf.tuner.step.search import SearchResult
    from primus_perf.tuner.step.tune import LossGuard, StepTuneResult, checked_plan, plan_verdict

    start = Setting({"train.micro_batch": 1, "train.fp8": "off", "tuning.cache": ""})
    plan = start.with_({"train.micro_batch": 4, "train.fp8": "tensorwise", "tuning.cache": "c.json"})
    fast, slow = [1.0, 1.0, 1.0], [0.8, 0.8, 0.8]
    holds, drifts = LossGuard(10, 1, 2.0, 2.001, 0.015, 2.0), LossGuard(10, 1, 2.0, 2.2, 0.015, 2.0)
    measured: list[Setting] = []

    def case(verdict_plan: list[float], guard: LossGuard | None, again: list[float] = slow,
             the_plan: Setting = plan, **kw: object) -> tuple[Setting, StepTuneResult]:
        res = StepTuneResult("tiny", [], SearchResult(start, start, [], 0, {}), Setting(), plan_verdict(fast, verdict_plan))
        kept = checked_plan(res, start, the_plan, guard=lambda: guard,
                            measure=lambda s: (measured.append(s), (fast, again))[1], log=lambda _m: None, **kw)
        return kept, res

    kept, res = case(fast, holds)  # no faster
    assert kept == start and "did not bear the plan out" in res.notes[0] and res.guard is None
    assert case(slow, holds)[0] == plan and case(slow, None)[0] == plan
    assert "no loss seen" in case(slow, None)[1].notes[0]
    kept, res = case(slow, drifts)  # FP8 dropped, the rest measured again: it still wins
    assert kept == plan.with_({"train.fp8": "off"}) and measured[-1] == kept
    assert list(res.dropped_by_guard) == ["train.fp8"] and res.verdict is not None and res.verdict.kept
    assert case(slow, drifts, again=fast)[0] == start  # the rest no faster: the default
    kept, _ = case(slow, drifts, goes_with=lambda n: {**n, "tuning.cache": ""})
    assert kept == plan.with_({"train.fp8": "off", "tuning.cache": ""})
    kept, res = case(slow, drifts, the_plan=start.with_({"train.micro_batch": 4}))  # nothing numeric to drop
    assert kept == start and "nothing in the plan changes the numerics" in res.notes[-1]
