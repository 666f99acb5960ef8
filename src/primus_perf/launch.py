"""``python -m primus_perf.launch [--cache PATH] [--online] [--kinds gemm,attention] -- script.py args``:
run a Python script (or ``-m module``) with ``primus_perf.enable`` on, unmodified.

The script runs as ``__main__`` (``runpy``) with ``sys.argv`` = ``[script, *args]``; the
summary is printed to stderr at the end (rank 0). ``--cache`` defaults to the
``PRIMUS_PERF_CACHE`` environment variable. Under torchrun:
``torchrun --nproc-per-node 8 -m primus_perf.launch --cache c.json -- train.py``: every rank
reads the same cache.
"""

from __future__ import annotations

import argparse
import os
import sys

from primus_perf.errors import UserError
from primus_perf.programs import run_target

USAGE = "python -m primus_perf.launch [--cache PATH] [--online] [--kinds K,..] -- script.py args"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # a usage error is one line and exit 2, as every command's
        raise UserError(f"{message} (usage: {USAGE})")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = _Parser(prog="python -m primus_perf.launch", usage=USAGE,
                     description="Run a Python script (or -m module) with primus_perf.enable() on, unmodified.")
    parser.add_argument("--cache", default=os.environ.get("PRIMUS_PERF_CACHE"),
                        help="tuning cache (default: $PRIMUS_PERF_CACHE)")
    parser.add_argument("--online", action="store_true", help="tune new problems during the first steps")
    parser.add_argument("--kinds", default=None, help="comma-separated kinds (default: every kind enable() routes)")
    opts = parser.parse_args(argv[:cut])  # --help prints the help and exits 0
    target = argv[cut + 1:]
    if not target:
        raise UserError(f"name the script to run after -- (usage: {USAGE})")
    return opts, target


def main(argv: list[str] | None = None) -> int:
    from primus_perf.enabling import enable
    from primus_perf.runtime.handle import rank0_stderr

    opts, target = _parse(sys.argv[1:] if argv is None else argv)
    chosen = None if opts.kinds is None else [k for k in opts.kinds.split(",") if k]
    handle = enable(opts.cache, online=opts.online, kinds=chosen)
    for line in handle.start_lines():
        rank0_stderr(line)
    try:
        run_target(target)
    finally:
        for line in handle.end_lines():
            rank0_stderr(line)
        handle.disable()
    return 0


if __name__ == "__main__":
    from primus_perf.cli.common import run_app

    run_app(main)
