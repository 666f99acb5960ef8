"""Running a Python program in this process, as ``python script.py args`` (or ``python -m
module args``) would: what ``python -m primus_perf.launch`` and ``primus-tune confirm --
script.py`` share."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence


def run_target(target: Sequence[str]) -> None:
    """Run ``script.py args`` (or ``-m module args``) in this process as ``__main__``, with
    ``sys.argv`` as the program expects it."""
    target = list(target)
    if target[0] == "-m":
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")


def exit_code(exc: SystemExit) -> int:
    """The exit code a ``SystemExit`` gives the shell (``sys.exit("message")``: 1)."""
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1
