"""``primus-tune cache show|merge|export``."""

from __future__ import annotations

import typer

from primus_perf.cli.common import console


def register(app: typer.Typer) -> None:
    @app.command("show")
    def show_cmd(path: str = typer.Argument(..., help="Cache file")) -> None:
        """List the entries of a tuning cache."""
        from pathlib import Path

        from rich.table import Table

        from primus_perf.cache.store import TuningCache
        from primus_perf.errors import CacheError

        if not Path(path).exists():
            raise CacheError(f"cache file not found: {path}")
        table = Table("kind", "problem", "device", "versions", "choice", "speedup")
        for e in TuningCache(path).entries():
            t, d = e.times.get("tuned_ms"), e.times.get("default_ms")
            cfg = e.solution.get("config") or {}
            table.add_row(e.kind, e.problem_key, e.device.get("name", "?"),
                          ",".join(f"{k}={v}" for k, v in e.versions.items()),
                          str(cfg.get("name", cfg.get("backend", ""))), f"{d / t:.3f}x" if t and d else "-")
        console.print(table)

    @app.command("merge")
    def merge_cmd(
        target: str = typer.Argument(..., help="Cache file to merge into"),
        sources: list[str] = typer.Argument(..., help="Cache files to merge from"),
    ) -> None:
        """Merge other cache files into one (newest entry wins per problem/device/library)."""
        from primus_perf.cache.store import TuningCache

        n = TuningCache(target).merge_from(*sources)
        console.print(f"{target}: merged {n} entries")

    @app.command("export")
    def export_cmd(
        path: str = typer.Argument(..., help="Cache file"),
        fmt: str = typer.Option(..., "--format", help="tunableop | hipblaslt"),
        out: str = typer.Option(..., "--out", help="File to write"),
        torch_version: str = typer.Option(
            "", "--torch-version",
            help="tunableop: the torch release that reads the file, e.g. 2.14.0 (its PT_VERSION must match;"
                 " cuBLASLt choices are read by releases after 2.13, hipBLASLt ones and Default by all)"),
    ) -> None:
        """Export the entries that map to TunableOp's results CSV or a hipBLASLt override file."""
        from pathlib import Path

        from primus_perf.cache.export import export
        from primus_perf.cache.store import TuningCache
        from primus_perf.errors import CacheError

        if not Path(path).exists():
            raise CacheError(f"cache file not found: {path}")
        n, skipped = export(TuningCache(path).entries(), fmt, out, torch_version)
        console.print(f"{out}: {n} rows ({skipped} GEMM entries have no {fmt} spelling)")
