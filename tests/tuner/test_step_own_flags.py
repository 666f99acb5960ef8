"""Levers as a known program's own flags (``tuner.step.own_flags``): torchtitan's command line
rewritten (tyro's grammar), its settings read by its own parser from its real llama3 configs,
the rewritten command line parsed back by that parser, float8 through its own converter, its
blocks (an nn.ModuleDict) found, the benchmark case's tokenizer and data read by its own
tokenizer and data set, and a measured run of ``-m torchtitan.train`` on the CPU up to where it
needs a GPU (its trainer runs on CUDA only: its device falls back to ``cuda``). torchtitan 0.3
and 0.2 (the one torch 2.11 imports) are two entries of the table; the tests of each need that
version installed and skip otherwise."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from primus_perf.tuner.step import hooks, measured, own_flags
from primus_perf.tuner.step.levers import LEVERS, ScriptContext

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ["-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel"]
FP8 = "primus_perf.tuner.step.torchtitan_fp8.float8_linears"


@pytest.fixture
def uninstalled():
    yield
    hooks.uninstall()


def _titan(major_minor: tuple[int, int]):
    have = own_flags.installed_version("torchtitan")
    if have is None or have[:2] != major_minor:
        pytest.skip(f"torchtitan {'.'.join(map(str, major_minor))} is not installed (found {have})")
    from torchtitan.config import ConfigManager

    return ConfigManager


@pytest.fixture
def titan():
    """torchtitan 0.3's ConfigManager."""
    return _titan((0, 3))


@pytest.fixture
def titan02():
    """torchtitan 0.2's ConfigManager."""
    return _titan((0, 2))


@pytest.fixture
def as_installed(monkeypatch):
    """The version the table's entries are picked by, as if installed: ``as_installed((0, 3))``."""
    return lambda version: monkeypatch.setattr(own_flags, "installed_version", lambda _dist: version)


def test_tyro_options_go_before_the_subcommand_and_a_subcommand_replaces_the_programs_choice() -> None:
    merge = own_flags.TORCHTITAN.merge
    args = ["--module", "llama3", "--training.steps", "5", "activation-checkpoint:selective",
            "--activation-checkpoint.debug"]
    assert merge(args, ("--compile.enable", "--compile.components", "model")) == [
        "--module", "llama3", "--training.steps", "5", "--compile.enable", "--compile.components", "model",
        "activation-checkpoint:selective", "--activation-checkpoint.debug"]
    assert merge(args, ("activation-checkpoint:full",)) == [
        "--module", "llama3", "--training.steps", "5", "activation-checkpoint:full"]
    assert merge(["--module", "x"], ("activation-checkpoint:none",)) == ["--module", "x", "activation-checkpoint:none"]
    assert merge(["activation-checkpoint:full", "--activation-checkpoint.debug", "other:one", "--other.x", "1"],
                 ("activation-checkpoint:none",)) == ["activation-checkpoint:none", "other:one", "--other.x", "1"]


def test_a_list_option_keeps_the_programs_own_values() -> None:
    """--override.imports: the program's last one wins, so the fp8 override joins its list."""
    merge = own_flags.TORCHTITAN.merge
    mine = f'{FP8}={{"recipe": "rowwise"}}'
    assert merge(["--override.imports", "a.b.c", "d.e.f", "--training.steps", "5"], ("--override.imports", mine)) == [
        "--training.steps", "5", "--override.imports", "a.b.c", "d.e.f", mine]
    assert merge(["--override.imports=a.b.c"], ("--override.imports", mine)) == ["--override.imports", "a.b.c", mine]


def _reading(micro: int = 2, global_batch: int = 32, dp: int = 1, entry=own_flags.TORCHTITAN):
    settings = own_flags.Settings(micro, global_batch, dp, 1, {"micro_batch": str(micro), "compile": "off",
                                                               "recompute": "selective", "fp8": "off"})
    return dataclasses.replace(entry, read=lambda _args: settings)


