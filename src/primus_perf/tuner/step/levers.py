"""The step's levers: each a registered dimension of the search, with the values it takes, its
legality rule and its memory rule.

A lever names one config key the trainer switches in place (``trainer/knobs.py``; its values
typed as the config's schema has them), the values to try in primus-train (decided on a
:class:`TrainerContext`: the config and the machine), a legality rule (a reason it cannot apply
here, or None) and ``companions``: settings to add when a value alone does not fit the memory
estimate (a larger micro-batch with recompute). Its ``script`` part (:class:`InScript`) is how
it applies to a user's script, from outside (``hooks``: the plan's value under the lever's
name), with its values and legality there (decided on a :class:`ScriptContext`: what the
script's first run found), or through the program's own flags where a known program has one for it
(``own_flags``: torchtitan's local batch, compile, float8, activation checkpointing, optimizer);
a lever may be a script's alone (no config key: the SDPA backend, the allocator, DDP's
options). Whether a candidate fits is the
trainer's memory estimate (``trainer.resources.check_fits``); whether it can run at all is the
trainer's own check when it switches (a grouped backend this GPU lacks, FP8 on a GPU without
it): one line each, recorded, and the search goes on.

``changes_numerics``: a lever whose values are not the same training (FP8, bf16 optimizer
moments); the loss guard drops those first. Adding a lever is one :func:`register` call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from primus_perf.base.errors import UserError


@dataclass(frozen=True)
class TrainerContext:
    """Where a lever applies in primus-train: the config the search starts from and the machine."""

    cfg: Any  # trainer.config.TrainerConfig
    device_type: str  # "cuda" or "cpu"
    dp: int  # data-parallel ranks
    dp_shard: int  # FSDP2's shard size
    moe: bool
    cache: str | None = None  # a kernel cache to try (--cache)
    fp8_formats: bool = False  # the device has FP8 GEMMs


@dataclass(frozen=True)
class ScriptContext:
    """Where a lever applies in a user's script: what its first measured run found
    (``hooks.Applied``: the model, its blocks, the optimizer, FSDP2 or DDP, an HF Trainer, the
    knobs it asked for) and the machine."""

    found: dict[str, Any]
    knobs: dict[str, dict[str, Any]]
    device_type: str  # "cuda" or "cpu"
    cache: str | None = None  # a kernel cache to try (--cache)
    fp8_formats: bool = False  # the device has FP8 GEMMs
    torchao: bool = False  # torchao is importable (FP8 from outside)
    own: dict[str, list[str]] = field(default_factory=dict)  # lever -> the values the program's own flags set


@dataclass(frozen=True)
class InScript:
    """How a lever applies to a user's script: through ``hooks`` (the plan's value under the
    lever's name), its values and legality there, and ``from_trainer``: the analyzer's advice,
    written as the trainer's value, as this lever's (None: no such value here). Where the
    program's own flags set it (``own_flags``: ``ScriptContext.own``), its values are those
    flags' and ``by_flag`` its legality (what holds whoever applies it: the device)."""

    values: Callable[[ScriptContext], list[str]]
    legal: Callable[[ScriptContext], str | None] = lambda _w: None
    from_trainer: Callable[[str], str | None] = lambda v: v
    by_flag: Callable[[ScriptContext], str | None] = lambda _w: None
    scale: Callable[[ScriptContext, str], float] | None = None  # as Lever.scale ("": the knob's default)


