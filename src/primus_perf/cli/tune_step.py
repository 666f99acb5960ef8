"""``primus-tune step``: the whole training step searched at a fixed recipe
(``tuner.step.tune.tune_config``; a script: ``tuner.step.script.tune_program``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from primus_perf.base import environment
from primus_perf.base.errors import UserError
from primus_perf.cli.common import err_console, log_line


def register(app: typer.Typer) -> None:
    @app.command("step")
    def step_cmd(
        overrides: Optional[list[str]] = typer.Argument(  # noqa: UP045 (typer needs Optional)
            None, help="Config overrides key=value, e.g. parallel.dp_shard=2 (the recipe stays as given); or your"
                       " script after --: -- train.py args (-- -m module args)"
        ),
        config: Optional[str] = typer.Option(None, "--config", "-c",  # noqa: UP045
                                             help="Preset name or YAML path (the reference trainer)"),
        out: Path = typer.Option(..., "--output", "-o", "--out",
                                 help="Folder for the profile, plan.yaml and step_plan.json"),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run already in --out"),
        budget_min: float = typer.Option(20.0, "--budget-min", min=0.1, max=24 * 60,
                                         help="Minutes for the whole search, the check and the measurement"),
        levers: Optional[str] = typer.Option(  # noqa: UP045
            None, "--levers", help="Comma-separated levers to search (default: every one that applies here)"),
        cache: Optional[Path] = typer.Option(  # noqa: UP045
            None, "--cache", help="A kernel cache (primus-tune gemm/loop) to try as a lever"),
        blocks: int = typer.Option(2, "--blocks", min=2, max=100, help="Pairs of blocks per candidate"),
        block_steps: int = typer.Option(2, "--block-steps", min=1, max=1000, help="Timed steps per block"),
        final_blocks: int = typer.Option(3, "--final-blocks", min=2, max=100,
                                         help="Pairs of blocks for the plan against the default"),
        check_steps: int = typer.Option(50, "--check-steps", min=2, max=100_000,
                                        help="Steps of the loss guard (the default and the plan from one seed)"),
        lanes: int = typer.Option(0, "--lanes", min=0, max=1024,
                                  help="Devices measuring candidates at once for a one-GPU config: 0 every GPU "
                                       "visible, 1 the session's alone (on a CPU: processes sharing its cores)"),
        profile: bool = typer.Option(True, "--profile/--no-profile",
                                     help="Profile the config first: the analyzer's advice orders the search"),
        warmup_steps: int = typer.Option(4, "--warmup-steps", min=0, max=10_000,
                                         help="Your script: steps of each run left out first (allocation, compilation)"),
        run_steps: int = typer.Option(8, "--run-steps", min=2, max=100_000,
                                      help="Your script: timed steps of each run"),
        runs: int = typer.Option(1, "--runs", min=1, max=100,
                                 help="Your script: runs of a candidate per trial, each between runs of the best so far"),
        run_timeout_min: float = typer.Option(30.0, "--run-timeout-min", min=0.1,
                                              help="A run in a child process (your script's; the profile) that has not"
                                                   " ended by then is stopped"),
    ) -> None:
        """Search the step's levers (micro-batch at the fixed global batch, recompute, compile,
        FP8, optimizer, FSDP2 knobs, grouped-GEMM backend, a kernel cache): every candidate
        measured in the running step against the best so far, kept only past the noise; the
        plan checked against the default's loss and measured against it, interleaved; written
        to --out/plan.yaml for primus-train --plan. Under torchrun every rank runs it."""
        from primus_perf.cli.profile_capture import is_program
        from primus_perf.profiler.capture import prepare_out_dir
        from primus_perf.tuner.step.levers import pick, script_levers

        args = list(overrides or [])
        script = bool(args) and is_program(args)
        if script and config is not None:
            raise UserError("--config is the reference trainer's; a script after -- is run as it is")
        if not script and config is None:
            raise UserError("primus-tune step needs --config PRESET [overrides], or your script after --"
                            " (primus-tune step --out DIR -- train.py args)")
        chosen = pick(levers, among=script_levers() if script else None)
        if cache is not None and not cache.is_file():
            raise typer.BadParameter(f"{cache}: no such file", param_hint="--cache")
        prepare_out_dir(out, overwrite=overwrite)

        if script:
            from primus_perf.profiler.program import check_target
            from primus_perf.tuner.step.script import tune_program

            check_target(args)
            res = tune_program(args, out, lanes=lanes, log=log_line, levers=chosen,
                               cache=str(cache.resolve()) if cache else None, budget_min=budget_min,
                               warmup=warmup_steps, steps=run_steps, blocks=runs, final_blocks=final_blocks,
                               profile=profile, timeout_s=run_timeout_min * 60)
        else:
            from primus_perf.tuner.step.tune import tune_config

            res = tune_config(config, args, out, profile=profile, log=log_line, levers=chosen,
                              cache=str(cache.resolve()) if cache else None, budget_min=budget_min, blocks=blocks,
                              block_steps=block_steps, final_blocks=final_blocks, check_steps=check_steps,
                              lanes=lanes, timeout_s=run_timeout_min * 60)
        if environment.get("RANK") != 0:
            return  # rank 0 speaks for every rank
        for line in res.lines():
            log_line(line)
        if res.guard is not None and not res.guard.passed:
            err_console.print("[yellow]note:[/] " + ("the loss guard dropped what changes the numerics"
                                                     if res.dropped_by_guard else
                                                     "the loss guard failed and nothing in the plan changes the "
                                                     "numerics: the default stays"), highlight=False)
