"""The problems to tune, from where a user gives them: problems files
(``problems.load_problems``), profiler traces (``tracelens.shapes.problems_from_traces``,
ranked by time) and specs on the command line (``--problem``: attention
``b,hq,hkv,s,d,causal``, GEMM ``M,N,K[,layout,dtype]`` or its label). No Triton or GPU work
here: the CLI checks its input before any."""

from __future__ import annotations

import os
from collections.abc import Sequence

from primus_perf.errors import UserError
from primus_perf.problems import AttentionProblem, GemmProblem, Problem, load_problems
from primus_perf.tuner.kinds import plugins

_CAUSAL_WORDS = {"causal": True, "1": True, "true": True, "full": False, "0": False, "false": False}


def parse_attention_spec(spec: str, dtype: str = "bf16") -> AttentionProblem:
    """``"b,hq,hkv,s,d,causal"`` (causal: causal|full|1|0|true|false) -> AttentionProblem."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != 6:
        raise UserError(f"--problem {spec!r}: expected b,hq,hkv,s,d,causal (6 fields), got {len(parts)}")
    try:
        b, hq, hkv, s, d = (int(x) for x in parts[:5])
    except ValueError:
        raise UserError(f"--problem {spec!r}: b, hq, hkv, s and d must be integers") from None
    causal = _CAUSAL_WORDS.get(parts[5].lower())
    if causal is None:
        raise UserError(f"--problem {spec!r}: the last field must be causal or full, got {parts[5]!r}")
    try:
        return AttentionProblem(b, hq, hkv, s, s, d, dtype, causal, "bshd")
    except ValueError as exc:
        raise UserError(f"--problem {spec!r}: {exc}") from None


def parse_spec(kind: str, spec: str, dtype: str = "bf16") -> Problem:
    """A ``--problem`` of ``kind``: one UserError naming the spec when it is not one."""
    if kind == "attention":
        return parse_attention_spec(spec, dtype)
    try:
        return GemmProblem.from_spec(spec)
    except ValueError as exc:
        raise UserError(f"--problem {exc}") from None


def gather_problems(
    kind: str,
    *,
    traces: Sequence[str | os.PathLike] = (),
    files: Sequence[str | os.PathLike] = (),
    specs: Sequence[str] = (),
    dtype: str = "bf16",
) -> list[Problem]:
    """The unique problems of one kind (a name of ``primus_perf.kinds``): those of the
    traces (most expensive first), then of the problems files, then the attention specs
    (``parse_attention_spec``, in ``dtype``). UserError when there is none."""
    wanted = plugins()[kind].problem_type
    found: list[Problem] = []
    if traces:
        from primus_perf.tracelens.shapes import problems_from_traces

        found += [p for p, _ in problems_from_traces(list(traces))[kind]]
    for path in files:
        found += load_problems(path)
    found += [parse_spec(kind, s, dtype) for s in specs]
    unique = {p.key(): p for p in found if isinstance(p, wanted)}
    if not unique:
        if not (traces or files or specs):
            raise UserError("nothing to tune: give --problems FILE, --from-trace TRACE"
                            + (" or --problem SPEC" if kind in ("attention", "gemm") else ""))
        hint = " (a trace needs record_shapes=True)" if traces else ""
        raise UserError(f"no {kind} problems found{hint}")
    return list(unique.values())
