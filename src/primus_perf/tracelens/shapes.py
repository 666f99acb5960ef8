"""The problems file: the unique GEMM, grouped GEMM and attention problems of traces, for
the tuners.

``primus-profile shapes TRACE -o problems.json`` writes it; ``primus-tune gemm``,
``grouped-gemm`` and ``attention`` read it with ``--problems`` (``problems.load_problems``).
Format (JSON)::

    {"schema": "primus-perf-problems/1", "device": "...", "traces": [...], "steps": 2,
     "problems": [{"kind": "gemm", "problem": {GemmProblem fields}, "count": 4,
                   "time_s": 0.0012, "label": "1024x4096x4096 bf16 TN"},
                  {"kind": <grouped kind>, "problem": {GroupedGemmProblem fields}, ...},
                  {"kind": "attention", "problem": {AttentionProblem fields}, ...}]}

``count`` is the op calls in the whole trace (every profiled step of every rank) and
``time_s`` their total time. Items are ranked by time, most expensive first. Attention
forward and backward of one problem are one item (the tuner tunes the pair); its count is
the forward calls. Each pass of a grouped GEMM is an item of its own (the tuner tunes each
pass); one whose split of the tokens over the groups the trace does not record has
``"skew_known": false`` (its skew is taken as balanced; see ``analyses.problems``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from primus_perf import kinds
from primus_perf.base.errors import UserError
from primus_perf.base.files import write_json
from primus_perf.problems import Problem
from primus_perf.tracelens.analyze import Analysis, analyze

SCHEMA = "primus-perf-problems/1"


@dataclass(frozen=True)
class RankedProblem:
    """One item of the problems file, typed: the problem, its calls and time in the whole
    trace, its label, and whether the trace recorded its token split (grouped GEMMs)."""

    problem: Problem
    count: int
    time_s: float
    label: str
    skew_known: bool = True

    def to_item(self) -> dict[str, Any]:
        item = {"kind": self.problem.kind, "problem": self.problem.to_dict(), "count": self.count,
                "time_s": self.time_s, "label": self.label}
        return item if self.skew_known else {**item, "skew_known": False}


def ranked_problems(analysis: Analysis) -> list[RankedProblem]:
    """The analysis's problems of every kind, most expensive first (the problems file's
    items, as objects): one per table row, except that attention's forward and backward
    rows of one problem are one item (its count: the forward calls)."""
    whole = analysis.rank_steps  # the tables are per step; the file counts the whole trace
    out: list[RankedProblem] = []
    for kind, table in analysis.problem_tables().items():
        paired: dict[str, RankedProblem] = {}
        for r in table.itertuples(index=False):
            it = RankedProblem(r.problem, round(r.calls * whole), float(r.time_s) * whole, r.label,
                               bool(getattr(r, "skew_known", True)))
            if kind != kinds.ATTENTION.name:
                out.append(it)
                continue
            pair = paired.get(r.key)
            count = it.count if r.direction == "fwd" else (pair.count if pair else 0)
            time_s = it.time_s + (pair.time_s if pair else 0.0)
            paired[r.key] = RankedProblem(r.problem, count, time_s, pair.label if pair else it.label)
        out += paired.values()
    out.sort(key=lambda it: -it.time_s)
    return out


def problems_document(analysis: Analysis) -> dict[str, Any]:
    """The problems file's content for an analysis."""
    return {"schema": SCHEMA, "device": analysis.device["name"], "traces": analysis.traces,
            "steps": analysis.n_steps, "problems": [it.to_item() for it in ranked_problems(analysis)]}


def write_problems(analysis: Analysis, path: str | Path) -> Path:
    """Write the problems file atomically (temporary name + rename)."""
    p = Path(path)
    doc = problems_document(analysis)
    try:
        write_json(p, doc, indent=1)
    except OSError as exc:
        raise UserError(f"cannot write {p}: {exc.strerror}") from None
    return p


def problems_from_traces(paths: Any) -> dict[str, list[tuple[Problem, int]]]:
    """The (problem, count) pairs of traces by kind (every kind of ``primus_perf.kinds``),
    ranked by time: what ``shapes`` would write."""
    out: dict[str, list[tuple[Problem, int]]] = {kind: [] for kind in kinds.names()}
    for it in ranked_problems(analyze(paths)):
        out[it.problem.kind].append((it.problem, it.count))
    return out
