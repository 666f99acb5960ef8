"""``primus-tune cache show|merge|export``."""

from __future__ import annotations

import typer
from rich.markup import escape

from primus_perf.cli.common import console, err_console
from primus_perf.cli.render import print_table


def open_cache(path: str):
    """A cache named on the command line: it must be a regular, non-empty file; invalid or
    stale entries are reported as notes on stderr."""
    from primus_perf.cache.store import TuningCache, check_cache_file

    check_cache_file(path)
    return TuningCache(path, report_stale=note)


def note(message: str) -> None:
    err_console.print(f"[yellow]note:[/] {message}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("show")
    def show_cmd(path: str = typer.Argument(..., help="Cache file"),
                 keys: bool = typer.Option(False, "--keys", help="Add each entry's cache key")) -> None:
        """List the entries of a tuning cache (invalid entries are named and skipped), each
        problem by the label every command prints. Each speedup says how it was measured:
        "in the step" (confirmed against the baseline inside real steps, with the quartiles
        of the per-pair ratios), else "isolated" (offline tuning: each call alone) or
        "online samples"."""
        from rich.table import Table

        table = Table("kind", "problem", *(["key"] if keys else []), "device", "versions", "choice",
                      "speedup (how measured)")
        entries = open_cache(path).entries()
        for e in entries:
            cfg = e.solution.get("config") or {}
            table.add_row(e.kind, escape(e.label()), *([e.problem_key] if keys else []), str(e.device.get("name", "?")),
                          ",".join(f"{k}={v}" for k, v in e.versions.items()),
                          str(cfg.get("name", cfg.get("backend", ""))), escape(e.claim()))
        print_table(table)
        console.print(f"{len(entries)} entries", highlight=False)

    @app.command("merge")
    def merge_cmd(
        target: str = typer.Argument(..., help="Cache file to merge into (made when missing)"),
        sources: list[str] = typer.Argument(..., help="Cache files to merge from (each must exist)"),
    ) -> None:
        """Merge other cache files into one. Per problem, device and library versions the
        entry with the newest `created` time wins, across the target and the sources; on a
        tie the faster tuned time wins. Invalid entries are named and not carried."""
        from primus_perf.cache.store import TuningCache

        for source in sources:
            open_cache(source)  # each source exists and is a regular file
        n = TuningCache(target, report_stale=note).merge_from(*sources)
        console.print(f"{target}: took {n} entries from {len(sources)} file(s)", highlight=False)

    @app.command("export")
    def export_cmd(
        path: str = typer.Argument(..., help="Cache file"),
        fmt: str = typer.Option(..., "--format", help="tunableop | hipblaslt"),
        out: str = typer.Option(..., "--output", "-o", "--out", help="File to write"),
        torch_version: str = typer.Option(
            "", "--torch-version",
            help="tunableop: the torch release that reads the file, e.g. 2.14.0 (its PT_VERSION must match;"
                 " cuBLASLt choices are read by releases after 2.13, hipBLASLt ones and Default by all)."
                 " Default: the running torch, with the validators its TunableOp checks"),
    ) -> None:
        """Export the entries that map to TunableOp's results CSV or a hipBLASLt override file.
        TunableOp reads the file named by PYTORCH_TUNABLEOP_FILENAME (by default
        tunableop_results<GPU>.csv, e.g. tunableop_results0.csv) when PYTORCH_TUNABLEOP_ENABLED=1."""

        from primus_perf.base.files import check_writable
        from primus_perf.cache.export import export

        entries = open_cache(path).entries()
        check_writable(out)
        result = export(entries, fmt, out, torch_version)
        for key, why in result.skipped:
            note(f"{key}: skipped, {why}")
        console.print(f"{out}: {result.rows} rows" + (f"; {len(result.skipped)} GEMM entries skipped (notes above)"
                                                      if result.skipped else ""), highlight=False, soft_wrap=True)
