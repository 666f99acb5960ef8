"""The problems file: the unique GEMM, grouped GEMM and attention problems of traces, for
the tuners.

``primus-profile shapes TRACE -o problems.json`` writes it; ``primus-tune gemm``,
``grouped-gemm`` and ``attention`` read it with ``--problems`` (``problems.load_problems``).
Format (JSON)::

    {"schema": "primus-perf-problems/1", "device": "...", "traces": [...], "steps": 2,
     "problems": [{"kind": "gemm", "problem": {GemmProblem fields}, "count": 4,
                   "time_s": 0.0012, "label": "1024x4096x4096 bf16 TN"},
                  {"kind": "grouped_gemm", "problem": {GroupedGemmProblem fields}, ...},
                  {"kind": "attention", "problem": {AttentionProblem fields}, ...}]}

``count`` is the op calls in the whole trace (every profiled step of every rank) and
``time_s`` their total time. Items are ranked by time, most expensive first. Attention
forward and backward of one problem are one item (the tuner tunes the pair); its count is
the forward calls. Each pass of a grouped GEMM is an item of its own (the tuner tunes each
pass); one whose split of the tokens over the groups the trace does not record has
``"skew_known": false`` (its skew is taken as balanced; see ``analyses.problems``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primus_perf.errors import UserError
from primus_perf.files import write_json
from primus_perf.problems import Problem, problem_from_item
from primus_perf.tracelens.analyze import Analysis, analyze

SCHEMA = "primus-perf-problems/1"


def problems_document(analysis: Analysis) -> dict[str, Any]:
    """The problems file's content for an analysis."""
    whole = analysis.rank_steps  # the tables are per step; the file counts the whole trace

    def item(kind: str, r: Any) -> dict[str, Any]:
        return {"kind": kind, "problem": r.problem.to_dict(), "count": round(r.calls * whole),
                "time_s": float(r.time_s) * whole, "label": r.label}

    items = [item("gemm", r) for r in analysis.gemm_problems.itertuples(index=False)]
    items += [{**item("grouped_gemm", r), **({} if r.skew_known else {"skew_known": False})}
              for r in analysis.grouped_gemm_problems.itertuples(index=False)]
    attn: dict[str, dict[str, Any]] = {}
    for r in analysis.attention_problems.itertuples(index=False):
        it = item("attention", r)
        pair = attn.setdefault(r.key, {**it, "count": 0, "time_s": 0.0})
        if r.direction == "fwd":
            pair["count"] = it["count"]
        pair["time_s"] += it["time_s"]
    items += attn.values()
    items.sort(key=lambda it: -it["time_s"])
    return {"schema": SCHEMA, "device": analysis.device["name"], "traces": analysis.traces,
            "steps": analysis.n_steps, "problems": items}


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
    """The (problem, count) pairs of traces by kind ("gemm", "grouped_gemm", "attention"),
    ranked by time: what ``shapes`` would write."""
    analysis = analyze(paths)
    out: dict[str, list[tuple[Problem, int]]] = {kind: [] for kind in analysis.problem_tables()}
    for it in problems_document(analysis)["problems"]:
        out[it["kind"]].append((problem_from_item(it), it["count"]))
    return out
