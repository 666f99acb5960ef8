"""The problems to tune, from where a user gives them: problems files
(``problems.load_problems``), profiler traces (``tracelens.shapes.problems_from_traces``,
ranked by time) and problems the caller made (the CLI's ``--problem`` specs, parsed by the
kind's CLI part). No Triton or GPU work here: the CLI checks its input before any."""

from __future__ import annotations

import os
from collections.abc import Sequence

from primus_perf.base.errors import UserError
from primus_perf.problems import Problem, load_problems
from primus_perf.tuner.kinds import plugins


def gather_problems(
    kind: str,
    *,
    traces: Sequence[str | os.PathLike] = (),
    files: Sequence[str | os.PathLike] = (),
    given: Sequence[Problem] = (),
) -> list[Problem]:
    """The unique problems of one kind (a name of ``primus_perf.kinds``): those of the
    traces (most expensive first), then of the problems files, then ``given``. UserError
    when there is none."""
    wanted = plugins()[kind].problem_type
    found: list[Problem] = []
    if traces:
        from primus_perf.tracelens.shapes import problems_from_traces

        found += [p for p, _ in problems_from_traces(list(traces))[kind]]
    for path in files:
        found += load_problems(path)
    unique = {p.key(): p for p in [*found, *given] if isinstance(p, wanted)}
    if not unique:
        raise UserError(f"no {kind} problems found" + (" (a trace needs record_shapes=True)" if traces else ""))
    return list(unique.values())
