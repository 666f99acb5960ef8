"""``primus-tune confirm``: a cache's choices A/B timed against the baseline inside real
steps (``tuner.confirm``), the cache corrected, one table row per problem."""

from __future__ import annotations

from typing import Optional

import typer
from rich.markup import escape
from rich.table import Column, Table

from primus_perf.base.entry import EXIT_INTERRUPTED
from primus_perf.base.errors import UserError
from primus_perf.cli.common import console, log_line
from primus_perf.cli.render import print_table
from primus_perf.tuner.decide import MARGIN


def confirm_table(run) -> Table:
    """Per problem: the claim the entry had, the in-step figure with its spread, the verdict."""
    table = Table("kind", Column("problem", no_wrap=True), "choice", "before (how measured)",
                  *(Column(h, justify="right") for h in (escape("in the step [q1-q3]"), "calls", "us saved a call")),
                  "verdict")
    for row in run.rows:
        v = row.verdict
        before = row.before.claim() if row.before is not None else "-"
        figure = f"{v.speedup:.3f}x [{v.low:.3f}-{v.high:.3f}]" if v.speedup is not None else \
            f"{v.pairs} of {v.wanted} pairs"
        verdict = {"kept": "kept", "dropped": f"dropped: {v.baseline} kept" + (" (routing costs more)" if v.reason
                                                                              else "")}.get(v.status, "unconfirmed (too few)")
        saved = f"{v.saving_us:.1f}" if v.saving_us is not None else "-"
        table.add_row(v.kind, escape(row.problem), escape(v.choice), escape(before), escape(figure), str(2 * v.pairs),
                      saved, escape(verdict))
    return table


def print_confirmation(run) -> None:
    print_table(confirm_table(run))
    line = (f"confirmed in the step: {run.count('kept')} kept, {run.count('dropped')} dropped (the baseline"
            f" runs them), {run.count('unconfirmed')} unconfirmed; written to {run.cache}")
    if run.unseen:
        line += f"; {run.unseen} cached problems not confirmed (not called, or torch's own choice)"
    console.print(line, highlight=False, soft_wrap=True)
    for reason in dict.fromkeys(r.verdict.reason for r in run.rows if r.verdict.reason):
        console.print(f"dropped: {reason}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("confirm")
    def confirm_cmd(
        args: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="Config overrides key=value (with --config), or the program to run after --"),
        cache: str = typer.Option(..., "--cache", help="Tuning cache to confirm (corrected in place)"),
        config: Optional[str] = typer.Option(None, "--config", "-c",  # noqa: UP045
                                             help="Preset name or YAML path of the trainer run"),
        steps: int = typer.Option(30, "--steps", min=2, help="With --config: training steps at most (it stops"
                                  " once every problem has its verdict)"),
        samples: int = typer.Option(8, "--samples", min=2, help="Counted pairs (one call of each side) per problem"),
        warmup: int = typer.Option(2, "--warmup", min=0, help="Pairs per problem not counted (cold first calls)"),
        margin: float = typer.Option(MARGIN, "--margin", min=0.0, help="Least in-step gain that keeps a choice,"
                                     " when the measured noise (half the ratios' IQR) is smaller"),
        blocks: int = typer.Option(4, "--blocks", min=2, help="The final check: blocks of steps a side, the cache"
                                   " on and off interleaved"),
        block_steps: int = typer.Option(5, "--block-steps", min=1, help="The final check: timed steps a block"),
    ) -> None:
        """Confirm a cache's choices inside real steps: each routed problem runs its cached
        choice and the baseline (torch's kernel; the caller's grouped backend) on
        alternating calls, timed where they run; a choice is kept only when its in-step gain
        clears the noise, else the cache entry becomes the baseline. Then the final check: the
        step with the cache against the step without it, interleaved blocks; a cache that does
        not win it past the noise loses the kinds that do not win it alone. The trainer
        (--config PRESET [overrides] --steps N) or any program (-- script.py args) runs."""
        from primus_perf.cli.tune_cache import open_cache
        from primus_perf.tuner.confirm import ConfirmPolicy

        open_cache(cache)  # a regular, non-empty file
        policy = ConfirmPolicy(samples=samples, warmup=warmup, margin=margin)
        extra = list(args or ())

        if config is not None:
            from primus_perf.tuner.cache_check import check_cache, confirm_trainer

            run = confirm_trainer(config, extra, cache, steps=steps, policy=policy)
            print_confirmation(run)
            if run.interrupted:
                raise typer.Exit(EXIT_INTERRUPTED)
            final, _ = check_cache(config, extra, cache, blocks=blocks, block_steps=block_steps, log=log_line)
            print_final(final)
            return
        if not extra:
            raise UserError("primus-tune confirm needs a run: --config PRESET [overrides], or a program after --,"
                            " e.g. primus-tune confirm --cache c.json -- train.py")
        from primus_perf.tuner.cache_check import confirm_program

        done = confirm_program(cache, extra, policy=policy, blocks=blocks, block_steps=block_steps, log=log_line)
        run = done.confirmation
        print_confirmation(run)
        if done.final is not None:
            print_final(done.final)
        else:
            console.print(f"final check: not run ({done.unchecked}); the confirmed choices stand", highlight=False,
                          soft_wrap=True)
        if run.interrupted:
            raise typer.Exit(EXIT_INTERRUPTED)
        if run.exit_code:
            raise typer.Exit(run.exit_code)


def print_final(final) -> None:
    """The final check's outcome: what it dropped, the figure of the cache left behind."""
    for line in final.lines():
        bold = line.startswith("speedup with the cache")
        console.print(f"[bold]{escape(line)}[/]" if bold else escape(line), highlight=False, soft_wrap=True)
