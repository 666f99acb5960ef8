"""A running trainer's speed knobs switched between optimizer steps, in place: the same weights,
optimizer state and data, another way of running them (what the step tuner measures, side by
side in interleaved blocks, without building a second model).

``reconfigure(trainer, cfg)`` applies every key in which ``cfg`` differs from the trainer's,
in :data:`SWITCHES`' order, after the memory estimate says ``cfg`` fits. A key outside the
table (the model's shape, the parallel layout, the recipe: ``train.global_batch``,
``train.lr``, ...) cannot change in place: :class:`NotSwitchable`, naming it, before anything
changed. Neither can ``train.fp8`` under FSDP2 (its FP8 all-gather is set up when the blocks
are sharded) or ``train.fp8=auto`` (a plan read from the cache at start-up): a new trainer
runs those.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from primus_perf.base.errors import ConfigError, UserError
from primus_perf.trainer.config import TrainerConfig, accumulation, flat
from primus_perf.trainer.data import make_batches
from primus_perf.trainer.fp8 import BF16, fp8_plan
from primus_perf.trainer.optim import make_optimizer
from primus_perf.trainer.resources import check_fits

Trainer = Any  # a trainer.loop.Trainer (this module is below it: no import of it)


class NotSwitchable(ConfigError):
    """A config key a running trainer cannot change: a new trainer is needed."""


def changed(old: TrainerConfig, new: TrainerConfig) -> list[str]:
    """The dotted keys whose values differ."""
    a, b = flat(old), flat(new)
    return [k for k in a if a[k] != b[k]]


def _micro_batch(trainer: Trainer, cfg: TrainerConfig) -> None:
    t = cfg.train
    n = accumulation(t, trainer.groups.dp)  # a micro-batch the global batch does not hold: one line
    if t.micro_batch * n * t.seq_len * trainer.groups.dp != trainer.tokens_per_step:
        raise NotSwitchable("config key 'train.micro_batch': in place only at a fixed train.global_batch")
    trainer.accumulation = n
    trainer.batches = make_batches(cfg.data.path, cfg.model.vocab_size, t.seq_len, t.micro_batch, trainer.groups.dp,
                                   trainer.groups.dp_rank, t.seed, n)


def _recompute(trainer: Trainer, cfg: TrainerConfig) -> None:
    trainer.model.recompute = cfg.train.recompute


def _compile(trainer: Trainer, cfg: TrainerConfig) -> None:
    trainer.model.set_compile(cfg.train.compile)
    if any(r != BF16 for r in trainer.fp8.values()):  # each FP8 layer's quantization compiled, or not
        trainer.set_fp8(trainer.fp8, compile=cfg.train.compile == "pointwise")


def _fp8(trainer: Trainer, cfg: TrainerConfig) -> None:
    recipe, t = cfg.train.fp8, cfg.train
    if trainer.groups.dp_shard > 1:
        raise NotSwitchable(f"config key 'train.fp8': {recipe} is set up when the trainer starts under FSDP2"
                            " (its FP8 all-gather)")
    try:  # auto: the cache's plan for this model at this micro-batch
        layers = fp8_plan(trainer.model, recipe, cfg.tuning.cache, t.micro_batch * t.seq_len)
    except UserError as exc:
        raise ConfigError(f"config key 'train.fp8': {exc}") from None
    trainer.set_fp8(layers, compile=t.compile == "pointwise")


def _optimizer(trainer: Trainer, cfg: TrainerConfig) -> None:
    """A new optimizer of the kind over the same parameters, taking over the old one's state
    (the moments cast to the dtype it keeps, the step count where it keeps it)."""
    t, old = cfg.train, trainer.optimizer
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in old.param_groups]
    new = make_optimizer(groups, t.optimizer, trainer.device, lr=old.param_groups[0]["lr"],
                         betas=(t.beta1, t.beta2), eps=t.eps)
    for p, state in old.state.items():
        if not state:
            continue
        step = float(state["step"])
        moments = {k: state[k] for k in ("exp_avg", "exp_avg_sq")}
        if t.optimizer == "bf16":
            new.state[p] = {"step": int(step), **{k: v.to(torch.bfloat16) for k, v in moments.items()}}
        else:
            group = new.param_groups[0]
            on_device = bool(group.get("fused") or group.get("capturable"))
            where = p.device if on_device else torch.device("cpu")
            new.state[p] = {"step": torch.tensor(step, dtype=torch.float32, device=where),
                            **{k: v.to(p.dtype) for k, v in moments.items()}}
    trainer.optimizer = new
    old.state.clear()


def _grouped(trainer: Trainer, cfg: TrainerConfig) -> None:
    trainer.use_grouped_backend(cfg.model.moe.grouped_gemm_backend)


def _reshard(trainer: Trainer, cfg: TrainerConfig) -> None:
    if trainer.groups.dp_shard > 1:
        from torch.distributed.fsdp import FSDPModule

        for m in [trainer.model.tok_embeddings, *trainer.model.layers]:
            if isinstance(m, FSDPModule):
                m.set_reshard_after_forward(cfg.parallel.fsdp_reshard_after_forward)


def _prefetch(trainer: Trainer, cfg: TrainerConfig) -> None:
    if trainer.groups.dp_shard > 1:
        from primus_perf.trainer.fsdp import set_prefetch

        set_prefetch(list(trainer.model.layers), cfg.parallel.fsdp_prefetch)


def _cache(trainer: Trainer, cfg: TrainerConfig) -> None:
    trainer.use_tuning_cache(cfg.tuning.cache)


# key -> how a running trainer takes its new value; applied in this order (the cache before
# the FP8 plan; compile before FP8, whose quantization it compiles or not)
SWITCHES: dict[str, Callable[[Trainer, TrainerConfig], None]] = {
    "tuning.cache": _cache,
    "train.micro_batch": _micro_batch,
    "train.recompute": _recompute,
    "train.compile": _compile,
    "train.fp8": _fp8,
    "train.optimizer": _optimizer,
    "model.moe.grouped_gemm_backend": _grouped,
    "parallel.fsdp_reshard_after_forward": _reshard,
    "parallel.fsdp_prefetch": _prefetch,
}
# keys that change nothing the step runs (how long to train, how often to log)
FREE = ("train.steps", "train.log_every")


def reconfigure(trainer: Trainer, cfg: TrainerConfig) -> list[str]:
    """Switch ``trainer`` to ``cfg`` in place; returns the keys that changed. Raises
    :class:`NotSwitchable` for a key that cannot change while it runs, and the memory
    estimate's ConfigError for a config that does not fit, before anything changed; a switch
    that fails (no FP8 plan in the cache, a backend this device lacks) undoes those before it."""
    keys = changed(trainer.cfg, cfg)
    fixed = [k for k in keys if k not in SWITCHES and k not in FREE]
    if fixed:
        raise NotSwitchable(f"config key {fixed[0]!r} cannot change while the trainer runs (in place:"
                            f" {', '.join(SWITCHES)})")
    if "train.fp8" in keys and trainer.groups.dp_shard > 1:
        _fp8(trainer, cfg)  # raises: set up at start-up
    if "tuning.cache" in keys and (cfg.train.compile == "block" or "block" in trainer.model.__dict__.get("_compiled", {})):
        # the cache routes a compiled block's GEMMs when Inductor compiles it: blocks compiled
        # (kept) under another cache would run without its routes
        raise NotSwitchable("config key 'tuning.cache' cannot change in place once blocks are compiled")
    check_fits(cfg, trainer.device.type, trainer.device.index or 0)
    old, applied = trainer.cfg, []
    try:
        for key, switch in SWITCHES.items():
            if key in keys:
                switch(trainer, cfg)
                applied.append(key)
    except BaseException:  # what had switched goes back: the trainer runs the old config
        for key in reversed(applied):
            SWITCHES[key](trainer, old)
        raise
    trainer.cfg = cfg
    gc.collect()
    if trainer.device.type == "cuda":
        torch.cuda.empty_cache()  # what the old setting's allocations left: the new one's peak is its own
    return keys