def test_the_plans_levers_become_the_programs_flags_and_the_hooks_get_the_rest(monkeypatch, as_installed,
                                                                               uninstalled) -> None:
    """Compile, recompute, fp8 and the micro-batch (with the global batch held) as torchtitan's
    options; the SDPA backend, which it has no flag for, through hooks; a lever its flag set is
    not in the hooks' plan (no second compile or float8 conversion)."""
    as_installed((0, 3, 0))
    monkeypatch.setitem(own_flags.PROGRAMS, "torchtitan-0.3", _reading())
    plan = {"micro_batch": "8", "compile": "block", "recompute": "full", "fp8": "rowwise", "sdpa": "cudnn"}
    target, applied, prog = own_flags.install([*DEBUG, "--training.steps", "9"], plan)
    assert prog is not None and prog.name == "torchtitan-0.3"
    assert target == [*DEBUG, "--training.steps", "9", "--training.local-batch-size", "8",
                      "--training.global-batch-size", "32", "--compile.enable", "--compile.components", "model",
                      "--override.imports", f'{FP8}={{"recipe": "rowwise"}}', "activation-checkpoint:full"]
    assert applied.plan == {"sdpa": "cudnn"} and hooks.applied() is applied
    assert sorted(applied.levers) == ["compile", "fp8", "micro_batch", "recompute", "sdpa"] and not applied.notes
    assert applied.knobs["micro_batch"] == {"default": 2, "choices": [1, 2, 4, 8, 16, 32], "via": "torchtitan-0.3"}
    assert applied.found["program"] == "torchtitan-0.3" and applied.found["own"]["recompute"] == "selective"


def test_torchtitan_02s_flags_are_its_own_options_and_its_converter_list_keeps_its_own(monkeypatch, as_installed,
                                                                                      uninstalled) -> None:
    as_installed((0, 2, 2))
    monkeypatch.setitem(own_flags.PROGRAMS, "torchtitan-0.2", _reading(entry=own_flags.TORCHTITAN_02))
    target, applied, prog = own_flags.install(["-m", "torchtitan.train", "--model.converters", "quantize.linear.mx"],
                                              {"recompute": "full", "fp8": "tensorwise"})
    assert prog is own_flags.PROGRAMS["torchtitan-0.2"] and not applied.notes
    assert target == ["-m", "torchtitan.train", "--activation-checkpoint.mode", "full", "--model.converters",
                      "quantize.linear.mx,quantize.linear.float8", "--quantize.linear.float8.recipe-name",
                      "tensorwise", "--quantize.linear.float8.filter-fqns", "output"]


def test_a_micro_batch_that_breaks_the_global_batch_is_refused_in_one_line(monkeypatch, as_installed,
                                                                          uninstalled) -> None:
    as_installed((0, 3, 0))
    monkeypatch.setitem(own_flags.PROGRAMS, "torchtitan-0.3", _reading(micro=2, global_batch=16, dp=2))
    target, applied, _ = own_flags.install(DEBUG, {"micro_batch": "16"})
    assert target == DEBUG and applied.levers == []
    assert applied.notes == ["micro_batch: not applied (16 does not hold torchtitan-0.3's global batch of 16 over 2"
                             " data-parallel ranks (legal: 1, 2, 4, 8))"]


def test_settings_the_program_cannot_read_leave_it_as_it_is(monkeypatch, as_installed, uninstalled) -> None:
    def broken(_args: list[str]) -> own_flags.Settings:
        raise SystemExit(2)  # tyro's answer to an option it does not know

    as_installed((0, 3, 0))
    monkeypatch.setitem(own_flags.PROGRAMS, "torchtitan-0.3", dataclasses.replace(own_flags.TORCHTITAN, read=broken))
    target, applied, _ = own_flags.install(DEBUG, {"compile": "block"})
    assert target == DEBUG
    assert applied.notes == ["compile: not applied (torchtitan-0.3's settings could not be read (2))"]