@dataclass(frozen=True)
class Lever:
    """One lever: ``key`` the trainer's config key (empty: no primus-train lever), its values
    and legality there, ``companions`` (settings added where a value alone does not fit the
    memory estimate), ``changes_numerics``, and ``script``: how it applies to a user's script."""

    name: str
    key: str  # the config key it sets (trainer.config.SCHEMA's)
    values: Callable[[TrainerContext], list[Any]]  # every value it can take here (the current one included), typed
    legal: Callable[[TrainerContext], str | None] = lambda _w: None  # why it cannot apply here
    companions: tuple[dict[str, Any], ...] = ()  # added, in turn, to a value that does not fit alone
    changes_numerics: Callable[[Any], bool] = lambda _v: False
    about: str = ""
    script: InScript | None = None
    # where a value lies on an ordered lever's scale (None: unordered). The step is taken to be
    # unimodal along it: once a value wins against another, that other and those beyond it are left out
    scale: Callable[[Any, Any], float] | None = None

    def for_script(self) -> Lever:
        """This lever as the script search takes it: the plan's key is the lever's name."""
        if self.script is None:
            raise ValueError(f"lever {self.name!r} does not apply to a script")
        name, part = self.name, self.script

        def values(w: ScriptContext) -> list[str]:
            return ["", *w.own[name]] if name in w.own else part.values(w)

        def legal(w: ScriptContext) -> str | None:
            return part.by_flag(w) if name in w.own else part.legal(w)

        return dataclasses.replace(self, key=name, values=values, legal=legal, companions=(), scale=part.scale)


LEVERS: dict[str, Lever] = {}


def register(lever: Lever) -> Lever:
    if lever.name in LEVERS:
        raise ValueError(f"lever {lever.name!r} is registered already")
    LEVERS[lever.name] = lever
    return lever


def unregister(name: str) -> None:
    LEVERS.pop(name, None)


def lever_of(key: str) -> Lever | None:
    return next((lv for lv in LEVERS.values() if lv.key == key), None) if key else None


def trainer_levers() -> list[Lever]:
    """The levers of primus-train (those with a config key)."""
    return [lv for lv in LEVERS.values() if lv.key]


def script_levers() -> list[Lever]:
    """The levers of a user's script, as the script search takes them (:meth:`Lever.for_script`)."""
    return [lv.for_script() for lv in LEVERS.values() if lv.script is not None]


def pick(names: str | None, among: list[Lever] | None = None) -> list[Lever]:
    """The levers named (comma-separated; None: every one of ``among``, default the trainer's),
    in registry order."""
    among = trainer_levers() if among is None else among
    if names is None:
        return list(among)
    by_name = {lv.name: lv for lv in among}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        raise UserError(f"--levers {names!r}: unknown lever {', '.join(unknown) or '(none)'}"
                        f" (one of {', '.join(by_name)})")
    return [lv for lv in among if lv.name in wanted]


# ---- the registered levers -------------------------------------------------------------------


def _micro_batches(w: TrainerContext) -> list[int]:
    """The powers of two that divide the sequences a rank takes a step, and that number."""
    per_rank = w.cfg.train.global_batch // w.dp
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0 and (m & (m - 1) == 0 or m == per_rank)]


def _fixed_global_batch(w: TrainerContext) -> str | None:
    if w.cfg.train.global_batch <= 0:
        return ("train.global_batch is 0 (one micro-batch a step): the micro-batch is the recipe here;"
                " set train.global_batch to move it")
    return None


def _fsdp(w: TrainerContext) -> str | None:
    return None if w.dp_shard > 1 else "FSDP2 is off (parallel.dp_shard=1)"


def _fp8(w: TrainerContext | ScriptContext) -> str | None:
    return None if w.fp8_formats else "this device has no FP8 GEMMs"


def _moe(w: TrainerContext) -> str | None:
    return None if w.moe else "the model has no MoE layers"


def _cache(w: TrainerContext | ScriptContext) -> str | None:
    return None if w.cache else "no kernel cache given (--cache)"


def _choices(key: str) -> Callable[[TrainerContext], list[str]]:
    """Every value the config's schema gives a string key."""
    def values(w: TrainerContext) -> list[str]:
        from primus_perf.trainer.config import SCHEMA  # here, where a lever runs (it imports torch)

        return list(SCHEMA[key].choices)
    return values


# ---- their script parts -----------------------------------------------------------------------
# "" is the program's own choice (what it does without a plan); a script's micro-batch is its
# consent: primus_perf.knob("micro_batch", ...) or an HF Trainer's batch size


