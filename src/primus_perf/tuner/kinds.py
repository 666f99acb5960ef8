"""The tuner's entry point over kinds: each kind's ``tuner`` part (``primus_perf.kinds``) is its
plugin class, whose ``problem_type`` says which problems it takes. :func:`tune` is the public
entry point (``primus_perf.tune``): it takes problems of any kinds and runs the core loop with
one plugin per kind present, each with its defaults."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from primus_perf import kinds as registry
from primus_perf.base.errors import UserError
from primus_perf.tuner import core


def plugins() -> dict[str, type]:
    """Kind name -> its plugin class, in the registry's order."""
    return registry.with_part("tuner")


def kind_of(problem: Any) -> str:
    """The kind whose plugin takes ``problem``; UserError for a problem no kind takes."""
    for kind, cls in plugins().items():
        if isinstance(problem, cls.problem_type):
            return kind
    raise UserError(f"no tuner takes problems of type {type(problem).__name__}")


def default_tuners(kinds: Iterable[str] | None = None) -> dict[str, Any]:
    """One plugin with its defaults per kind of ``kinds`` (default: every kind), by kind."""
    found = plugins()
    return {kind: found[kind]() for kind in (found if kinds is None else kinds)}


def tune(
    problems: Sequence[Any],
    *,
    cache: str | os.PathLike = "tuning_cache.json",
    budget_s: float = 5.0,
    timer: Any = None,
    progress: core.Progress | None = None,
) -> core.TuneRun:
    """Tune problems of any kinds (any mix) into ``cache``: one plugin per kind with its
    defaults, the core loop's dedupe, resume, per-problem writes and Ctrl-C handling."""
    tuners = default_tuners(dict.fromkeys(kind_of(p) for p in problems))
    return core.tune(problems, cache=cache, tuners=list(tuners.values()), budget_s=budget_s, timer=timer,
                     progress=progress)
