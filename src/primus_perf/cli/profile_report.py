"""``primus-profile report`` and ``compare``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from primus_perf.base.files import write_output
from primus_perf.cli.common import JSON_HELP, TOP_MIN, console, err_console
from primus_perf.cli.render import new_table, print_table, signed_pct
from primus_perf.tracelens.compare import compare
from primus_perf.tracelens.report import build_report
from primus_perf.tracelens.report_html import to_json_text, write_html, write_report_json


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report_cmd(
        traces: list[Path] = typer.Argument(..., help="Trace files (one per rank) or a run directory."),
        output: Path = typer.Option(Path("report.html"), "-o", "--output", help="HTML file to write."),
        json_out: str | None = typer.Option(None, "--json", help="Also write the report data as JSON to this file (- for stdout)."),
        cache: Path | None = typer.Option(None, "--cache", help="Tuning cache: mark problems tuned/untuned."),
        title: str | None = typer.Option(None, "--title", help="Report title."),
    ) -> None:
        """Self-contained HTML report of one or more traces."""
        data = build_report([str(t) for t in traces], cache=cache, title=title)
        path = write_html(data, output)
        if json_out == "-":
            write_output("-", to_json_text(data, indent=1))
        elif json_out is not None:
            write_report_json(data, json_out)
        h = data["header"]
        gemm, attention = ({r["key"] for r in data[k]} for k in ("gemm", "attention"))  # problems, as tune counts
        console.print(
            f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB): {h['device']}, "
            f"{len(h['ranks'])} rank(s), {h['steps']} step(s), {len(data['hotspots'])} hotspots, "
            f"{len(gemm)} GEMM and {len(attention)} attention problems"
            f" ({len(data['gemm'])} and {len(data['attention'])} rows by pass)"
        )
        for note in data["notes"]:
            err_console.print(f"[yellow]note:[/] {note}")

    @app.command("compare")
    def compare_cmd(
        base: Path = typer.Argument(..., help="Base trace file or run directory."),
        candidate: Path = typer.Argument(..., help="Candidate trace file or run directory."),
        output: Path | None = typer.Option(None, "-o", "--output", help="Write an HTML diff here."),
        json_out: str | None = typer.Option(None, "--json", help=JSON_HELP + " The tables are not printed with -."),
        top: int = typer.Option(15, "--top", min=TOP_MIN, help="Op deltas to print."),
    ) -> None:
        """Compare two traces or two runs."""
        data = compare(str(base), str(candidate))
        if output is not None:
            write_html(data, output)
        if json_out is not None:
            write_output(json_out, json.dumps(data))
            if json_out == "-":
                return
        console.print(f"[bold]{data['verdict']}[/]")
        table = new_table("breakdown (ms per step)", ("category", "base", "candidate", "delta", "change"), {"category"})
        for r in data["breakdown"]:
            table.add_row(r["category"], f"{r['base_ms']:.3f}", f"{r['candidate_ms']:.3f}",
                          f"{r['delta_ms']:+.3f}", "–" if r["rel"] is None else signed_pct(r["rel"]))
        print_table(table)
        ops = new_table(f"largest op deltas (top {top}, ms per step)", ("family", "shape", "ops", "base", "candidate",
                        "delta", "present in"), {"family", "shape", "ops", "present in"})
        for r in sorted(data["ops"], key=lambda r: -abs(r["delta_ms"]))[:top]:
            names = dict.fromkeys(n for n in (r["base_op"], r["candidate_op"]) if n)
            ops.add_row(r["family"], r["shape"], " → ".join(names), f"{r['base_ms']:.3f}",
                        f"{r['candidate_ms']:.3f}", f"{r['delta_ms']:+.3f}", r["side"])
        print_table(ops)
        for note in data["warnings"]:
            if note not in data["verdict"]:
                err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
        if output is not None:
            console.print(f"wrote {output}")