def _script_micro_batches(w: ScriptContext) -> list[str]:
    """Larger micro-batches first (the usual winner), at most three, from the knob's choices
    (by default powers of two up to 8 x the script's)."""
    asked = w.knobs.get("micro_batch", {})
    default = int(asked.get("default") or 1)
    choices = asked.get("choices") or [default * 2 ** i for i in range(-3, 4) if default * 2 ** i >= 1]
    larger = sorted((int(c) for c in choices if int(c) > default), reverse=True)[:2]
    smaller = sorted((int(c) for c in choices if int(c) < default), reverse=True)[:1]
    return ["", *(str(c) for c in larger + smaller)]


def _script_micro_batch_scale(w: ScriptContext, v: str) -> float:
    return float(v or w.knobs["micro_batch"].get("default") or 1)


def _asked_micro_batch(w: ScriptContext) -> str | None:
    if "micro_batch" in w.knobs:
        return None
    return ("the script does not ask for it: mb = primus_perf.knob(\"micro_batch\", 2) and the accumulation"
            " derived from it (an HF Trainer script's batch size is found by itself)")


def _model_found(w: ScriptContext) -> str | None:
    return None if w.found.get("model") else "no model found (the first optimizer's parameters lead to it)"


def _compile_left(w: ScriptContext) -> str | None:
    own = w.found.get("compiled")
    return _model_found(w) or (f"the program compiles its {'model' if own == 'model' else 'blocks'} itself"
                               " (torch.compile): left as it is" if own else None)


def _recompute_left(w: ScriptContext) -> str | None:
    own = w.found.get("recompute")
    return (None if own == "transformers" else _blocks_found(w) or
            ("the program checkpoints every block itself (checkpoint_wrapper): left as it is" if own else None))


def _blocks_found(w: ScriptContext) -> str | None:
    from primus_perf.tuner.step.hooks import NO_BLOCKS

    return _model_found(w) or (None if w.found.get("blocks") else NO_BLOCKS)


def _fp8_device(w: ScriptContext) -> str | None:
    return "FP8 needs torchao (pip install torchao)" if not w.torchao else _fp8(w)


def _script_fp8(w: ScriptContext) -> str | None:
    sharded = ("FSDP2 shards the model before the plan could convert it (torchao float8 converts before"
               " fully_shard)") if w.found.get("fsdp2") else None
    return _fp8_device(w) or sharded or _blocks_found(w)


def _script_fsdp(w: ScriptContext) -> str | None:
    if not w.found.get("fsdp2"):
        return "the script does not use FSDP2 (fully_shard)"
    return "FSDP2 shards over one rank here" if w.found.get("fsdp2_ranks") == 1 else None


def _script_ddp(w: ScriptContext) -> str | None:
    return None if w.found.get("ddp") else "the script does not use DistributedDataParallel"


def _on_gpu(w: ScriptContext) -> str | None:
    return None if w.device_type == "cuda" else "needs a GPU"


def _script_optimizer(w: ScriptContext) -> str | None:
    return _on_gpu(w) or (None if w.found.get("optimizer") else "the script built no optimizer that steps")


def _compile_scope(v: str) -> str | None:
    return {"off": "", "pointwise": "block", "block": "block", "true": "block"}.get(v)


register(Lever("micro_batch", "train.micro_batch", _micro_batches, _fixed_global_batch,
               companions=({"train.recompute": "selective"}, {"train.recompute": "full"}),
               about="sequences per forward/backward at the fixed global batch", scale=lambda _w, v: float(v),
               script=InScript(_script_micro_batches, _asked_micro_batch, scale=_script_micro_batch_scale)))
register(Lever("compile", "train.compile", _choices("train.compile"),
               about="torch.compile: nothing, the pointwise ops, or whole blocks with their GEMMs",
               script=InScript(lambda w: ["", "block", "model"], _compile_left, _compile_scope)))
register(Lever("recompute", "train.recompute", _choices("train.recompute"),
               about="activations recomputed in backward",
               script=InScript(lambda w: ["", "off" if w.found.get("recompute") == "transformers" else "full"], _recompute_left,
                               lambda v: {"full": "full", "none": "off"}.get(v))))
