"""``primus-profile analyze`` and ``shapes``: explain a trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from primus_perf.cli.common import JSON_HELP, TOP_MIN, check_trace_args, console, err_console
from primus_perf.files import write_output
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.shapes import write_problems


def _ms(v: Any) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v) * 1e3:.3f}"


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _pct(v: Any) -> str:
    return _num(v * 100 if v is not None else None, "{:.1f}%")


def _run(traces: list[Path], jobs: int | None = None) -> Analysis:
    check_trace_args(traces)
    with err_console.status("analyzing") as status:
        return analyze([str(t) for t in traces], progress=lambda msg: status.update(msg), jobs=jobs)


def _tflop(flops: float | None) -> str:
    """FLOPs per step in the unit that shows them (a CPU run's are far below a TFLOP)."""
    if flops is None:
        return "FLOPs unknown"
    for scale, unit in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
        if flops >= scale:
            return f"{flops / scale:.2f} {unit}/step"
    return f"{flops:,.0f} FLOP/step"


def _busy(a: Analysis) -> str:
    """GPU busy time; for a trace without GPU events, the CPU time of its modeled ops."""
    if len(a.kernels):
        return f"GPU busy {_ms(a.totals['gpu_busy_s_per_step'])} ms/step"
    cpu = sum(float(df["time_s"].sum()) for df in a.problem_tables().values() if len(df))
    return f"no GPU events: CPU time of GEMM, grouped GEMM and attention ops {_ms(cpu)} ms/step"


def render(a: Analysis, top: int) -> None:
    """Rich tables of an analysis: header, breakdowns, hotspots, problems, ranks."""
    t = a.totals
    console.print(
        f"[bold]{a.device['name']}[/] · {len(a.ranks)} rank(s) · {len(a.steps) or 1} step(s) · "
        f"step {_ms(t['step_time_s'])} ms · {_busy(a)} · GEMM {_tflop(t['gemm_flops_per_step'])} · "
        + (f"grouped GEMM {_tflop(t['grouped_gemm_flops_per_step'])} · " if len(a.grouped_gemm_problems) else "")
        + f"attention {_tflop(t['attention_flops_per_step'])}"
    )
    cat = a.category_seconds()
    total = float(cat.sum()) or 1.0
    tb = Table(title="GPU time by category (ms per step)")
    for col in ("category", "ms", "share"):
        tb.add_column(col, justify="left" if col == "category" else "right")
    for name, sec in cat.items():
        tb.add_row(str(name), _ms(sec), _pct(sec / total))
    console.print(tb)
    if len(a.temporal):
        tt = Table(title="step time (median ms over steps)")
        for col in ("rank", "step", "compute", "exposed comm", "exposed memcpy", "idle"):
            tt.add_column(col, justify="right")
        for _, r in a.rank_summary.iterrows():
            tt.add_row(str(r["rank"]) + (" (slowest)" if r["slowest"] and len(a.ranks) > 1 else ""),
                       _ms(r["step_time_s"]), _ms(r["compute_s"]), _ms(r["exposed_comm_s"]),
                       _ms(r["exposed_memcpy_s"]), _ms(r["idle_s"]))
        console.print(tt)
    th = Table(title=f"hotspots (top {top}, per step)")
    for col in ("category", "op", "shape", "calls", "ms", "share", "TFLOP/s", "% roofline"):
        th.add_column(col, justify="right" if col in ("calls", "ms", "share", "TFLOP/s", "% roofline") else "left",
                      overflow="fold")
    for _, r in a.hotspots.head(top).iterrows():
        th.add_row(r["category"], r["op"], r["shape"], _num(r["calls"], "{:g}"), _ms(r["time_s"]),
                   _pct(r["share"]), _num(r["tflops"]), _pct(r["pct_roofline"]))
    console.print(th)
    for title, df in (("GEMM problems", a.gemm_problems), ("grouped GEMM problems", a.grouped_gemm_problems),
                      ("attention problems", a.attention_problems)):
        if df.empty:
            continue
        tp = Table(title=f"{title} (per step)")
        for col in ("problem", "dir", "calls", "ms", "TFLOP/s", "TB/s", "% roofline"):
            tp.add_column(col, justify="left" if col in ("problem", "dir") else "right")
        for _, r in df.head(top).iterrows():
            tp.add_row(r["label"], r["direction"], _num(r["calls"], "{:g}"), _ms(r["time_s"]),
                       _num(r["tflops"]), _num(r["tb_s"], "{:.2f}"), _pct(r["pct_roofline"]))
        console.print(tp)
    if len(a.collectives):
        tc = Table(title="collectives across ranks")
        for col in ("kernel", "calls", "mean skew us", "max skew us", "mean dur us", "last to start"):
            tc.add_column(col, justify="left" if col == "kernel" else "right", overflow="fold")
        for _, r in a.collectives.head(top).iterrows():
            tc.add_row(r["name"][:80], str(r["calls"]), _num(r["mean_skew_us"]), _num(r["max_skew_us"]),
                       _num(r["mean_dur_us"]), f"rank {r['last_rank']}")
        console.print(tc)
    for note in a.notes:
        err_console.print(f"[yellow]note:[/] {note}")


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    def analyze_cmd(
        traces: list[Path] = typer.Argument(..., help="Trace files (.json/.json.gz, one per rank) or run directories."),
        json_out: str | None = typer.Option(None, "--json", help=JSON_HELP + " The tables are not printed with -."),
        top: int = typer.Option(20, "--top", min=TOP_MIN, help="Rows of the hotspot and problem tables."),
        jobs: int | None = typer.Option(None, "-j", "--jobs", min=1,
                                        help="Processes for the traces of many ranks (default: one per trace, "
                                             "at most one per CPU)."),
    ) -> None:
        """Breakdown, hotspots and GEMM, grouped GEMM and attention problems of one or more traces."""
        a = _run(traces, jobs)
        if json_out is not None:
            write_output(json_out, json.dumps(a.to_json(top=max(top, 50)), indent=1))
            if json_out == "-":
                return
        render(a, top)
        if json_out is not None:
            console.print(f"wrote {json_out}")

    @app.command("shapes")
    def shapes_cmd(
        traces: list[Path] = typer.Argument(..., help="Trace files or run directories."),
        output: Path = typer.Option(Path("problems.json"), "-o", "--output", help="Problems file to write."),
    ) -> None:
        """Write the unique GEMM, grouped GEMM and attention problems of traces for the tuners."""
        a = _run(traces)
        path = write_problems(a, output)
        grouped = f"{len(a.grouped_gemm_problems)} grouped GEMM, " if len(a.grouped_gemm_problems) else ""
        console.print(f"wrote {path}: {len(a.gemm_problems)} GEMM, {grouped}"
                      f"{a.attention_problems['key'].nunique() if len(a.attention_problems) else 0} attention problems "
                      f"from {len(a.traces)} trace(s)")
        for note in a.notes:
            err_console.print(f"[yellow]note:[/] {note}")
