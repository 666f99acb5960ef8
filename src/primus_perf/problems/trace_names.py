"""Grouped GEMM calls in profiler traces: the name a call records around itself, and its
parser (the analyzer reads the problem and the exact tokens back from it)."""

from __future__ import annotations

from primus_perf.problems.grouped import GroupedGemmProblem

GROUPED_TRACE_OP = f"primus_perf::{GroupedGemmProblem.kind}"


def grouped_trace_name(problem: GroupedGemmProblem, tokens: int) -> str:
    """The name a grouped GEMM call has in a profiler trace (the grouped-GEMM entry point
    records it around the call): ``GROUPED_TRACE_OP <problem key> tokens=<T>``, e.g.
    ``primus_perf::<kind> ggemm:fwd|g8|k128|n256|t2048|s1.5|bf16|wN tokens=1843``:
    the problem exactly and the call's exact total tokens (its exact FLOPs and bytes)."""
    return f"{GROUPED_TRACE_OP} {problem.key()} tokens={int(tokens)}"


def parse_grouped_trace_name(name: str) -> tuple[GroupedGemmProblem, int] | None:
    """``(problem, tokens)`` of a :func:`grouped_trace_name`, or None for any other name."""
    if not name.startswith(GROUPED_TRACE_OP + " "):
        return None
    key, sep, tokens = name[len(GROUPED_TRACE_OP) + 1:].rpartition(" tokens=")
    if not sep or not tokens.isdigit():
        return None
    try:
        return GroupedGemmProblem.from_key(key), int(tokens)
    except ValueError:
        return None
