"""The step tuner for a user's script on the CPU: the plan's levers applied from outside to the
objects a real program builds (``tuner.step.hooks``), a measured run of a real script
(``tuner.step.measured``), and a real search of a small training script over two levers with
its loss guard, the plan written and run again unmodified by ``python -m primus_perf.launch
--plan``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from primus_perf.cli.tune import app
from primus_perf.tuner.step import hooks, measured
from primus_perf.tuner.step.script import script_guard, tune_script

SCRIPT = """
import sys

import torch

import primus_perf

steps = int(sys.argv[sys.argv.index("--steps") + 1])
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList(Block() for _ in range(4))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
global_batch = 32
micro = primus_perf.knob("micro_batch", 2, choices=[2, 8])
data = torch.randn(global_batch, 4, 8)  # small: a micro-batch's time is its Python and launches
for step in range(steps):
    for i in range(global_batch // micro):
        x = data[i * micro:(i + 1) * micro]
        (model(x).square().mean() / (global_batch // micro)).backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("script") / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture
def installed():
    """``hooks.install`` for a test, every hook and patch removed after it."""
    yield hooks.install
    hooks.uninstall()


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x)


class _Model(torch.nn.Module):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(blocks))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return self.head(x)


def test_knob_is_the_default_outside_a_plan_and_the_plans_typed_value_inside(installed) -> None:
    assert hooks.knob("micro_batch", 2) == 2
    installed({"micro_batch": "8"})
    assert hooks.knob("micro_batch", 2, choices=[1, 2, 4, 8]) == 8
    assert hooks.applied().knobs == {"micro_batch": {"default": 2, "choices": [1, 2, 4, 8]}}


def test_the_model_and_its_blocks_are_found_from_the_first_optimizer_and_the_levers_apply(installed) -> None:
    """The model is the outermost module holding the first optimizer's parameters; its blocks
    the ModuleList holding most of them. Recompute and block compile apply before its first
    forward runs, the optimizer's implementation on its first step."""
    applied = installed({"recompute": "full", "compile": "block", "optimizer": "foreach"})
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert applied.found["model"] == "_Model" and applied.found["blocks"] == 3 and applied.found["blocks_at"] == "layers"
    assert sorted(applied.levers) == ["compile", "optimizer", "recompute"] and not applied.notes
    assert all(b._compiled_call_impl is not None for b in model.layers) and model._compiled_call_impl is None
    assert all(b.forward.func.__name__ == "checkpoint" for b in model.layers)
    assert all(g["foreach"] and not g["fused"] for g in opt.param_groups)


@pytest.mark.parametrize("scope", ["model", "block"])
def test_a_program_that_compiles_itself_is_found_so_and_the_compile_lever_left_alone(installed, scope) -> None:
    """``torch.compile(model)`` (or every block compiled): the model is found by its own class,
    its compile scope recorded, and the compile lever says why it does not search there."""
    from primus_perf.tuner.step.levers import LEVERS, ScriptContext

    applied = installed({})
    model = _Model()
    if scope == "block":
        for b in model.layers:
            b.compile(backend="eager")
        run = model
    else:
        run = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(run.parameters(), lr=1e-3)
    run(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert applied.found["model"] == "_Model" and applied.found["block"] == "_Block"
    assert applied.found["compiled"] == scope
    why = LEVERS["compile"].for_script().legal(ScriptContext(dict(applied.found), {}, "cpu"))
    assert why == f"the program compiles its {'model' if scope == 'model' else 'blocks'} itself (torch.compile): left as it is"
    plain = ScriptContext({**applied.found, "compiled": ""}, {}, "cpu")
    assert LEVERS["compile"].for_script().legal(plain) is None


def test_transformers_gradient_checkpointing_the_program_turned_on_is_a_lever_to_turn_off(installed) -> None:
    """A script that calls ``gradient_checkpointing_enable()``: found so, the recompute lever's
    value is "off" (not a second checkpoint), and the plan turns it off before the first forward;
    blocks the program wraps in ``checkpoint_wrapper`` are left as they are."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from transformers import LlamaConfig, LlamaForCausalLM

    from primus_perf.tuner.step.levers import LEVERS, ScriptContext

    applied = installed({"recompute": "off"})
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert applied.found["recompute"] == "transformers" and applied.levers == ["recompute"] and not applied.notes
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    lever = LEVERS["recompute"].for_script()
    where = ScriptContext(dict(applied.found), {}, "cpu")
    assert lever.values(where) == ["", "off"] and lever.legal(where) is None
    assert lever.script.from_trainer("none") == "off"
    wrapped = ScriptContext({**applied.found, "recompute": "wrapper"}, {}, "cpu")
    assert lever.legal(wrapped) == "the program checkpoints every block itself (checkpoint_wrapper): left as it is"
    hooks.uninstall()
    applied = hooks.install({"recompute": "off"})
    plain = _Model()
    plain.layers = torch.nn.ModuleList(checkpoint_wrapper(b) for b in plain.layers)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    plain(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert applied.found["recompute"] == "wrapper" and not applied.levers
    assert applied.notes == ["recompute: not applied (the program does not turn on transformers' gradient checkpointing)"]


def test_a_lever_that_cannot_apply_says_why_and_the_program_runs_on(installed) -> None:
    applied = installed({"recompute": "full", "optimizer": "fused", "fsdp_reshard": "false"})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert applied.notes == [
        "recompute: not applied (no repeated blocks found (no nn.ModuleList or nn.ModuleDict of two or more modules"
        " of one class))",
        "fsdp_reshard: not applied (the program does not use FSDP2 (fully_shard))",
        "optimizer: not applied (fused needs every parameter on the GPU)"]


class _DictModel(torch.nn.Module):
    """torchtitan's shape: its blocks in an nn.ModuleDict (``layers``), a smaller ModuleList beside."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block() for i in range(3)})
        self.extras = torch.nn.ModuleList(torch.nn.Linear(16, 1) for _ in range(2))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers.values():
            x = b(x)
        return self.head(x)


def test_blocks_in_an_nn_module_dict_are_found_and_take_the_levers(installed) -> None:
    """The container holding most parameters, ModuleList or ModuleDict: torchtitan's blocks
    (``layers``, an nn.ModuleDict) over a smaller ModuleList of two linears, some of them
    wrapped for activation checkpointing or not."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    applied = installed({"recompute": "full"})
    model = _DictModel()
    assert hooks.blocks_of(model) == ("layers", list(model.layers.values()))
    every_other = _DictModel()  # torchtitan's selective checkpointing wraps every other block
    every_other.layers["1"] = checkpoint_wrapper(every_other.layers["1"])
    assert hooks.blocks_of(every_other) == ("layers", list(every_other.layers.values()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    assert applied.found["blocks"] == 3 and applied.found["blocks_at"] == "layers" and applied.levers == ["recompute"]
    assert all(b.forward.func.__name__ == "checkpoint" for b in model.layers.values())


def test_fsdp2_over_one_rank_is_found_as_such_and_its_levers_do_not_apply(installed) -> None:
    """fully_shard over a one-rank mesh (torchtitan shards even on one GPU) shards nothing:
    the FSDP2 levers are not searched there."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from primus_perf.tuner.step.levers import LEVERS, ScriptContext

    applied = installed({})
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29543", rank=0, world_size=1)
    try:
        model = _DictModel()
        for b in model.layers.values():
            fully_shard(b)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
    finally:
        dist.destroy_process_group()
    assert applied.found["fsdp2"] and applied.found["fsdp2_ranks"] == 1
    assert (applied.found["model"], applied.found["block"]) == ("_DictModel", "_Block")  # not FSDP's subclasses
    where = ScriptContext(dict(applied.found), {}, "cpu")
    for name in ("fsdp_reshard", "fsdp_prefetch"):
        assert LEVERS[name].for_script().legal(where) == "FSDP2 shards over one rank here"
    two = ScriptContext({**applied.found, "fsdp2_ranks": 2}, {}, "cpu")
    assert LEVERS["fsdp_reshard"].for_script().legal(two) is None


def test_an_hf_trainers_micro_batch_moves_with_its_accumulation_and_the_product_holds(installed, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    applied = installed({"micro_batch": "8"})
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          gradient_accumulation_steps=4, report_to=[])
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (8, 1)
    assert applied.knobs["micro_batch"] == {"default": 2, "choices": [1, 2, 4, 8], "via": "hf_trainer"}
    assert applied.found["hf_trainer"] and "micro_batch" in applied.levers


def test_a_hook_on_a_module_imported_later_never_breaks_its_import(installed, tmp_path, monkeypatch) -> None:
    """A patch that fails on the module (another version of it) is the lever's note; the
    program's import goes on unpatched, whether the module comes later or is in already."""
    (tmp_path / "later_module_here.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    applied = installed({})

    def boom(module) -> None:
        raise AttributeError(f"{module.__name__} has no TrainingArguments")

    hooks._after_import("later_module_here", boom, "micro_batch")
    try:
        import later_module_here

        assert later_module_here.VALUE == 1
        hooks._after_import("later_module_here", boom, "micro_batch")  # imported already: at once
    finally:
        sys.modules.pop("later_module_here", None)
    assert applied.notes == ["micro_batch: not applied (later_module_here could not be hooked: AttributeError:"
                             " later_module_here has no TrainingArguments)"]


def test_the_sdpa_backend_is_the_plans_until_the_hooks_are_removed(installed) -> None:
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())
    assert installed({"sdpa": "cudnn"}).levers == ["sdpa"]
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == (True, False, False)
    hooks.uninstall()
    assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == before


def test_ddps_constructor_takes_the_plans_buckets(installed) -> None:
    import torch.distributed as dist

    installed({"ddp_bucket_mb": "100", "ddp_bucket_view": "true"})
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        assert ddp.bucket_bytes_cap == 100 * 2**20 and ddp.gradient_as_bucket_view
        assert hooks.applied().found["ddp"]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ddp(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert hooks.applied().found["model"] == "Linear" and hooks.applied().found["ddp"]  # the model DDP wraps
        assert not hooks.applied().found["compiled"]
        hooks.uninstall()
        applied = hooks.install({})
        run = torch.compile(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8)), backend="eager")
        opt = torch.optim.SGD(run.parameters(), lr=0.1)
        run(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert (applied.found["model"], applied.found["ddp"], applied.found["compiled"]) == ("Linear", True, "model")
    finally:
        dist.destroy_process_group()


def test_a_measured_run_times_its_own_steps_and_stops(script: Path, tmp_path: Path) -> None:
    """Warm-up steps left out, timed steps in, each with its loss (the step's backward scalars:
    their sum is the step's loss where the script scales it by its accumulation steps); then
    the script stops (it would run 1000 steps)."""
    res = measured.run_script([str(script), "--steps", "1000"], {"micro_batch": "4"}, warmup=2, steps=3)
    assert res.status == measured.OK and len(res.step_s) == 3 and res.marked == 5 and res.seconds > 0
    assert all(s > 0 for s in res.step_s) and all(v is not None for v in res.loss_sum)
    assert res.loss_mean[0] == pytest.approx(res.loss_sum[0] / 8)  # 32 sequences / 4 a micro-batch
    assert res.applied["knobs"]["micro_batch"]["default"] == 2 and res.applied["found"]["blocks"] == 4
    short = measured.run_script([str(script), "--steps", "3"], {}, warmup=2, steps=3)
    assert short.status == measured.TOO_FEW and "marked 3 steps and a run needs 5" in short.reason
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('the data is gone')\n")
    failed = measured.run_script([str(broken)], {}, warmup=0, steps=1)
    assert failed.status == measured.CANNOT_RUN and failed.reason == "RuntimeError: the data is gone"
    wrapped = tmp_path / "wrapped.py"  # a lazy import's wrapper hides the error under it
    wrapped.write_text("try:\n    import no_such_module_here\nexcept ImportError as exc:\n"
                       "    raise ModuleNotFoundError(\"Could not import module 'Trainer'\") from exc\n")
    log = tmp_path / "runs.log"
    failed = measured.run_script([str(wrapped)], {}, warmup=0, steps=1, log_file=log)
    assert failed.reason == ("ModuleNotFoundError: Could not import module 'Trainer' (from ModuleNotFoundError:"
                             " No module named 'no_such_module_here')"), failed.reason
    assert "Traceback" in log.read_text() and "no_such_module_here" in log.read_text()
    looped = tmp_path / "looped.py"  # a chain of causes that loops: the run still ends, with its reason
    looped.write_text("a, b = RuntimeError('a'), KeyError('b')\na.__cause__, b.__cause__ = b, a\nraise a\n")
    failed = measured.run_script([str(looped)], {}, warmup=0, steps=1)
    assert failed.status == measured.CANNOT_RUN and failed.reason == "RuntimeError: a (from KeyError: 'b')"


def test_a_profile_run_that_fails_is_one_line_and_no_advice(tmp_path: Path) -> None:
    """The search then goes on in the registry's order; the child's last line says why."""
    from primus_perf.tuner.step.search import profile_advice

    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit('no data at /datasets/missing')\n")
    said: list[str] = []
    advice = profile_advice(["--", str(broken)], tmp_path / "prof", env=measured.child_env(None, None),
                            log_file=tmp_path / "runs.log", timeout_s=120, log=said.append, agree=lambda x: x,
                            is_main=True)
    assert advice == [] and said[0].startswith(f"profiling {broken}")
    assert said[-1].startswith("no profile (the profile run exited with 2: the program exited with code 1 after"
                               " 0 steps") and said[-1].endswith("the levers go in the registry's order"), said
    assert "no data at /datasets/missing" in (tmp_path / "runs.log").read_text()


def test_the_loss_guard_compares_on_the_statistic_the_runs_agree_on() -> None:
    """A script that scales its loss by its accumulation: the step's backward scalars sum to
    its loss, whatever the micro-batch; their mean moves with it."""
    def run(sums: list[float], parts: int) -> measured.RunResult:
        return measured.RunResult(measured.OK, step_s=[1.0] * len(sums), loss_sum=sums,
                                  loss_mean=[x / parts for x in sums])

    guard = script_guard([run([2.0, 1.9], 4), run([2.02, 1.92], 4)], [run([2.01, 1.91], 1)], 0.015)
    assert guard is not None and guard.passed and guard.rel_diff < 0.01
    assert guard.spread == pytest.approx(abs(1.97 - 1.96) / 1.96, rel=1e-6)
    bad = script_guard([run([2.0, 1.9], 4)], [run([2.5, 2.4], 1)], 0.015)
    assert bad is not None and not bad.passed


def test_a_real_search_of_a_script_finds_its_plan_checks_its_loss_and_launch_runs_it(script: Path, tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """Two levers of a small training script: the micro-batch (its consent, at its fixed global
    batch of 32 sequences) and recompute. Each candidate is a run of the script against runs of
    the incumbent; a larger micro-batch pays (a quarter of the micro-batches, each costing its
    Python and launches), recompute does not. The plan is checked against the default's loss and written; launch --plan runs it."""
    from primus_perf.tuner.step.levers import LEVERS

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # each run one thread: runs do not time each other's load
    out = tmp_path / "step"
    target = [str(script), "--steps", "1000"]
    said: list[str] = []
    res = tune_script(target, out, levers=[LEVERS["micro_batch"].for_script(), LEVERS["recompute"].for_script()],
                      budget_min=5, warmup=2, steps=3, passes=1, final_blocks=2, profile=False, log=said.append)
    assert res.plan.values == {"micro_batch": "8"}, res.lines()
    assert res.verdict is not None and res.verdict.kept and res.speedup > 1.1
    assert res.guard is not None and res.guard.passed
    trials = {(t.key, t.value): t.status for t in res.search.trials}
    assert trials[("recompute", "full")] == "dropped"
    doc = json.loads((out / "step_plan.json").read_text())
    # the default; micro-batch 8, the default; the new incumbent, recompute, the incumbent; the
    # plan twice between three runs of the default: 11 runs
    assert doc["program"] == target and doc["plan"] == res.plan.values and len(doc["runs"]) == 11
    plan_text = (out / "plan.yaml").read_text()
    assert plan_text.startswith("# primus-perf step plan for") and "levers:\n  micro_batch:" in plan_text
    run = subprocess.run([sys.executable, "-m", "primus_perf.launch", "--plan", str(out / "plan.yaml"), "--",
                          str(script), "--steps", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"step plan {out / 'plan.yaml'}: micro_batch=" in run.stderr


def test_the_cli_takes_a_script_after_dashes_and_refuses_a_config_beside_it(script: Path, tmp_path: Path,
                                                                           capsys) -> None:
    from primus_perf.cli.common import run_app

    for args, said in ((["--config", "tiny", "--", str(script)], "a script after -- is run as it is"),
                       ([], "needs --config PRESET [overrides], or your script after --"),
                       (["--levers", "grouped_backend", "--", str(script)], "unknown lever grouped_backend")):
        with pytest.raises(SystemExit) as exc:
            run_app(app, ["step", "--out", str(tmp_path / str(len(args))), *args])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and said in err and "Traceback" not in err, err


DDP_SCRIPT = """
import sys

import torch
import torch.distributed as dist

steps = int(sys.argv[sys.argv.index("--steps") + 1])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    model(torch.randn(4, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_under_torchrun_a_failed_child_stops_the_other_ranks_children_and_all_agree(tmp_path: Path) -> None:
    """Rank 1's child fails at once; rank 0's, left waiting for it (a collective that never
    completes), is stopped, and both ranks return rank 1's code; the next run goes on."""
    job = tmp_path / "job.py"
    job.write_text("""
import os, sys, time
import torch.distributed as dist
from primus_perf.tuner.step.measured import run_logged
dist.init_process_group("gloo")
rank = dist.get_rank()
waits = [sys.executable, "-c", "import time; time.sleep(600)"]  # the peer that never comes
child = [sys.executable, "-c", "raise SystemExit(3)"] if rank == 1 else waits
t0 = time.monotonic()
code = run_logged(child, dict(os.environ), None, 300)
after = run_logged([sys.executable, "-c", "pass"], dict(os.environ), None, 300)
print(f"rank {rank}: {code} then {after} in {time.monotonic() - t0:.0f} s")
dist.destroy_process_group()
""")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(job)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    said = sorted(re.findall(r"rank (\d): (\d+) then (\d+) in (\d+) s", res.stdout))  # the ranks' lines may interleave
    assert [s[:3] for s in said] == [("0", "3", "0"), ("1", "3", "0")] and all(int(s[3]) < 60 for s in said), res.stdout


def test_under_torchrun_every_rank_runs_its_child_in_lockstep(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m primus_perf.cli.tune step -- train.py``: the two tuner
    ranks agree over their own gloo group; each starts its child of each run, the children meet
    on a port rank 0 picked, and DDP's option is measured as a candidate like any other."""
    script = tmp_path / "train_ddp.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "step"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                          "primus_perf.cli.tune", "step", "--out", str(out), "--budget-min", "3", "--levers",
                          "ddp_bucket_view", "--no-profile", "--warmup-steps", "1", "--run-steps", "3",
                          "--final-blocks", "2", "--", str(script), "--steps", "1000"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads((out / "step_plan.json").read_text())
    assert doc["found"]["ddp"] and [(t["lever"], t["value"]) for t in doc["measured"]] == [("ddp_bucket_view", "true")]
    assert all(r["status"] == "ok" for r in doc["runs"]) and len(doc["runs"]) >= 3
    assert res.stdout.count("step plan for") == 1  # rank 0 speaks for both
