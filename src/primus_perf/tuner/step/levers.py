"""The step's levers: each a registered dimension of the search, with the values it takes, its
legality rule and its memory rule.

A lever names one config key the trainer switches in place (``trainer/knobs.py``), the values
to try from a setting (:class:`Where`: what the run is), a legality rule (a reason it cannot
apply here, or None) and ``companions``: settings to add when a value alone does not fit the
memory estimate (a larger micro-batch with recompute). Whether a candidate fits is the
trainer's memory estimate (``trainer.resources.check_fits``); whether it can run at all is the
trainer's own check when it switches (a grouped backend this GPU lacks, FP8 on a GPU without
it): one line each, recorded, and the search goes on.

``changes_numerics``: a lever whose values are not the same training (FP8, bf16 optimizer
moments); the loss guard drops those first. Adding a lever is one :func:`register` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from primus_perf.errors import UserError


@dataclass(frozen=True)
class Where:
    """What the search runs on: the config it starts from and the machine."""

    cfg: Any  # trainer.config.TrainerConfig
    device_type: str  # "cuda" or "cpu"
    dp: int  # data-parallel ranks
    dp_shard: int  # FSDP2's shard size
    moe: bool
    cache: str | None = None  # a kernel cache to try (--cache)
    fp8_formats: bool = False  # the device has FP8 GEMMs


@dataclass(frozen=True)
class Lever:
    name: str
    key: str  # the config key it sets
    values: Callable[[Where], list[str]]  # every value it can take here (the current one included)
    legal: Callable[[Where], str | None] = lambda _w: None  # why it cannot apply here
    companions: tuple[dict[str, str], ...] = ()  # added, in turn, to a value that does not fit alone
    changes_numerics: Callable[[str], bool] = lambda _v: False
    about: str = ""


LEVERS: dict[str, Lever] = {}


def register(lever: Lever) -> Lever:
    if lever.name in LEVERS:
        raise ValueError(f"lever {lever.name!r} is registered already")
    LEVERS[lever.name] = lever
    return lever


def unregister(name: str) -> None:
    LEVERS.pop(name, None)


def lever_of(key: str) -> Lever | None:
    return next((lv for lv in LEVERS.values() if lv.key == key), None)


def pick(names: str | None) -> list[Lever]:
    """The levers named (comma-separated; None: every registered one), in registry order."""
    if names is None:
        return list(LEVERS.values())
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in LEVERS]
    if unknown or not wanted:
        raise UserError(f"--levers {names!r}: unknown lever {', '.join(unknown) or '(none)'}"
                        f" (one of {', '.join(LEVERS)})")
    return [LEVERS[n] for n in LEVERS if n in wanted]


# ---- the registered levers -------------------------------------------------------------------


def _micro_batches(w: Where) -> list[str]:
    """The powers of two that divide the sequences a rank takes a step, and that number."""
    per_rank = w.cfg.train.global_batch // w.dp
    return [str(m) for m in range(1, per_rank + 1) if per_rank % m == 0 and (m & (m - 1) == 0 or m == per_rank)]


def _fixed_global_batch(w: Where) -> str | None:
    if w.cfg.train.global_batch <= 0:
        return ("train.global_batch is 0 (one micro-batch a step): the micro-batch is the recipe here;"
                " set train.global_batch to move it")
    return None


def _fsdp(w: Where) -> str | None:
    return None if w.dp_shard > 1 else "FSDP2 is off (parallel.dp_shard=1)"


def _fp8(w: Where) -> str | None:
    return None if w.fp8_formats else "this device has no FP8 GEMMs"


def _moe(w: Where) -> str | None:
    return None if w.moe else "the model has no MoE layers"


def _cache(w: Where) -> str | None:
    return None if w.cache else "no kernel cache given (--cache)"


def _grouped_backends(w: Where) -> list[str]:
    from primus_perf.kernels.grouped.backends import AUTO, BACKENDS

    return [AUTO, *BACKENDS]


register(Lever("micro_batch", "train.micro_batch", _micro_batches, _fixed_global_batch,
               companions=({"train.recompute": "selective"}, {"train.recompute": "full"}),
               about="sequences per forward/backward at the fixed global batch"))
register(Lever("compile", "train.compile", lambda w: ["off", "pointwise", "block"],
               about="torch.compile: nothing, the pointwise ops, or whole blocks with their GEMMs"))
register(Lever("recompute", "train.recompute", lambda w: ["none", "selective", "full"],
               about="activations recomputed in backward"))
register(Lever("fp8", "train.fp8", lambda w: ["off", "tensorwise", "rowwise"], _fp8,
               changes_numerics=lambda v: v != "off", about="the blocks' linear layers in FP8 (torchao)"))
register(Lever("optimizer", "train.optimizer",
               lambda w: ["fused", "foreach", "bf16"] if w.device_type == "cuda" else ["auto", "foreach", "bf16"],
               changes_numerics=lambda v: v == "bf16", about="AdamW's implementation; bf16 keeps its moments in bf16"))
register(Lever("grouped_backend", "model.moe.grouped_gemm_backend", _grouped_backends, _moe,
               about="the MoE experts' grouped GEMM"))
register(Lever("fsdp_reshard", "parallel.fsdp_reshard_after_forward", lambda w: ["true", "false"], _fsdp,
               about="FSDP2 frees the gathered blocks after forward (true) or keeps them for backward"))
register(Lever("fsdp_prefetch", "parallel.fsdp_prefetch", lambda w: ["0", "1", "2"], _fsdp,
               about="blocks FSDP2 all-gathers ahead"))
register(Lever("kernel_cache", "tuning.cache", lambda w: ["", w.cache or ""], _cache,
               about="the tuned kernels of a cache (primus-tune gemm/loop), confirmed in the step"))


@dataclass
class Setting:
    """Config keys and values over the base config (what a candidate or the plan is)."""

    values: dict[str, str] = field(default_factory=dict)

    def with_(self, changes: dict[str, str]) -> Setting:
        return Setting({**self.values, **changes})

    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.values.items()]

    def label(self, base: dict[str, str] | None = None) -> str:
        """``train.micro_batch=4 train.compile=block``: the keys that differ from ``base``."""
        base = base or {}
        diff = [f"{k}={v}" for k, v in self.values.items() if base.get(k) != v]
        return " ".join(diff) or "the default"
