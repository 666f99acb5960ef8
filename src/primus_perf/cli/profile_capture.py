"""``primus-profile run``: train under torch.profiler."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from primus_perf.cli.common import console
from primus_perf.tracelens.inputs import MANIFEST


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="Config overrides key=value, e.g. train.micro_batch=2 parallel.tp=2"
        ),
        config: str = typer.Option("tiny", "--config", "-c", help="Preset name or YAML path"),
        layers: Optional[int] = typer.Option(None, "--layers", help="Override model.n_layers"),  # noqa: UP045
        steps: int = typer.Option(3, "--steps", help="Profiled (recorded) steps"),
        warmup: int = typer.Option(1, "--warmup", help="Profiler warm-up steps before recording"),
        wait: int = typer.Option(2, "--wait", help="Steps with the profiler started but not recording"),
        baseline: int = typer.Option(3, "--baseline", help="Unprofiled steps before the profiler"),
        after: int = typer.Option(3, "--after", help="Unprofiled steps after the profiler"),
        out: Path = typer.Option(Path("runs/profile"), "--out", "-o", help="Run directory to write"),
        ranks: Optional[str] = typer.Option(None, "--ranks", help="Ranks to trace, e.g. 0,3 (default: all)"),  # noqa: UP045
    ) -> None:
        """Train under torch.profiler: one gzipped trace per rank plus manifest.json
        (works under torchrun). Analyze with `primus-profile analyze DIR`."""
        from primus_perf.profiler.capture import Schedule, capture_trainer

        extra = list(overrides or [])
        if layers is not None:
            extra.append(f"model.n_layers={layers}")
        sched = Schedule(active=steps, warmup=warmup, wait=wait, baseline=baseline, after=after)

        def show(rec: dict) -> None:
            loss = f"  loss {rec['loss']:.4f}" if rec.get("loss") is not None else ""
            console.print(f"step {rec['index'] + 1:>3}  {rec['phase']:<8} {rec['time_s'] * 1e3:9.1f} ms{loss}",
                          highlight=False)

        res = capture_trainer(config, extra, out, sched, ranks=ranks, on_step=show)
        m = res.manifest
        if not m:
            return  # not rank 0
        o = m["overhead"]
        ratio = o.get("outside_window_vs_unprofiled")
        active = o.get("active_vs_unprofiled")
        console.print(
            f"wrote {len(m['traced_ranks'])} trace(s) and {res.out_dir / MANIFEST}; "
            f"profiler overhead: steps outside the recorded window "
            f"{'n/a' if ratio is None else f'{(ratio - 1) * 100:+.1f}%'}, recorded steps "
            f"{'n/a' if active is None else f'{(active - 1) * 100:+.1f}%'} vs unprofiled",
            highlight=False,
        )
