"""One trainer the step tuner measures on: switched between settings between steps, in place
where the trainer can (``Trainer.reconfigure``), else by a new trainer of the setting (the same
seed: the same weights), one alive at a time.

Under torchrun every rank runs the same session in lockstep: the same switches, the same steps.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from primus_perf.base.errors import OutOfMemory
from primus_perf.tuner.step.levers import Setting

RECOMPILES = 64  # compiled code kept per function: micro-batch shapes x recompute modes x FP8 plans


def _allow_recompiles() -> None:
    """One session compiles each block (or pointwise op) once per setting it runs: a shape per
    micro-batch, a graph per recompute mode and FP8 plan; past Dynamo's default limit of 8 it
    would fall back to eager and time that as the compiled side."""
    import torch._dynamo

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILES)


def interleaved(session: Any, base: Setting, other: Setting, *, blocks: int, block_steps: int,
                settle: int) -> tuple[list[float], list[float]]:
    """Per block, the median step seconds of ``base`` and of ``other`` on one session (any
    object with ``switch`` and ``step``), their blocks interleaved (``tuner.measure.blocks``)."""
    from primus_perf.tuner.measure import blocks as measure_blocks

    times = measure_blocks({"base": lambda: session.switch(base), "other": lambda: session.switch(other)},
                           session.step, blocks=blocks, block_steps=block_steps, settle=settle)
    return times["base"], times["other"]


class StepSession:
    """``switch(setting)`` then ``step()`` (one optimizer step's seconds); ``measure`` two
    settings against each other (what the search calls). ``rebuilds`` counts the settings that
    needed a new trainer."""

    def __init__(self, config: str, base: Sequence[str], setting: Setting) -> None:
        from primus_perf.trainer.config import load_config
        from primus_perf.trainer.loop import Trainer

        self._make = Trainer
        _allow_recompiles()
        self.base_cfg = load_config(config, base)  # the command line's, once: a setting is typed over it
        self.setting = setting
        self.trainer: Any = Trainer(self.cfg_of(setting))
        self.rebuilds = 0

    def cfg_of(self, setting: Setting) -> Any:
        from primus_perf.trainer.config import with_settings

        return with_settings(self.base_cfg, setting.values)

    def measure(self, base: Setting, other: Setting, *, blocks: int, block_steps: int,
                settle: int) -> tuple[list[float], list[float]]:
        return interleaved(self, base, other, blocks=blocks, block_steps=block_steps, settle=settle)

    def switch(self, setting: Setting) -> None:
        """Run ``setting`` from the next step. A ConfigError (it does not fit, it cannot run
        here) leaves the session as it was."""
        from primus_perf.trainer.knobs import NotSwitchable

        if setting.values == self.setting.values:
            return
        cfg = self.cfg_of(setting)
        try:
            try:
                self.trainer.reconfigure(cfg)
            except NotSwitchable:
                self._rebuild(cfg)
        except Exception as exc:  # torch's own out-of-memory (allocating the new setting's state)
            if type(exc).__name__ != "OutOfMemoryError":
                raise
            raise OutOfMemory(f"out of memory switching to {setting.label()}: "
                              f"{(str(exc).splitlines() or [''])[0]}") from None
        self.setting = setting

    def _rebuild(self, cfg: Any) -> None:
        """A new trainer of ``cfg`` (one alive at a time); where it cannot be built, the
        session's own setting is built again before the error goes on."""
        from primus_perf.trainer.resources import check_fits

        check_fits(cfg, self.trainer.device.type, self.trainer.device.index or 0)
        previous = self.cfg_of(self.setting)
        self.close()
        try:
            self.trainer = self._make(cfg)
        except BaseException:
            self.trainer = self._make(previous)
            raise
        self.rebuilds += 1

    def reset(self, setting: Setting) -> None:
        """A fresh trainer of ``setting`` from the seed (after a candidate left the weights
        non-finite, or failed in a way that leaves the trainer's state unknown)."""
        self.close()
        gc.collect()
        self._empty_cache()
        self.trainer = self._make(self.cfg_of(setting))
        self.setting = setting
        self.rebuilds += 1

    def warm_up(self, steps: int) -> None:
        """Untimed steps: allocator, autotuning and the first compile settle before any block."""
        for _ in range(steps):
            self.step()

    def step(self) -> float:
        return float(self.trainer.train_step().step_time_s)

    def recover(self, setting: Setting) -> None:
        """After an out-of-memory step: the gradients dropped, back to ``setting``."""
        if self.trainer is None:  # a rebuild that failed past its own recovery
            self.reset(setting)
            return
        self.trainer.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        self._empty_cache()
        try:
            self.switch(setting)
        except OutOfMemory:  # pragma: no cover - the incumbent ran before
            self._rebuild(self.cfg_of(setting))
            self.setting = setting

    def _empty_cache(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None
            gc.collect()
            self._empty_cache()
