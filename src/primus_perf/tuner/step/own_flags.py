"""A lever applied through the program's own flags: a training program the step tuner knows
(torchtitan 0.2 and 0.3) takes the plan's levers as its own command-line options, appended to
its target, instead of hooks on the objects it builds.

A program's profile (:class:`ProgramProfile`, one entry of :data:`PROGRAMS`) says how to know
the program from its target (``-m torchtitan.train``, the version installed), how to read its
settings with its own parser (:class:`Settings`: the sequences a data-parallel rank takes a
forward and backward, the global batch, the data-parallel ranks, each lever's value now), how
its command line takes an option (``merge``: its grammar), and its table: per lever, per value,
the argv fragment that sets it (``"*"``: any value, the micro-batch's, ``{value}`` and
``{global_batch}`` filled in, so that the global batch holds while the micro-batch moves).
Another framework (Megatron-LM's ``pretrain_gpt.py``, Lightning), or another version of one,
is one more entry: its recognition, its reader, its grammar, its table.

:func:`install` is what a run of a plan does first (``python -m primus_perf.launch --plan``,
each measured run): the levers the program's table has become its flags, the rest go to
``hooks``; a lever set by the program's flag is never applied again by a hook (where the
program builds what a hook also sets, compile and float8, the flag wins). What was read is
reported with what the run found (``found["program"]``, ``found["own"]``: each lever's value
now; the micro-batch as the knob ``micro_batch`` with its legal values: the powers of two that
divide the sequences a data-parallel rank takes a step), so the search knows the values.
Importing this module imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from primus_perf.base import environment

if TYPE_CHECKING:
    from primus_perf.tuner.step.hooks import Applied

ANY = "*"  # a table's entry for any value of its lever ({value} filled in)


@dataclass(frozen=True)
class Settings:
    """What a program's own configuration says, read by its own parser."""

    micro_batch: int  # sequences a data-parallel rank takes a forward and backward
    global_batch: int  # sequences an optimizer step takes, every rank and accumulation step together
    dp: int  # data-parallel ranks
    multiple_of: int = 1  # a micro-batch must be a multiple of it (pipeline microbatches)
    current: dict[str, str] = field(default_factory=dict)  # each lever's value now, in its table's words

    def micro_batches(self) -> list[int]:
        """The micro-batches that hold the global batch: the powers of two that divide the
        sequences a rank takes a step (and that number), multiples of ``multiple_of``."""
        from primus_perf.tuner.step.hooks import divisors

        return [m for m in divisors(self.global_batch // self.dp) if m % self.multiple_of == 0]


@dataclass(frozen=True)
class ProgramProfile:
    """A training program whose own flags take levers (module docstring)."""

    name: str
    modules: tuple[str, ...]  # ``-m MODULE`` targets that are this program
    scripts: tuple[str, ...]  # script paths ending so (``torchtitan/train.py``)
    flags: Mapping[str, Mapping[str, tuple[str, ...]]]  # lever -> value (or ANY) -> argv fragment
    read: Callable[[list[str]], Settings]  # its settings from its arguments, by its own parser
    merge: Callable[[list[str], Sequence[str]], list[str]]  # a fragment into its arguments
    dist: str = ""  # its installed distribution, whose version picks the entry (flags move between versions)
    versions: tuple[tuple[int, ...], tuple[int, ...]] = ((), (999,))  # [from, to)
    loss: str = ""  # "module:Class.method" returning a part of the step's loss (the parts sum to it)
    launcher: bool = False  # a torchrun worker: it reads RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    argv_default: str = ""  # "module:Class.method" whose first default is sys.argv[1:] as it was at import

    def values(self, lever: str, current: Mapping[str, str]) -> list[str]:
        """The values its table sets for ``lever``, less the program's own now."""
        return [v for v in self.flags.get(lever, {}) if v != ANY and v != current.get(lever)]

    def fragment(self, lever: str, value: str, settings: Settings) -> tuple[str, ...] | None:
        table = self.flags.get(lever, {})
        frag = table.get(value) or table.get(ANY)
        if frag is None:
            return None
        return tuple(t.format(value=value, global_batch=settings.global_batch) for t in frag)


def program_args(target: Sequence[str]) -> list[str]:
    """The program's own arguments (its ``sys.argv[1:]``)."""
    return list(target[2:] if target and target[0] == "-m" else target[1:])


def installed_version(dist: str) -> tuple[int, ...] | None:
    """The installed version of distribution ``dist`` (its leading numbers), None where none is."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version(dist)
    except PackageNotFoundError:
        return None
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def profile_of(target: Sequence[str]) -> ProgramProfile | None:
    """The profile of the program ``target`` runs (``script.py args`` or ``-m module args``), of
    the version installed."""
    if not target:
        return None
    for prog in PROGRAMS.values():
        if target[0] == "-m":
            named = len(target) > 1 and target[1] in prog.modules
        else:
            named = any(PurePath(target[0]).as_posix().endswith(s) for s in prog.scripts)
        if not named:
            continue
        have = installed_version(prog.dist) if prog.dist else ()
        if have is not None and prog.versions[0] <= have < prog.versions[1]:
            return prog
    return None


# ---- a run of a plan --------------------------------------------------------------------------


def install(target: Sequence[str], plan: Mapping[str, str]) -> tuple[list[str], Applied, ProgramProfile | None]:
    """Apply ``plan`` to the program ``target`` runs (module docstring): the target with the
    program's flags appended, ``hooks.Applied`` (the hooks installed for the levers left), the
    program's profile (None: no known program, every lever through hooks)."""
    from primus_perf.tuner.step import hooks

    prog = profile_of(target)
    if prog is None:
        return list(target), hooks.install(plan), None
    mine = {k: str(v) for k, v in plan.items() if k in prog.flags and str(v) != ""}
    applied = hooks.install({k: v for k, v in plan.items() if k not in mine})  # first: before CUDA starts
    head, args = list(target[:len(target) - len(program_args(target))]), program_args(target)
    applied.found["program"] = prog.name
    try:
        settings = prog.read(args)
    except (Exception, SystemExit) as exc:  # its parser's own error: the program says it again when it runs
        from primus_perf.base.errors import one_line

        why = f"{prog.name}'s settings could not be read ({one_line(exc) if isinstance(exc, Exception) else exc})"
        for lever in mine:
            applied.note(lever, why)
        _rebind_argv(prog.argv_default, args)
        return list(target), applied, prog
    applied.found["own"] = dict(settings.current)
    applied.knobs[hooks.MICRO_BATCH] = {"default": settings.micro_batch, "choices": settings.micro_batches(),
                                        "via": prog.name}
    appended: list[str] = []
    for lever, value in mine.items():
        if lever == hooks.MICRO_BATCH and value not in map(str, settings.micro_batches()):
            applied.note(lever, f"{value} does not hold {prog.name}'s global batch of {settings.global_batch}"
                                f" over {settings.dp} data-parallel ranks (legal: "
                                f"{', '.join(map(str, settings.micro_batches()))})")
            continue
        frag = prog.fragment(lever, value, settings)
        if frag is None:
            applied.note(lever, f"{prog.name} has no flag for {value!r} (one of "
                                f"{', '.join(prog.values(lever, {}))})")
            continue
        args = prog.merge(args, frag)
        appended += frag
        applied.levers.append(lever)
    applied.found["flags"] = appended
    _rebind_argv(prog.argv_default, args)
    return head + args, applied, prog


def _rebind_argv(where: str, args: list[str]) -> None:
    """A function that took ``sys.argv[1:]`` as its default when its module was imported (by the
    reader, before the program's arguments were set) takes the program's ``args`` instead."""
    import sys

    module, _, attr = where.partition(":")
    if not where or module not in sys.modules:
        return
    owner_name, name = attr.rsplit(".", 1)
    fn = getattr(getattr(sys.modules[module], owner_name), name)
    fn.__defaults__ = (list(args), *(fn.__defaults__ or ())[1:])


def launcher_env(target: Sequence[str], env: Mapping[str, str], port: int) -> dict[str, str]:
    """``env`` for a run of ``target``: a program that runs as a torchrun worker (its profile's
    ``launcher``) gets one rank's variables where none are set, and its process group a port of
    its own (``port``) with a store of its own (two runs, or lanes, never meet on one)."""
    out = dict(env)
    prog = profile_of(target)
    if prog is None or not prog.launcher:
        return out
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        out.setdefault(key, value)
    out["MASTER_PORT"] = str(port)
    out["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    return out


# ---- command-line grammars --------------------------------------------------------------------


def _option_name(token: str) -> str:
    return token.split("=", 1)[0].replace("_", "-")


def tyro_merge(args: list[str], fragment: Sequence[str], *, lists: Mapping[str, str] | None = None) -> list[str]:
    """``fragment`` into a tyro command line (torchtitan's): an option (``--a.b value``) goes
    before the subcommand, where the program's last one wins (``lists``: list options, whose
    values join the program's own, each option's values as separate words, " ", or one word
    joined by ","); a subcommand (``group:choice``) takes the place of the program's choice of
    that group and of that choice's options."""
    lists = lists or {}
    args = list(args)
    i = 0
    while i < len(fragment):
        token = fragment[i]
        if _is_subcommand(token):
            group = token.split(":", 1)[0] + ":"
            at = next((k for k, a in enumerate(args) if _is_subcommand(a) and a.startswith(group)), None)
            if at is None:
                args.append(token)
            else:  # its options end where the next subcommand starts
                end = next((k for k in range(at + 1, len(args)) if _is_subcommand(args[k])), len(args))
                args = [*args[:at], token, *args[end:]]
            i += 1
            continue
        end = i + 1
        while end < len(fragment) and not fragment[end].startswith("-") and not _is_subcommand(fragment[end]):
            end += 1
        name, values = _option_name(token), list(fragment[i + 1:end])
        if name in lists:
            sep = lists[name]
            joined = [v for word in _last_values(args, name) + values for v in (word.split(sep) if sep.strip() else [word])]
            values = list(dict.fromkeys(v for v in joined if v))
            values = [sep.join(values)] if sep.strip() else values
            args = _without_option(args, name)
        cut = next((k for k, a in enumerate(args) if _is_subcommand(a)), len(args))
        args = [*args[:cut], token.split("=", 1)[0], *values, *args[cut:]]
        i = end
    return args


def _is_subcommand(token: str) -> bool:
    """A tyro subcommand's choice: ``group:choice``."""
    return re.fullmatch(r"[A-Za-z0-9_-]+:[A-Za-z0-9_-]+", token) is not None


def _option_spans(args: list[str], name: str) -> list[tuple[int, int]]:
    """Where option ``name`` stands in ``args``: (start, end) of it and its values."""
    spans = []
    for k, a in enumerate(args):
        if a.startswith("--") and _option_name(a) == name:
            end = k + 1
            if "=" not in a:
                while end < len(args) and not args[end].startswith("-") and not _is_subcommand(args[end]):
                    end += 1
            spans.append((k, end))
    return spans


def _last_values(args: list[str], name: str) -> list[str]:
    spans = _option_spans(args, name)
    if not spans:
        return []
    start, end = spans[-1]
    return [args[start].split("=", 1)[1]] if "=" in args[start] else args[start + 1:end]


def _without_option(args: list[str], name: str) -> list[str]:
    drop = {k for start, end in _option_spans(args, name) for k in range(start, end)}
    return [a for k, a in enumerate(args) if k not in drop]


# ---- torchtitan ---------------------------------------------------------------------------------
# 0.3 reads a config function of a registry (--module llama3 --config llama3_debugmodel), its
# model converters are no options (float8 through its override mechanism, torchtitan_fp8.py) and
# activation checkpointing is a subcommand; 0.2 (torch 2.11's: 0.3 imports names torch 2.11
# lacks) reads options alone (--model.flavor debugmodel), with converters and a checkpointing mode


def _titan_settings(config: Any, dims: Any, recompute: str, fp8: str, optimizer: str) -> Settings:
    """What both versions' configs say alike: the batch over the data-parallel ranks (their
    own ParallelDims), compile, the optimizer, FSDP2's reshard."""
    training, compile_, parallelism = config.training, config.compile, config.parallelism
    dp = dims.dp_replicate * dims.dp_shard
    micro = int(training.local_batch_size)
    global_batch = int(training.global_batch_size) if training.global_batch_size > 0 else micro * dp
    components = set(compile_.components)
    compile_now = ("off" if not compile_.enable else "block" if components == {"model"}
                   else "model" if components == {"model", "loss"} else ",".join(sorted(components)))
    reshard = {"always": "true", "never": "false"}.get(parallelism.fsdp_reshard_after_forward, "default")
    current = {"micro_batch": str(micro), "compile": compile_now, "recompute": recompute, "fp8": fp8,
               "optimizer": optimizer, "fsdp_reshard": reshard}
    pp_micro = parallelism.pipeline_parallel_microbatch_size if dims.pp > 1 else 1
    return Settings(micro, global_batch, dp, pp_micro, current)


def read_torchtitan(args: list[str]) -> Settings:
    """torchtitan 0.3's settings, parsed by its own ``ConfigManager``."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.linear import Linear

    config = ConfigManager().parse_args(list(args))
    ac = config.activation_checkpoint
    recompute = "none" if ac is None else {"SelectiveAC": "selective", "FullAC": "full"}.get(
        type(ac).__qualname__.split(".")[0], type(ac).__qualname__)
    converted = {type(cfg).__qualname__.split(".")[0] for _, cfg, _, _ in config.model_spec.model.traverse(Linear.Config)
                 if type(cfg) is not Linear.Config}  # Float8Linear, MXFP8Linear, ...
    optimizer = {"fused_opt_states_bf16": "bf16"}.get(config.optimizer.implementation,
                                                      config.optimizer.implementation)
    return _titan_settings(config, ParallelDims.from_config(config.parallelism, environment.get("WORLD_SIZE")), recompute,
                           ",".join(sorted(converted)) or "off", optimizer)


def read_torchtitan_02(args: list[str]) -> Settings:
    """torchtitan 0.2's settings, parsed by its own ``ConfigManager``."""
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    config = ConfigManager().parse_args(list(args))
    p = config.parallelism
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree,
                        world_size=environment.get("WORLD_SIZE"))
    converters = config.model.converters
    fp8 = ((config.quantize.linear.float8.recipe_name or "tensorwise") if "quantize.linear.float8" in converters
           else ",".join(converters) or "off")
    return _titan_settings(config, dims, config.activation_checkpoint.mode, fp8, config.optimizer.implementation)


TORCHTITAN_FP8 = "primus_perf.tuner.step.torchtitan_fp8.float8_linears"  # its @override (torchtitan_fp8.py)
_TITAN = {  # the flags both versions share
    "micro_batch": {ANY: ("--training.local-batch-size", "{value}", "--training.global-batch-size",
                          "{global_batch}")},
    # its "model" component compiles each block (TransformerBlock); "loss" its loss
    "compile": {"off": ("--compile.no-enable",),
                "block": ("--compile.enable", "--compile.components", "model"),
                "model": ("--compile.enable", "--compile.components", "model,loss")},
    "optimizer": {"fused": ("--optimizer.implementation", "fused"),
                  "foreach": ("--optimizer.implementation", "foreach")},
    "fsdp_reshard": {"true": ("--parallelism.fsdp-reshard-after-forward", "always"),
                     "false": ("--parallelism.fsdp-reshard-after-forward", "never")},
}


def _fp8_override(recipe: str) -> tuple[str, ...]:
    return ("--override.imports", f'{TORCHTITAN_FP8}={{{{"recipe": "{recipe}"}}}}')  # {{ }}: format()'s braces


def _fp8_converter(recipe: str) -> tuple[str, ...]:
    """0.2's float8 converter, the output head left out (as torchtitan's own float8 recipes do)."""
    return ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe-name", recipe,
            "--quantize.linear.float8.filter-fqns", "output")


TORCHTITAN = ProgramProfile(
    name="torchtitan-0.3", modules=("torchtitan.train",), scripts=("torchtitan/train.py",),
    flags={**_TITAN,
           "recompute": {"none": ("activation-checkpoint:none",), "selective": ("activation-checkpoint:selective",),
                         "full": ("activation-checkpoint:full",)},
           # its Float8Linear through its own converter on the blocks' linear layers (torchtitan_fp8.py)
           "fp8": {"tensorwise": _fp8_override("tensorwise"), "rowwise": _fp8_override("rowwise")},
           "optimizer": {**_TITAN["optimizer"], "bf16": ("--optimizer.implementation", "fused_opt_states_bf16")}},
    read=read_torchtitan,
    merge=lambda args, frag: tyro_merge(args, frag, lists={"--override.imports": " "}),
    dist="torchtitan", versions=((0, 3), (999,)),
    # local loss sum / the step's tokens, per micro-batch (its CUDA graph replays the backward)
    loss="torchtitan.trainer:Trainer.forward_backward_step",
    launcher=True,
)
TORCHTITAN_02 = ProgramProfile(
    name="torchtitan-0.2", modules=("torchtitan.train",), scripts=("torchtitan/train.py",),
    flags={**_TITAN,
           "recompute": {m: ("--activation-checkpoint.mode", m) for m in ("none", "selective", "full")},
           "fp8": {"tensorwise": _fp8_converter("tensorwise"), "rowwise": _fp8_converter("rowwise")}},
    read=read_torchtitan_02,
    merge=lambda args, frag: tyro_merge(args, frag, lists={"--model.converters": ",",
                                                           "--quantize.linear.float8.filter-fqns": ","}),
    dist="torchtitan", versions=((0, 2), (0, 3)),
    launcher=True,  # its loss: the scalar each micro-batch calls backward on (its Trainer runs as __main__)
    argv_default="torchtitan.config.manager:ConfigManager.parse_args",  # parse_args(self, args=sys.argv[1:])
)

PROGRAMS: dict[str, ProgramProfile] = {p.name: p for p in (TORCHTITAN, TORCHTITAN_02)}

def own_values(found: Mapping[str, Any]) -> dict[str, list[str]]:
    """Per lever, the values the program's own flags set, from what its first run found (its
    program and each lever's value now): the search's values for those levers. The
    micro-batch is not among them: its legal values are its knob's."""
    prog = PROGRAMS.get(str(found.get("program", "")))
    if prog is None or "own" not in found:
        return {}
    values = {lever: prog.values(lever, found["own"]) for lever in prog.flags}
    return {lever: v for lever, v in values.items() if v}
