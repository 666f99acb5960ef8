"""``primus-profile analyze`` and ``shapes``: explain a trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from primus_perf import kinds
from primus_perf.base.files import write_output
from primus_perf.cli.common import JSON_HELP, TOP_MIN, console, err_console
from primus_perf.cli.render import new_table, print_table
from primus_perf.tracelens.analyses.expert_load import summary_line
from primus_perf.tracelens.analyses.workload import summary as workload_summary
from primus_perf.tracelens.analyze import Analysis, analyze
from primus_perf.tracelens.export import write_csv, write_xlsx
from primus_perf.tracelens.report import measured_line, next_steps, sync_sites
from primus_perf.tracelens.shapes import write_problems

GROUPED = kinds.GROUPED


def _ms(v: Any) -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v) * 1e3:.3f}"


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)


def _rate(v: Any) -> str:
    """TFLOP/s: one decimal, three significant digits below 1 (a CPU run's rates)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.1f}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"


def _pct(v: Any) -> str:
    return _num(v * 100 if v is not None else None, "{:.1f}%")


def _run(traces: list[Path], jobs: int | None = None) -> Analysis:
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


def _step(a: Analysis) -> str:
    """The step time: the GPU step's; without GPU events, the wall clock's and where it comes
    from (:meth:`Analysis.wall_step`)."""
    if a.totals["step_time_s"] is not None:
        return f"step {_ms(a.totals['step_time_s'])} ms"
    wall, source = a.wall_step()
    return f"step {_ms(wall)} ms" + (f" wall clock ({source})" if wall is not None else "")


def _busy(a: Analysis) -> str:
    """GPU busy time; for a trace without GPU events, the CPU time of its modeled ops."""
    if len(a.kernels):
        return f"GPU busy {_ms(a.totals['gpu_busy_s_per_step'])} ms/step"
    cpu = sum(float(df["time_s"].sum()) for df in a.problem_tables().values() if len(df))
    return f"no GPU events: CPU time of GEMM, grouped GEMM and attention ops {_ms(cpu)} ms/step"


def _flagged(pct: Any, note: Any) -> str:
    """A fraction of the roofline, marked ``*`` where it carries a caveat (``roofline_note``)."""
    return _pct(pct) + ("*" if isinstance(note, str) and note else "")


def _print_flags(df: Any) -> None:
    """The caveats of the rows marked ``*`` in a table, once each."""
    notes = [n for n in dict.fromkeys(df["roofline_note"]) if isinstance(n, str) and n] if len(df) else []
    for note in notes:
        console.print(f"* {note}", highlight=False, soft_wrap=True)


def render(a: Analysis, top: int) -> None:
    """Rich tables of an analysis: header, breakdowns, hotspots, problems, ranks."""
    t = a.totals
    console.print(
        f"[bold]{a.device['name']}[/] · {len(a.ranks)} rank(s) · {a.n_steps} step(s) · "
        f"{_step(a)} · {_busy(a)} · GEMM {_tflop(t['gemm_flops_per_step'])} · "
        + (f"grouped GEMM {_tflop(t[GROUPED.name + '_flops_per_step'])} · " if len(a.problems_by_kind[GROUPED.name]) else "")
        + f"attention {_tflop(t['attention_flops_per_step'])}"
    )
    if a.workload:
        console.print(f"workload: {workload_summary(a.workload)}", highlight=False, soft_wrap=True)
    cat = a.category_seconds()
    total = float(cat.sum()) or 1.0
    if not len(cat) and a.hotspots.empty:
        console.print("no GPU events: the GPU time and hotspot tables are left out; the problem tables below hold"
                      " the ops' CPU times", highlight=False, soft_wrap=True)
    tb = new_table("GPU time by category (ms per step)", ("category", "ms", "share"), {"category"})
    for name, sec in cat.items():
        tb.add_row(str(name), _ms(sec), _pct(sec / total))
    if len(cat):
        print_table(tb)
    if len(a.temporal):
        tt = new_table("step time (median ms over steps)",
                       ("rank", "step", "compute", "exposed comm", "exposed memcpy", "idle"))
        for _, r in a.rank_summary.iterrows():
            tt.add_row(str(r["rank"]) + (" (slowest)" if r["slowest"] and len(a.ranks) > 1 else ""),
                       _ms(r["step_time_s"]), _ms(r["compute_s"]), _ms(r["exposed_comm_s"]),
                       _ms(r["exposed_memcpy_s"]), _ms(r["idle_s"]))
        print_table(tt)
    th = new_table(f"hotspots (top {top}, per step)", ("category", "op", "shape", "calls", "ms", "share", "TFLOP/s",
                   "% roofline"), {"category", "op", "shape"}, overflow="fold")
    for _, r in a.hotspots.head(top).iterrows():
        th.add_row(r["category"], r["op"], r["shape"], _num(r["calls"], "{:g}"), _ms(r["time_s"]),
                   _pct(r["share"]), _rate(r["tflops"]), _flagged(r["pct_roofline"], r["roofline_note"]))
    if not a.hotspots.empty:
        print_table(th)
        _print_flags(a.hotspots.head(top))
    for title, df in ((f"{kind.title} problems", a.problems_by_kind[kind.name]) for kind in kinds.all_kinds()):
        if df.empty:
            continue
        tp = new_table(f"{title} (per step)", ("problem", "dir", "calls", "ms", "TFLOP/s", "TB/s", "% roofline"),
                       {"problem", "dir"})
        for _, r in df.head(top).iterrows():
            tp.add_row(r["label"], r["direction"], _num(r["calls"], "{:g}"), _ms(r["time_s"]),
                       _rate(r["tflops"]), _num(r["tb_s"], "{:.2f}"), _flagged(r["pct_roofline"], r["roofline_note"]))
        print_table(tp)
        _print_flags(df.head(top))
    if len(a.collectives):
        tc = new_table("collectives across ranks", ("kernel", "calls", "mean skew us", "max skew us", "mean dur us",
                       "last to start"), {"kernel"}, overflow="fold")
        for _, r in a.collectives.head(top).iterrows():
            tc.add_row(r["name"], str(r["calls"]), _num(r["mean_skew_us"]), _num(r["max_skew_us"]),
                       _num(r["mean_dur_us"]), f"rank {r['last_rank']}")
        print_table(tc)
    render_bandwidth(a, top)
    load = summary_line(a.expert_load)
    if load:
        console.print(load, highlight=False, soft_wrap=True)
    render_host(a, top)
    render_kernel_efficiency(a, top)
    render_memory(a, top)
    render_recommendations(a)
    for note in a.notes:
        err_console.print(f"[yellow]note:[/] {note}")


ALL_TO_ALLS = ("all_to_all", "all_to_allv", "dispatch", "combine")
MAX_RANK_ROWS = 64  # all-to-all rows per rank printed (the JSON and the report hold them all)
GBS = "{:.3g}"  # bandwidths: a small all-to-all moves well under 1 GB/s


def _bytes(v: Any) -> str:
    """Bytes in powers of 1024, 3 significant digits."""
    if v is None or (isinstance(v, float) and math.isnan(v)) or v < 0:
        return "–"
    x, unit = float(v), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            break
        x /= 1024
    return f"{x:.0f} {unit}" if unit == "B" or x >= 100 else f"{x:.3g} {unit}"


def render_bandwidth(a: Analysis, top: int) -> None:
    """Collective bandwidth per (collective, size), and all-to-all time, bytes and bandwidth
    per rank."""
    if len(a.collective_bandwidth):
        tb = new_table("collective bandwidth (per step; all_to_allv: mean message of its calls)", ("collective",
                       "message", "group", "calls", "ms", "algbw GB/s", "busbw GB/s", "busbw range"), {"collective"})
        for _, r in a.collective_bandwidth.head(top).iterrows():
            spread = f"{_num(r['min_busbw_gbs'], GBS)}-{_num(r['max_busbw_gbs'], GBS)}" if r["ranks"] > 1 else "–"
            tb.add_row(r["collective"], _bytes(r["bytes"]), _num(r["group_size"], "{:d}") if r["group_size"] > 0
                       else "–", _num(r["calls"], "{:g}"), _ms(r["time_s"]), _num(r["algbw_gbs"], GBS),
                       _num(r["busbw_gbs"], GBS), spread)
        print_table(tb)
    ranks = a.collective_ranks[a.collective_ranks["collective"].isin(ALL_TO_ALLS)] if len(a.collective_ranks) else []
    if len(ranks):
        tr = new_table("all-to-all per rank (per step)", ("collective", "rank", "calls", "ms", "bytes", "sent",
                       "received", "algbw GB/s", "busbw GB/s"), {"collective"})
        for _, r in ranks.head(MAX_RANK_ROWS).iterrows():
            tr.add_row(r["collective"], str(r["rank"]), _num(r["calls"], "{:g}"), _ms(r["time_s"]), _bytes(r["bytes"]),
                       _bytes(r["in_bytes"]), _bytes(r["out_bytes"]), _num(r["algbw_gbs"], GBS),
                       _num(r["busbw_gbs"], GBS))
        print_table(tr)
        if len(ranks) > MAX_RANK_ROWS:
            console.print(f"{len(ranks) - MAX_RANK_ROWS} more all-to-all rows per rank in --json and the report")


def render_recommendations(a: Analysis) -> None:
    """What to do next (``report.next_steps``, what the HTML report shows): one block per
    recommendation, ranked (long lines wrap in a log); the step tuner's measurements of levers
    no recommendation names; why there is no recommendation, when there is none."""
    nxt = next_steps(a)
    console.print("[bold]what to do next[/]" + (" (ranked by estimated saving per step; FP8 last: it changes the "
                                                 "numerics)" if nxt["rows"] else ""))
    for i, r in enumerate(nxt["rows"], 1):
        against = "" if r["measured_against"] in (None, "the default") else f" against {r['measured_against']}"
        measured = (f" (measured by the step tuner: {r['measured_saving_ms']:.2f} ms{against})"
                    if r["measured_saving_ms"] is not None else "")
        console.print(f"{i}. [bold]{r['category']}[/]: save ~{r['estimated_saving_ms']:.2f} ms per step{measured}",
                      highlight=False)
        lines = [("evidence", r["evidence"]), ("because", r["condition"]), ("do", r["action"]), ("run", r["command"]),
                 ("estimate", r["method"])]
        for label, text in lines:
            if text:
                console.print(f"   {label}: {escape(text)}", highlight=False, soft_wrap=True)
    if nxt["note"]:
        console.print(nxt["note"], highlight=False, soft_wrap=True)
    if nxt["measured"]:
        console.print("measured by the step tuner (step_plan.json), levers not estimated here:", highlight=False)
        for m in nxt["measured"]:
            console.print(f"   {escape(measured_line(m))}", highlight=False, soft_wrap=True)


def render_host(a: Analysis, top: int) -> None:
    """Each step's critical path, launch statistics and CPU against GPU time per op."""
    if len(a.critical_path):
        tc = new_table("critical path per step (ms: the step's host start to its last GPU event)",
                       ("rank", "step", "path", "cpu", "launch delay", "gpu", "wait", "GPU events on path"))
        for r in a.critical_path.head(MAX_RANK_ROWS).to_dict(orient="records"):
            tc.add_row(str(int(r["rank"])), str(int(r["step"])), _ms(r["path_s"]), _ms(r["cpu_s"]), _ms(r["launch_s"]),
                       _ms(r["gpu_s"]), _ms(r["wait_s"]), str(int(r["events"])))
        print_table(tc)
    if len(a.launches):
        tl = new_table("kernel launches per step (delay: launch call start to GPU start, ms; queue: GPU work "
                       "launched, not finished)", ("rank", "step", "launches", "call p50 us", "delay p50", "delay p90",
                                                   "delay max", "queue p50", "queue max"))
        for r in a.launches.head(MAX_RANK_ROWS).to_dict(orient="records"):
            tl.add_row(str(int(r["rank"])), str(int(r["step"])), str(int(r["launches"])), _num(r["launch_p50_us"]),
                       *(_num(r[c] / 1e3, "{:.2f}") for c in ("delay_p50_us", "delay_p90_us", "delay_max_us")),
                       _num(r["queue_p50"], "{:.0f}"), _num(r["queue_max"], "{:.0f}"))
        print_table(tl)
    sites = sync_sites(a)
    if sites:
        ts = new_table("synchronizing calls per step (the host waits for the GPU; ms: its wait, the GPU idle after)",
                       ("call site", "runtime call", "calls", "host wait", "GPU idle after"),
                       {"call site", "runtime call"}, overflow="fold")
        for r in sites[:top]:
            ts.add_row(escape(r["site"]), r["call"], _num(r["calls"], "{:.3g}"), _num(r["wait_ms"], "{:.2f}"),
                       _num(r["idle_after_ms"], "{:.2f}"))
        print_table(ts)
    if len(a.cpu_ops):
        to = new_table(f"CPU against GPU time per op (top {top} by CPU time, ms per step)",
                       ("op", "calls", "CPU", "CPU self", "GPU self", "GPU incl."), {"op"}, overflow="fold")
        for _, r in a.cpu_ops.head(top).iterrows():
            to.add_row(escape(str(r["op"])), _num(r["calls"], "{:g}"), _ms(r["cpu_s"]), _ms(r["cpu_self_s"]),
                       _ms(r["gpu_self_s"]), _ms(r["gpu_s"]))
        print_table(to)


def render_kernel_efficiency(a: Analysis, top: int) -> None:
    """Per kernel name: launch resources and occupancy, flagged where low and costly."""
    eff = a.kernel_efficiency()
    if eff.empty:
        return
    tk = new_table(f"kernel efficiency (top {top} by time, per step; occupancy as Kineto estimates it; "
                   "full names and grid/block in --json and the report)",
                   ("kernel", "calls", "ms", "regs", "smem KiB", "blk/SM", "occ.", "flag"), {"kernel", "flag"},
                   overflow="fold")
    for _, r in eff.head(top).iterrows():
        tk.add_row(str(r["name"]), _num(r["launches"], "{:g}"), _num(r["time_s"] * 1e3, "{:.2f}"),
                   _num(r["registers"], "{:.0f}"), _num(r["shared_bytes"] / 1024, "{:.1f}"),
                   _num(r["blocks_per_sm"], "{:.2f}"), _num(r["occupancy_pct"], "{:.0f}%"), r["flag"])
    print_table(tk)


def render_memory(a: Analysis, top: int) -> None:
    """Peak allocated memory per device and the ops that allocate most (profile_memory traces)."""
    _curve, peaks, by_op = a.memory()
    if peaks.empty:
        return
    tp = new_table("memory (profile_memory): peak allocated per device",
                   ("rank", "device", "peak", "allocations", "frees"), {"device"})
    for _, r in peaks.iterrows():
        rel = "" if r["recorded_total"] else " (relative)"
        tp.add_row(str(int(r["rank"])), r["device"], _bytes(r["peak_bytes"]) + rel, str(int(r["allocations"])),
                   str(int(r["frees"])))
    print_table(tp)
    tb = new_table(f"allocations per op (top {top} by bytes, whole trace)", ("op", "allocations", "bytes", "largest"),
                   {"op"}, overflow="fold")
    for _, r in by_op.head(top).iterrows():
        tb.add_row(escape(str(r["op"])), str(int(r["allocations"])), _bytes(r["bytes"]), _bytes(r["largest"]))
    print_table(tb)


def register(app: typer.Typer) -> None:
    @app.command("analyze")
    def analyze_cmd(
        traces: list[Path] = typer.Argument(..., help="Trace files (.json/.json.gz, one per rank) or run directories."),
        json_out: str | None = typer.Option(None, "--json", help=JSON_HELP + " The tables are not printed with -."),
        top: int = typer.Option(20, "--top", min=TOP_MIN, help="Rows of the hotspot and problem tables."),
        jobs: int | None = typer.Option(None, "-j", "--jobs", min=1,
                                        help="Processes for the traces of many ranks (default: one per trace, "
                                             "at most one per CPU)."),
        csv_dir: Path | None = typer.Option(None, "--csv", help="Also write every table as DIR/NAME.csv."),
        xlsx: Path | None = typer.Option(None, "--xlsx", help="Also write every table to one Excel workbook "
                                         "(a sheet per table; needs openpyxl)."),
    ) -> None:
        """Breakdown, hotspots and GEMM, grouped GEMM and attention problems of one or more traces."""
        a = _run(traces, jobs)
        exported = []
        if csv_dir is not None:
            exported.append(f"{len(write_csv(a, csv_dir))} tables as CSV in {csv_dir}")
        if xlsx is not None:
            exported.append(str(write_xlsx(a, xlsx)))
        if json_out is not None:
            write_output(json_out, json.dumps(a.to_json(top=max(top, 50), details=True), indent=1))
            if json_out == "-":
                return
        render(a, top)
        if json_out is not None:
            console.print(f"wrote {json_out}")
        for path in exported:
            console.print(f"wrote {path}")

    @app.command("shapes")
    def shapes_cmd(
        traces: list[Path] = typer.Argument(..., help="Trace files or run directories."),
        output: Path = typer.Option(Path("problems.json"), "-o", "--output", help="Problems file to write."),
    ) -> None:
        """Write the unique GEMM, grouped GEMM and attention problems of traces for the tuners."""
        a = _run(traces)
        path = write_problems(a, output)
        n_grouped = len(a.problems_by_kind[GROUPED.name])
        grouped = f"{n_grouped} grouped GEMM, " if n_grouped else ""
        console.print(f"wrote {path}: {len(a.gemm_problems)} GEMM, {grouped}"
                      f"{a.attention_problems['key'].nunique() if len(a.attention_problems) else 0} attention problems "
                      f"from {len(a.traces)} trace(s)")
        for note in a.notes:
            err_console.print(f"[yellow]note:[/] {note}")
