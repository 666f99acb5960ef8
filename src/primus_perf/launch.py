"""``python -m primus_perf.launch [--cache PATH] [--online] [--kinds gemm,attention] [--plan PLAN]
-- script.py args``: run a Python script (or ``-m module``) with ``primus_perf.enable`` on, and
with a step plan of ``primus-tune step -- script.py`` (``--plan DIR/plan.yaml``: its levers
applied from outside, ``tuner.step.hooks``, or as a known program's own flags appended to its
arguments, ``tuner.step.own_flags``: torchtitan's), unmodified.

The script runs as ``__main__`` (``runpy``) with ``sys.argv`` = ``[script, *args]``; the
summary is printed to stderr at the end (rank 0). ``--cache`` defaults to the
``PRIMUS_PERF_CACHE`` environment variable. Under torchrun:
``torchrun --nproc-per-node 8 -m primus_perf.launch --cache c.json -- train.py``: every rank
reads the same cache. ``--measure OUT --warmup W --steps N`` (what the step tuner runs for each
candidate): the script's first W steps, then N timed ones, written to OUT, and the run stops.
"""

from __future__ import annotations

import argparse
import os
import sys

from primus_perf.base import environment
from primus_perf.base.errors import UserError
from primus_perf.base.programs import run_target

USAGE = "python -m primus_perf.launch [--cache PATH] [--online] [--kinds K,..] [--plan PLAN] -- script.py args"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # a usage error is one line and exit 2, as every command's
        raise UserError(f"{message} (usage: {USAGE})")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _Parser(prog="python -m primus_perf.launch", usage=USAGE,
                     description="Run a Python script (or -m module) with primus_perf.enable() on, unmodified.")
    parser.add_argument("--cache", default=environment.get("PRIMUS_PERF_CACHE"),
                        help="tuning cache (default: $PRIMUS_PERF_CACHE)")
    parser.add_argument("--online", action="store_true", help="tune new problems during the first steps")
    parser.add_argument("--kinds", default=None, help="comma-separated kinds (default: every kind enable() routes)")
    parser.add_argument("--plan", default=None, help="a step plan of primus-tune step -- script.py (DIR/plan.yaml)")
    parser.add_argument("--measure", default=None, metavar="OUT",
                        help="the step tuner's measured run: time the script's steps, write them to OUT, stop")
    parser.add_argument("--warmup", type=int, default=3, help="with --measure: steps left out first (compilation)")
    parser.add_argument("--steps", type=int, default=8, help="with --measure: timed steps")
    opts = parser.parse_args(argv[:cut])  # --help prints the help and exits 0
    if opts.warmup < 0 or opts.steps < 1:
        raise UserError(f"--warmup must be >= 0 and --steps >= 1 (usage: {USAGE})")
    target = argv[cut + 1:]
    if not target:
        raise UserError(f"name the script to run after -- (usage: {USAGE})")
    return opts, target


def read_plan(path: str) -> dict[str, str]:
    """The levers of a script's step plan (``levers:`` of ``plan.yaml``), as text; UserError for a
    file that is none (a primus-train plan among them: its keys are the trainer's)."""
    from primus_perf.base.files import load_yaml, read_input

    try:
        data = load_yaml(read_input(path, what="step plan", text=True, max_bytes=2**20).decode())
    except ValueError as exc:
        raise UserError(f"{path}: not a step plan ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("levers", {}), dict) or (data and "levers" not in data):
        raise UserError(f"{path}: not a script's step plan (a plan of primus-train config keys runs with"
                        " primus-train --plan)")
    from primus_perf.tuner.step.levers import text

    return {str(k): text(v) for k, v in (data.get("levers") or {}).items()}


def main(argv: list[str] | None = None) -> int:
    from primus_perf.enabling import enable
    from primus_perf.runtime.handle import rank0_stderr

    opts, target = _parse(sys.argv[1:] if argv is None else argv)
    plan = read_plan(opts.plan) if opts.plan else {}
    cache = opts.cache or plan.get("kernel_cache") or None
    chosen = None if opts.kinds is None else [k for k in opts.kinds.split(",") if k]
    plain = not opts.plan and not opts.measure  # the launcher of a cache: it needs one
    handle = enable(cache, online=opts.online, kinds=chosen) if cache or plain else None
    if opts.measure:  # a measured run: nothing printed, the result in the file, no teardown to wait for
        from primus_perf.tuner.step.measured import measure_program

        measure_program(target, plan, opts.measure, warmup=opts.warmup, steps=opts.steps)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if handle is not None:
        for line in handle.start_lines():
            rank0_stderr(line)
    applied = None
    if plan:
        from primus_perf.tuner.step import own_flags

        target, applied, program = own_flags.install(target, plan)
        rank0_stderr(f"step plan {opts.plan}: " + " ".join(f"{k}={v}" for k, v in plan.items()))
        if applied.found.get("flags"):
            rank0_stderr(f"as {program.name}'s own flags: " + " ".join(applied.found["flags"]))
    try:
        run_target(target)
    finally:
        if handle is not None:
            for line in handle.end_lines():
                rank0_stderr(line)
            handle.disable()
        if applied is not None:
            for line in applied.notes:
                rank0_stderr(line)
    return 0


if __name__ == "__main__":
    from primus_perf.base.entry import run_main

    run_main(main)
