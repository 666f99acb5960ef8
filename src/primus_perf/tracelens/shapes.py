"""The problems file: the unique GEMM and attention problems of traces, for the tuners.

``primus-profile shapes TRACE -o problems.json`` writes it; ``primus-tune gemm --problems``
and ``primus-tune attention --problems`` read it (``problems.load_problems``). Format (JSON)::

    {"schema": "primus-perf-problems/1", "device": "...", "traces": [...], "steps": 2,
     "problems": [{"kind": "gemm", "problem": {GemmProblem fields}, "count": 4,
                   "time_s": 0.0012, "label": "1024x4096x4096 bf16 TN"},
                  {"kind": "attention", "problem": {AttentionProblem fields}, ...}]}

``count`` is the op calls in the whole trace (every profiled step of every rank) and
``time_s`` their total time. Items are ranked by time, most expensive first. Attention
forward and backward of one problem are one item (the tuner tunes the pair); its count is
the forward calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primus_perf.errors import UserError
from primus_perf.files import write_json
from primus_perf.problems import AttentionProblem, GemmProblem
from primus_perf.tracelens.analyze import Analysis, analyze

SCHEMA = "primus-perf-problems/1"


def problems_document(analysis: Analysis) -> dict[str, Any]:
    """The problems file's content for an analysis."""
    whole = analysis.rank_steps  # the tables are per step; the file counts the whole trace

    def item(r: Any) -> dict[str, Any]:
        return {"kind": "", "problem": r.problem.to_dict(), "count": round(r.calls * whole),
                "time_s": float(r.time_s) * whole, "label": r.label}

    items = [{**item(r), "kind": "gemm"} for r in analysis.gemm_problems.itertuples(index=False)]
    attn: dict[str, dict[str, Any]] = {}
    for r in analysis.attention_problems.itertuples(index=False):
        it = item(r)
        pair = attn.setdefault(r.key, {**it, "kind": "attention", "count": 0, "time_s": 0.0})
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


def problems_from_traces(paths: Any) -> tuple[list[tuple[GemmProblem, int]], list[tuple[AttentionProblem, int]]]:
    """The (problem, count) pairs of traces, ranked by time: what ``shapes`` would write."""
    doc = problems_document(analyze(paths))
    gemm = [(GemmProblem.from_dict(it["problem"]), it["count"]) for it in doc["problems"] if it["kind"] == "gemm"]
    attn = [(AttentionProblem.from_dict(it["problem"]), it["count"]) for it in doc["problems"]
            if it["kind"] == "attention"]
    return gemm, attn
