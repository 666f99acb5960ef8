"""Problem specs from the command line, and the problems the tuner can take (no Triton
import here: the CLI validates its input before any GPU or compiler work)."""

from __future__ import annotations

from primus_perf.problems import AttentionProblem

STRATEGIES = ("grid", "tpe")


_CAUSAL_WORDS = {"causal": True, "1": True, "true": True, "full": False, "0": False, "false": False}


def parse_problem_spec(spec: str, dtype: str = "bf16") -> AttentionProblem:
    """``"b,hq,hkv,s,d,causal"`` (causal: causal|full|1|0|true|false) -> AttentionProblem."""
    from primus_perf.errors import UserError

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


def check_tunable(problem: AttentionProblem) -> None:
    """One-line UserError for problems the tuner cannot take."""
    from primus_perf.errors import UserError
    from primus_perf.tuner.attention.configs import HEAD_DIMS

    if problem.dtype not in ("bf16", "f16"):
        raise UserError(f"{problem}: attention tuning needs bf16 or f16, not {problem.dtype}")
    if problem.head_dim not in HEAD_DIMS:
        raise UserError(f"{problem}: head_dim must be one of {HEAD_DIMS}")
    if problem.causal and problem.seq_q != problem.seq_kv:
        raise UserError(f"{problem}: causal problems need seq_q == seq_kv")