register(Lever("fp8", "train.fp8", lambda w: ["off", "tensorwise", "rowwise"], _fp8,
               changes_numerics=lambda v: v not in ("off", ""), about="the blocks' linear layers in FP8 (torchao)",
               script=InScript(lambda w: ["", "tensorwise", "rowwise"], _script_fp8,
                               lambda v: v if v in ("tensorwise", "rowwise") else None, _fp8_device)))
register(Lever("optimizer", "train.optimizer",
               lambda w: ["fused", "foreach", "bf16"] if w.device_type == "cuda" else ["auto", "foreach", "bf16"],
               changes_numerics=lambda v: v == "bf16", about="AdamW's implementation; bf16 keeps its moments in bf16",
               script=InScript(lambda w: ["", "fused", "foreach"], _script_optimizer,
                               lambda v: v if v in ("fused", "foreach") else None, _on_gpu)))
register(Lever("grouped_backend", "model.moe.grouped_gemm_backend", _choices("model.moe.grouped_gemm_backend"), _moe,
               about="the MoE experts' grouped GEMM"))
register(Lever("fsdp_reshard", "parallel.fsdp_reshard_after_forward", lambda w: [True, False], _fsdp,
               about="FSDP2 frees the gathered blocks after forward (true) or keeps them for backward",
               script=InScript(lambda w: ["", "false", "true"], _script_fsdp, by_flag=_script_fsdp)))
register(Lever("fsdp_prefetch", "parallel.fsdp_prefetch", lambda w: [0, 1, 2], _fsdp,
               about="blocks FSDP2 all-gathers ahead",
               script=InScript(lambda w: ["", "1", "2"], lambda w: _script_fsdp(w) or _blocks_found(w))))
register(Lever("kernel_cache", "tuning.cache", lambda w: [None, w.cache], _cache,
               about="the tuned kernels of a cache (primus-tune gemm/loop), confirmed in the step",
               script=InScript(lambda w: ["", w.cache or ""], _cache, lambda v: None)))
register(Lever("sdpa", "", lambda w: [], about="the one SDPA backend torch may pick (math stays its fallback)",
               script=InScript(lambda w: ["", "cudnn", "flash", "efficient"], _on_gpu, lambda v: None)))
register(Lever("allocator", "", lambda w: [], about="the CUDA caching allocator's expandable segments",
               script=InScript(lambda w: ["", "expandable"], _on_gpu, lambda v: None)))
register(Lever("ddp_bucket_mb", "", lambda w: [], about="DDP's gradient bucket size (MB; torch's default 25)",
               script=InScript(lambda w: ["", "100", "10"], _script_ddp, lambda v: None)))
register(Lever("ddp_bucket_view", "", lambda w: [], about="DDP's gradients as views of its buckets (no copy)",
               script=InScript(lambda w: ["", "true"], _script_ddp, lambda v: None)))
register(Lever("ddp_static_graph", "", lambda w: [], about="DDP's static graph (the same parameters used every step)",
               script=InScript(lambda w: ["", "true"], _script_ddp, lambda v: None)))


def text(value: Any) -> str:
    """A value as a label shows it (``true``, ``4``, ``block``; None: empty)."""
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def shown(value: Any) -> str:
    """A value as a line of the search shows it: :func:`text`, its empty value (a script's own
    setting, or the config's) as ``(as written)``."""
    return text(value) or "(as written)"


@dataclass
class Setting:
    """Keys and values over the base (what a candidate or the plan is): config keys, typed
    (``trainer.config.with_settings`` applies them), or a script's lever names, the hooks' text."""

    values: dict[str, Any] = field(default_factory=dict)

    def with_(self, changes: dict[str, Any]) -> Setting:
        return Setting({**self.values, **changes})

    def label(self, base: dict[str, Any] | None = None) -> str:
        """``train.micro_batch=4 train.compile=block``: the keys that differ from ``base``."""
        base = base or {}
        diff = [f"{k}={shown(v)}" for k, v in self.values.items() if k not in base or base[k] != v]
        return " ".join(diff) or "the default"
