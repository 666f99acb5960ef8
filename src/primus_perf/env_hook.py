"""Start-up hook: ``PRIMUS_PERF_CACHE=PATH`` turns ``primus_perf.enable`` on in every Python
process of the environment, without editing the program and without ``sitecustomize``.

How it is activated: the wheel, and an editable install (``pip install -e .``: ``setup.py``
puts the file into the editable wheel too), installs ``primus_perf_enable.pth`` into
site-packages (an editable install made before that fix lacks it: install again). Python
runs its one line at start-up (the ``site`` module executes ``.pth`` lines that begin with
``import``); the line imports this module only when ``PRIMUS_PERF_CACHE`` is set, so
other processes pay one environment lookup. This module then calls
``enable(PRIMUS_PERF_CACHE, online=PRIMUS_PERF_ONLINE == "1")``, prints the start lines and,
at exit, the summary (rank 0, stderr). An error (no cache file, a corrupt one) is printed
as one line and leaves the program running on torch's kernels. Remove the ``.pth`` file (or
unset the variable) to turn it off. In a checkout run with ``PYTHONPATH=src`` no ``.pth`` is
read: use ``python -m primus_perf.launch`` there.
"""

from __future__ import annotations

import atexit

from primus_perf.base import environment
from primus_perf.base.errors import UserError
from primus_perf.enabling import enable
from primus_perf.runtime.handle import rank0_stderr

PTH_LINE = 'import os; os.environ.get("PRIMUS_PERF_CACHE") and __import__("primus_perf.env_hook")'


def _activate() -> None:
    try:
        handle = enable(environment.get("PRIMUS_PERF_CACHE"), online=environment.get("PRIMUS_PERF_ONLINE"))
    except UserError as exc:
        rank0_stderr(f"PRIMUS_PERF_CACHE: not enabled ({' '.join(str(exc).split())})")
        return
    for line in handle.start_lines():
        rank0_stderr(line)

    def finish() -> None:
        for line in handle.end_lines():
            rank0_stderr(line)
        handle.disable()

    atexit.register(finish)


if environment.get("PRIMUS_PERF_CACHE"):
    _activate()
