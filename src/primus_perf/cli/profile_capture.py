"""``primus-profile run``: train under torch.profiler."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import typer

from primus_perf.base.errors import UserError
from primus_perf.cli.common import console
from primus_perf.tracelens.inputs import MANIFEST


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run_cmd(
        overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="Config overrides key=value, e.g. train.micro_batch=2 parallel.tp=2; or, after --, your"
                       " own script and its arguments: -- train.py --lr 3e-4 (or -- -m module args)"
        ),
        config: Optional[str] = typer.Option(None, "--config", "-c",  # noqa: UP045
                                             help="Preset name or YAML path (default: tiny)"),
        layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Override model.n_layers"),  # noqa: UP045
        steps: int = typer.Option(3, "--steps", min=1, help="Profiled (recorded) steps"),
        warmup: int = typer.Option(1, "--warmup", min=0, help="Profiler warm-up steps before recording"),
        wait: int = typer.Option(2, "--wait", min=0, help="Steps with the profiler started but not recording"),
        baseline: int = typer.Option(3, "--baseline", min=0, help="Unprofiled steps before the profiler"),
        after: int = typer.Option(3, "--after", min=0, help="Unprofiled steps after the profiler"),
        out: Path = typer.Option(Path("runs/profile"), "--output", "-o", "--out", help="Run directory to write"),
        ranks: Optional[str] = typer.Option(None, "--ranks", help="Ranks to trace, e.g. 0,3 (default: all)"),  # noqa: UP045
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in a non-empty -o folder"),
        stop: bool = typer.Option(False, "--stop", help="Your script: end it once the window and --after steps are"
                                  " marked (a long training run profiled without running it to its end)"),
    ) -> None:
        """Train under torch.profiler: one gzipped trace per rank plus manifest.json
        (works under torchrun). Analyze with `primus-profile analyze DIR`. -o must be
        empty (or --overwrite). Ctrl-C keeps the steps already recorded.

        The reference trainer (--config PRESET [overrides]), or your own script after --
        (primus-profile run -- train.py args): its steps end at each optimizer.step() of its
        first optimizer, or at each primus_perf.profile_step() it calls; the same window
        and run folder."""
        from primus_perf.profiler.capture import Schedule

        extra = list(overrides or [])
        sched = Schedule(active=steps, warmup=warmup, wait=wait, baseline=baseline, after=after)

        def show(rec: dict) -> None:
            loss = f"  loss {rec['loss']:.4f}" if rec.get("loss") is not None else ""
            console.print(f"step {rec['index'] + 1:>3}  {rec['phase']:<8} {rec['time_s'] * 1e3:9.1f} ms{loss}",
                          highlight=False)

        if extra and is_program(extra):
            from primus_perf.profiler.program import capture_program

            if config is not None or layers is not None:
                raise UserError("--config and --layers are the reference trainer's; a script after -- is run as it is")
            res = capture_program(extra, out, sched, ranks=ranks, on_step=show, overwrite=overwrite, stop=stop)
        else:
            from primus_perf.profiler.capture import capture_trainer
            from primus_perf.tuner.online import InStepTuning

            if stop:
                raise UserError("--stop ends your script after its window; the trainer runs the steps it is given")

            if layers is not None:
                extra.append(f"model.n_layers={layers}")
            res = capture_trainer(config or "tiny", extra, out, sched, ranks=ranks, on_step=show, overwrite=overwrite,
                                  online=InStepTuning())
        m = res.manifest
        if not m:
            return  # not rank 0
        console.print(f"wrote {len(m['traced_ranks'])} trace(s) and {res.out_dir / MANIFEST}", highlight=False)
        console.print(overhead_line(m["steps"]), highlight=False, soft_wrap=True)


def is_program(args: list[str]) -> bool:
    """Whether positional arguments name a program (``script.py ...``, ``-m module``) rather
    than config overrides (``key=value``)."""
    return args[0] == "-m" or args[0].endswith(".py") or ("=" not in args[0] and Path(args[0]).is_file())


MIN_STEPS = 2  # steps on each side before an overhead is claimed


def _ms_range(times: list[float]) -> str:
    return f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms"


def overhead_line(steps: list[dict]) -> str:
    """The profiler's overhead on the recorded steps and on those outside the window,
    against the unprofiled steps, with each group's spread; a difference within the
    step-to-step spread (the ranges overlap), from fewer than :data:`MIN_STEPS` steps a
    side, or with the profiled steps faster (no overhead is negative: the steps moved for
    another reason) is reported as not measurable."""
    def times(*phases: str) -> list[float]:
        return [s["time_s"] for s in steps if s["phase"] in phases]

    base = times("baseline")[1:] or times("baseline")
    parts = []
    for label, group in (("recorded steps", times("active")), ("steps outside the window", times("wait", "after"))):
        if len(base) < MIN_STEPS or len(group) < MIN_STEPS:
            parts.append(f"{label}: not measured (fewer than {MIN_STEPS} steps to compare)")
            continue
        spread = f"({_ms_range(group)} vs unprofiled {_ms_range(base)})"
        if min(group) > max(base):
            change = statistics.median(group) / statistics.median(base) - 1
            parts.append(f"{label} {change * 100:+.1f}% {spread}")
        elif max(group) < min(base):
            parts.append(f"{label}: not measurable, faster than the unprofiled steps {spread}: they moved for"
                         " another reason (warm-up, clocks, load)")
        else:
            parts.append(f"{label}: not measurable, within the step-to-step spread {spread}")
    return "profiler overhead: " + "; ".join(parts)