def test_only_a_known_program_of_a_known_version_is_recognized_and_gets_a_torchrun_workers_variables(
        as_installed) -> None:
    as_installed((0, 3, 0))
    assert own_flags.profile_of(DEBUG) is own_flags.TORCHTITAN
    assert own_flags.profile_of(["/src/torchtitan/torchtitan/train.py", "--module", "llama3"]) is own_flags.TORCHTITAN
    assert own_flags.profile_of(["train.py"]) is None and own_flags.profile_of(["-m", "torchtitan.other"]) is None
    as_installed((0, 2, 2))
    assert own_flags.profile_of(DEBUG) is own_flags.TORCHTITAN_02
    for version in ((0, 1, 0), None):  # one the table has no entry for; none installed
        as_installed(version)
        assert own_flags.profile_of(DEBUG) is None
    as_installed((0, 3, 0))
    env = own_flags.launcher_env(DEBUG, {"PATH": "/bin"}, 29999)
    assert env == {"PATH": "/bin", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    under_torchrun = own_flags.launcher_env(DEBUG, {"RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "1"}, 29999)
    assert under_torchrun["RANK"] == "3" and under_torchrun["WORLD_SIZE"] == "4" and under_torchrun["MASTER_PORT"] == "29999"
    assert own_flags.launcher_env(["train.py"], {"PATH": "/bin"}, 29999) == {"PATH": "/bin"}


def test_the_search_takes_the_programs_values_and_legality_where_its_flags_apply() -> None:
    """What the first run found (torchtitan, compile off, selective recompute) gives the values:
    its table's, less its own now; fp8 by its flag needs the device's FP8 alone (no torchao
    conversion before FSDP2, no blocks found by a hook)."""
    found = {"program": "torchtitan-0.3", "fsdp2": True, "fsdp2_ranks": 1,
             "own": {"micro_batch": "2", "compile": "off", "recompute": "selective", "fp8": "off",
                     "optimizer": "fused", "fsdp_reshard": "default"}}
    own = own_flags.own_values(found)
    assert own == {"compile": ["block", "model"], "recompute": ["none", "full"], "fp8": ["tensorwise", "rowwise"],
                   "optimizer": ["foreach", "bf16"], "fsdp_reshard": ["true", "false"]}
    gpu = ScriptContext(found, {}, "cuda", fp8_formats=True, torchao=True, own=own)
    compile_, recompute, fp8 = (LEVERS[n].for_script() for n in ("compile", "recompute", "fp8"))
    assert compile_.values(gpu) == ["", "block", "model"] and recompute.values(gpu) == ["", "none", "full"]
    assert compile_.legal(gpu) is None and recompute.legal(gpu) is None and fp8.legal(gpu) is None
    assert fp8.legal(dataclasses.replace(gpu, fp8_formats=False)) == "this device has no FP8 GEMMs"
    assert LEVERS["fsdp_reshard"].for_script().legal(gpu) == "FSDP2 shards over one rank here"
    hooks_only = ScriptContext({"fsdp2": True}, {}, "cuda", fp8_formats=True, torchao=True)
    assert recompute.values(hooks_only) == ["", "full"] and fp8.legal(hooks_only) is not None


def test_a_programs_loss_method_is_kept_as_a_copy_of_each_part(tmp_path, monkeypatch) -> None:
    """torchtitan's step replays a CUDA graph whose loss tensor the next replay overwrites: each
    part its forward-backward returns is copied when returned; the parts sum to the step's loss."""
    (tmp_path / "loss_prog.py").write_text(
        "import torch\n\nclass Trainer:\n    def __init__(self):\n        self.out = torch.zeros(())\n\n"
        "    def step(self, value):\n        self.out.fill_(value)  # the same tensor every call\n"
        "        return self.out\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import loss_prog

    monkeypatch.setattr(loss_prog.Trainer, "step", loss_prog.Trainer.step)  # restored after the test
    losses = measured._Losses()
    losses.install("loss_prog:Trainer.step")
    trainer = loss_prog.Trainer()
    trainer.step(0.5)
    trainer.step(0.25)
    assert losses.take(None) == (0.75, 0.375)
    sys.modules.pop("loss_prog", None)


# ---- against the real torchtitan ------------------------------------------------------------------


def test_torchtitans_settings_are_read_by_its_own_parser(titan, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    debug = own_flags.read_torchtitan(DEBUG[2:])
    assert (debug.micro_batch, debug.global_batch, debug.dp) == (8, 8, 1)  # global -1: one micro-batch a step
    assert debug.micro_batches() == [1, 2, 4, 8]
    assert debug.current == {"micro_batch": "8", "compile": "off", "recompute": "selective", "fp8": "off",
                             "optimizer": "fused", "fsdp_reshard": "default"}
    monkeypatch.setenv("WORLD_SIZE", "2")
    two = own_flags.read_torchtitan([*DEBUG[2:], "--training.global-batch-size", "64", "--training.local_batch_size",
                                     "4", "--compile.enable", "--compile.components", "model", "activation-checkpoint:none"])
    assert (two.micro_batch, two.global_batch, two.dp) == (4, 64, 2)  # FSDP over the two ranks
    assert two.micro_batches() == [1, 2, 4, 8, 16, 32]
    assert two.current["compile"] == "block" and two.current["recompute"] == "none"


def test_the_rewritten_command_line_is_what_torchtitan_parses_and_its_float8_converts_the_blocks(
        titan, monkeypatch, uninstalled) -> None:
    """Every lever of its table, through its own parser; the fp8 flag through its own override
    mechanism and Float8LinearConverter: the blocks' linear layers, not the output head. (Its
    converter asks for an FP8 GPU: the config conversion is told it has one.)"""
    import torchtitan.components.quantization.float8 as float8
    from torchtitan.config.override import apply_overrides
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common.linear import Linear

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = {"micro_batch": "2", "compile": "model", "recompute": "full", "fp8": "tensorwise", "optimizer": "foreach"}
    target, applied, _ = own_flags.install([*DEBUG, "activation-checkpoint:selective"], plan)
    assert not applied.notes and sorted(applied.levers) == sorted(plan)
    config = titan().parse_args(own_flags.program_args(target))
    assert (config.training.local_batch_size, config.training.global_batch_size) == (2, 8)  # 4 steps of accumulation
    assert config.compile.enable and config.compile.components == ["model", "loss"]
    assert isinstance(config.activation_checkpoint, FullAC.Config) and config.optimizer.implementation == "foreach"
    monkeypatch.setattr(float8, "has_cuda_capability", lambda *_: True)
    assert len(apply_overrides(config.override, config)) == 6 * 5  # 6 blocks: qkv, wo, w1, w2, w3
    kinds = {fqn: cfg for fqn, cfg, _, _ in config.model_spec.model.traverse(Linear.Config)}
    assert type(kinds["lm_head"]) is Linear.Config
    wo = kinds["layers.0.attention.wo"]
    assert type(wo).__qualname__ == "Float8Linear.Config"
    assert wo._torchao_config.cast_config_weight.scaling_type.value == "dynamic"
    assert wo._torchao_config.cast_config_weight.scaling_granularity.value == "tensorwise"


def test_torchtitans_blocks_are_its_model_dict_and_the_cases_sliced_8b_builds(titan, tmp_path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.trainer.torchtitan_case import torchtitan_case

    target, env = torchtitan_case(tmp_path, flavor="8B", layers=4, seq=2048, global_batch=8)
    assert env["HF_DATASETS_OFFLINE"] == "1" and str(ROOT) in env["PYTHONPATH"].split(":")
    settings = own_flags.read_torchtitan(own_flags.program_args(target))
    assert (settings.micro_batch, settings.global_batch, settings.micro_batches()) == (1, 8, [1, 2, 4, 8])
    config = titan().parse_args(own_flags.program_args(target))
    with torch.device("meta"):
        model = config.model_spec.model.build()
    name, blocks = hooks.blocks_of(model)
    assert isinstance(model.layers, torch.nn.ModuleDict) and name == "layers" and len(blocks) == 4
    assert config.model_spec.model.dim == 4096 and 1.8e9 < sum(p.numel() for p in model.parameters()) < 2.0e9


# ---- torchtitan 0.2 ---------------------------------------------------------------------------------


def test_torchtitan_02s_settings_are_read_by_its_own_parser(titan02, monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    debug = own_flags.read_torchtitan_02([])  # its defaults: llama3 debugmodel
    assert (debug.micro_batch, debug.global_batch, debug.dp, debug.micro_batches()) == (8, 8, 1, [1, 2, 4, 8])
    assert debug.current == {"micro_batch": "8", "compile": "off", "recompute": "selective", "fp8": "off",
                             "optimizer": "fused", "fsdp_reshard": "default"}
    monkeypatch.setenv("WORLD_SIZE", "4")
    four = own_flags.read_torchtitan_02(["--training.global-batch-size", "64", "--parallelism.tensor-parallel-degree",
                                         "2", "--model.converters", "quantize.linear.float8"])
    assert (four.dp, four.micro_batches()) == (2, [1, 2, 4, 8, 16, 32])  # 4 ranks, 2 of them tensor-parallel
    assert four.current["fp8"] == "tensorwise"  # its converter's recipe by default


def test_torchtitan_02_parses_the_rewritten_command_line_as_its_own_and_converts_the_blocks(
        titan02, monkeypatch, uninstalled) -> None:
    """Its ConfigManager binds sys.argv[1:] as its default when imported (here, by the reader,
    before the program's arguments are set): the program's call with no arguments gets the
    rewritten ones. Its float8 converter takes the blocks' linear layers, not the output head."""
    import torchtitan.components.quantization.float8 as float8
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = {"micro_batch": "2", "compile": "block", "recompute": "full", "fp8": "rowwise", "fsdp_reshard": "false"}
    _target, applied, prog = own_flags.install(["-m", "torchtitan.train", "--training.global-batch-size", "16"], plan)
    assert prog is own_flags.TORCHTITAN_02 and not applied.notes and sorted(applied.levers) == sorted(plan)
    config = titan02().parse_args()
    assert (config.training.local_batch_size, config.training.global_batch_size) == (2, 16)
    assert config.compile.enable and config.compile.components == ["model"]
    assert config.activation_checkpoint.mode == "full" and config.parallelism.fsdp_reshard_after_forward == "never"
    assert config.model.converters == ["quantize.linear.float8"]
    assert config.quantize.linear.float8.filter_fqns == ["output"]
    monkeypatch.setattr(float8, "has_cuda_capability", lambda *_: True)
    spec = get_train_spec("llama3")
    args = spec.model_args["debugmodel"]
    args.update_from_config(config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    build_model_converters(config, dims).convert(model)
    assert type(model.output) is torch.nn.Linear and type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert model.layers["0"].attention.wq.config.cast_config_weight.scaling_granularity.name == "AXISWISE"  # rowwise
    assert hooks.blocks_of(model)[0] == "layers" and len(hooks.blocks_of(model)[1]) == 6


def test_torchtitan_02s_sliced_8b_is_a_flavor_the_case_registers(titan02, tmp_path, monkeypatch) -> None:
    import importlib

    sys.path.insert(0, str(ROOT))
    from benchmarks.trainer.torchtitan_case import FLAVORS, torchtitan_case

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    target, _env = torchtitan_case(tmp_path, flavor="8B", layers=4)
    config = titan02().parse_args(own_flags.program_args(target))
    assert config.model.flavor == "8B_4layers" and config.experimental.custom_import == FLAVORS
    importlib.import_module(config.experimental.custom_import)  # as its Trainer does
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec("llama3")
    args = spec.model_args["8B_4layers"]
    assert (args.n_layers, args.dim) == (4, 4096) and spec.model_args["8B"].n_layers == 32


# ---- either version ---------------------------------------------------------------------------------


@pytest.fixture
def any_titan():
    if own_flags.installed_version("torchtitan") is None:
        pytest.skip("torchtitan is not installed (pip install torchtitan)")


def test_the_cases_tokenizer_and_data_are_what_torchtitan_reads(any_titan, tmp_path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.trainer.torchtitan_case import WORDS, write_assets
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    assets = write_assets(tmp_path / "assets", docs=200)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(assets))
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.get_vocab_size()) == (0, 1, WORDS + 3)
    inputs, labels = next(iter(HuggingFaceTextDataset("c4_test", str(assets / "data"), tokenizer, seq_len=2048)))
    assert inputs["input"].shape == labels.shape == (2048,)
    assert int(inputs["input"].max()) < tokenizer.get_vocab_size() <= 2048  # the debug model's vocabulary
    assert int(labels.max()) < tokenizer.get_vocab_size() and (inputs["input"] == 0).any()  # documents begin


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's path: torchtitan stops where it needs a GPU")
def test_a_measured_run_of_torchtitan_rewrites_its_command_line_and_reports_its_micro_batches(
        any_titan, tmp_path, monkeypatch) -> None:
    """The child reads torchtitan's settings, appends the plan's flags, and torchtitan's own
    parser takes them (it goes on to build its trainer, where it needs CUDA); the result says
    what the search needs: the program, its levers now, the micro-batches that hold its global
    batch."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.trainer.torchtitan_case import torchtitan_case

    target, env = torchtitan_case(tmp_path, flavor="debugmodel", layers=None, seq=256, local_batch=2,
                                  global_batch=16)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    prog = own_flags.profile_of(target)
    res = measured.run_script(target, {"micro_batch": "8", "recompute": "full"}, warmup=1, steps=1,
                              log_file=tmp_path / "run.log")
    assert res.status == measured.CANNOT_RUN and "exited with" not in res.reason, res.reason
    assert "setDevice" in res.reason or "CUDA" in res.reason or "cuda" in res.reason, res.reason
    found = res.applied["found"]
    assert found["program"] == prog.name and found["own"]["recompute"] == "selective"
    assert found["flags"] == ["--training.local-batch-size", "8", "--training.global-batch-size", "16",
                              *prog.flags["recompute"]["full"]]
    assert res.applied["knobs"]["micro_batch"] == {"default": 2, "choices": [1, 2, 4, 8, 16], "via": prog.name}
    assert sorted(res.applied["levers"]) == ["micro_batch", "recompute"]
