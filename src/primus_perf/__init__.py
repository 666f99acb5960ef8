"""primus-perf: profile and autotune large-model training on NVIDIA and AMD GPUs.

The loop in a few calls::

    import primus_perf as pp

    pp.capture_trainer("llama3-8b", ["model.n_layers=4"], "runs/base", pp.Schedule(active=3))
    a = pp.analyze("runs/base")                       # Analysis of pandas DataFrames
    problems = [p for df in a.problem_tables().values() for p in df["problem"]]  # GEMM, grouped GEMM, attention
    run = pp.tune(problems, cache="tuning_cache.json")   # GPU: cuBLASLt/hipBLASLt, Triton, SDPA
    with pp.enable("tuning_cache.json"):              # tuned kernels in this process
        ...

or all of it at once: ``pp.run_loop("tiny")`` (what ``primus-tune loop`` runs). Your own
script is profiled as it is with ``pp.capture_program`` (``primus-profile run -- script.py``;
``pp.profile_step()`` marks its steps where ``optimizer.step()`` does not), your own step
loop with ``pp.profile_steps`` or ``pp.profile_window``, and
``with pp.enable(cache="tuning_cache.json"):`` runs any PyTorch program's GEMMs and SDPA
calls on the cache's choices (``online=True`` tunes new problems during the first steps).
``pp.knob("micro_batch", 2)`` is a script's consent to have a setting tuned by ``primus-tune
step -- script.py`` (the plan's value inside a plan, the default outside).

Names are imported when first used, so ``import primus_perf`` stays cheap (no torch).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from primus_perf.base.entry import VERSION as __version__

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # problems: the shared vocabulary
    "GemmProblem": "primus_perf.problems",
    "AttentionProblem": "primus_perf.problems",
    "GroupedGemmProblem": "primus_perf.problems",
    "load_problems": "primus_perf.problems",
    # devices and errors
    "DeviceIdentity": "primus_perf.base.devices",
    "current_device": "primus_perf.base.devices",
    "UserError": "primus_perf.base.errors",
    "ArgumentTypeError": "primus_perf.base.arguments",
    # capture and analysis
    "Schedule": "primus_perf.profiler.capture",
    "capture_trainer": "primus_perf.profiler.capture",
    "profile_steps": "primus_perf.profiler.capture",
    "profile_window": "primus_perf.profiler.capture",
    "capture_program": "primus_perf.profiler.program",
    "profile_step": "primus_perf.base.programs",
    "analyze": "primus_perf.tracelens.analyze",
    "Analysis": "primus_perf.tracelens.analyze",
    "build_report": "primus_perf.tracelens.report",
    "compare": "primus_perf.tracelens.compare",
    # tuning and the cache
    "tune": "primus_perf.tuner.kinds",
    "TuneResult": "primus_perf.tuner.core",
    "TuneRun": "primus_perf.tuner.core",
    "TuningCache": "primus_perf.cache.store",
    "CacheEntry": "primus_perf.cache.store",
    # tuned kernels in any PyTorch program, the one public way to turn routing on
    # (``python -m primus_perf.launch`` runs a script with it)
    "enable": "primus_perf.enabling",
    # the reference trainer and the whole loop
    "load_config": "primus_perf.trainer.config",
    "Trainer": "primus_perf.trainer.loop",
    "run_loop": "primus_perf.loop.pipeline",
    # a user's script: the settings it consents to have tuned (primus-tune step -- script.py)
    "knob": "primus_perf.tuner.step.hooks",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'primus_perf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if inspect.isfunction(value):  # its arguments' types checked (primus_perf.base.arguments)
        from primus_perf.base.arguments import checked

        value = checked(value, f"primus_perf.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
