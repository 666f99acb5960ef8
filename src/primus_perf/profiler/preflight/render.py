"""The preflight report for people: a terminal table (rich), and JSON and HTML files
through the report code (``tracelens.report_html``: one page shell, one styling)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from primus_perf.profiler.preflight.checks import PreflightReport
from primus_perf.tracelens.report_html import write_html, write_report_json

STYLE = {"ok": "green", "fail": "bold red", "slow": "bold red", "info": "", "skipped": "dim"}


def preflight_table(report: PreflightReport) -> Table:
    table = Table(title=f"preflight (peers: flagged below {report.threshold:.0%} of the median)")
    for col in ("check", "subject", "value", "expected", "peer median", "status", "why"):
        table.add_column(col, justify="right" if col in ("value", "expected", "peer median") else "left")
    for c in report.checks:
        row = c.to_dict()
        style = STYLE[c.status]
        table.add_row(row["name"], row["subject"], row["value_text"], row["expected_text"], row["peer_text"],
                      f"[{style}]{c.status}[/]" if style else c.status, row["reason"])
    return table


def write_json(report: PreflightReport, path: str | Path) -> Path:
    return write_report_json(report.to_dict(), path)


def write_page(report: PreflightReport, path: str | Path) -> Path:
    return write_html(report.to_dict(), path)
