"""``primus-tune attention``: the attention kind's CLI part (the command: :mod:`.tune_kind`):
search Triton tiles, race the SDPA backends, write the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from primus_perf.base.errors import UserError
from primus_perf.cli.render import new_table, print_table
from primus_perf.cli.tune_kind import CliPart
from primus_perf.problems import AttentionProblem, canonical_dtype
from primus_perf.tuner.attention.space import STRATEGIES

HELP = """Tune attention: Triton tile configs (forward + backward) against every torch SDPA
        backend; the fastest per problem goes to the cache, written after each problem.
        --offline (the default) tunes the listed problems now; --online tunes during a run
        (--config PRESET [overrides], or a program after --)."""
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


def check(values: dict[str, Any]) -> None:
    """``--strategy`` one of :data:`STRATEGIES`; ``--dtype`` a dtype's name, made canonical."""
    if values["strategy"] not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {values['strategy']!r}")
    try:
        values["dtype"] = canonical_dtype(values["dtype"])
    except ValueError as exc:
        raise UserError(f"--dtype: {exc}") from None


def render(res) -> None:
    """The candidates of one tuned attention problem: forward and backward rates, status."""
    from primus_perf.cli.tune_run import tflops
    from primus_perf.kernels.attention.configs import AttnConfig

    search = res.details.get("search")
    title = str(res.problem) + (f"  ({search['strategy']}: {search['measured']} configs measured)" if search else "")
    table = new_table(title, ("backend", "config", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd ms", "vs default"),
                      {"backend", "config"})
    p = res.problem
    for c in res.candidates:
        mark = "[bold green]* " if c.status == "chosen" else "  "
        if c.status == "rejected":
            table.add_row(mark + c.name, f"rejected: {c.reason}", "", "", "", "")
            continue
        fwd, bwd = (c.parts.get(part, {}).get("median_s") for part in ("fwd", "bwd"))
        table.add_row(
            mark + c.name + (" (dropped)" if c.status == "dropped" else ""),
            AttnConfig.from_dict(c.config).label() if "fwd" in c.config else "",
            tflops(p.forward_flops, fwd), tflops(p.backward_flops, bwd),
            f"{c.total_s * 1e3:.3f}", f"{res.default_s / c.total_s:.2f}x",
        )
    print_table(table)


CLI = CliPart(HELP, "primus_perf.tuner.attention.plugin:AttentionTuner", check=check, render=render,
              spec=lambda spec, values: parse_attention_spec(spec, values["dtype"]),
              spec_help="b,hq,hkv,s,d,causal|full (repeatable)", spec_options={
    "dtype": (str, typer.Option("bf16", "--dtype", help="bf16 or f16 (fp16, float16 accepted) for --problem"))}, options={
    "strategy": (str, typer.Option("grid", "--strategy",
                                   help=f"{' or '.join(STRATEGIES)}: exhaustive, or optuna's TPE")),
    "trials": (Optional[int], typer.Option(  # noqa: UP045 (typer needs Optional)
        None, "--trials", min=1, help="tpe trials (default: 20% of the grid)")),
    "storage": (Optional[Path], typer.Option(  # noqa: UP045
        None, "--study-db", help="SQLite file for tpe studies (resume an interrupted search)")),
})
