"""The step tuner: the whole training step searched at a fixed recipe (``primus-tune step``).

``levers`` (each a registered dimension: the values, the legality and memory rules), ``search``
(the advice from a profile made in a child process; the coordinate search with interaction
passes, every candidate measured in the step against the incumbent through ``tuner.measure``
and judged by ``tuner.decide``), ``tune`` (the reference trainer's session, switched between
settings; the plan measured against the default, the loss guard, ``plan.yaml`` and
``step_plan.json``), ``lanes`` (other GPUs measuring at once), ``script`` (the same for a
user's script)."""

from primus_perf.tuner.step.levers import (
    LEVERS,
    Lever,
    Setting,
    TrainerContext,
    register,
    unregister,
)
from primus_perf.tuner.step.search import Advice
from primus_perf.tuner.step.tune import StepTuneResult, tune_step

__all__ = ["LEVERS", "Advice", "Lever", "Setting", "StepTuneResult", "TrainerContext", "register", "tune_step", "unregister"]
