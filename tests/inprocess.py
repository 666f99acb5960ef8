"""What a test can run in its own process, without the seconds a new interpreter takes to
import torch: a command as its console script runs it (``run_app``), for commands that stop
before their work (a bad argument, config or file: one ``error:`` line, exit 2); and the
trainer's one-process reference run, once a session per config."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys

from typer.testing import CliRunner

from primus_perf.cli import profile, train, tune
from primus_perf.cli.common import run_app

APPS = {"profile": profile.app, "tune": tune.app, "train": train.app}
CASE_TIMEOUT_S = 300  # a hang, not a slow machine: the alarm ends the case


def _timeout(signum: int, frame: object) -> None:
    raise TimeoutError(f"case ran longer than {CASE_TIMEOUT_S} s")


def run_cli(argv: list[str]) -> tuple[int, str, str, BaseException | None]:
    """Run one command (``argv``: an app name of :data:`APPS`, then its arguments) in-process as
    its console script does; (exit code, stdout, stderr, an exception other than SystemExit)."""
    app = APPS[argv[0]]
    runner = CliRunner()
    old_term = signal.getsignal(signal.SIGTERM)
    old_alarm = signal.signal(signal.SIGALRM, _timeout)
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    code, error = None, None
    try:
        with runner.isolation() as (out, err, _):
            try:
                run_app(app, argv[1:])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException as exc:
                error = exc
            sys.stdout.flush()
            sys.stderr.flush()
            stdout, stderr = out.getvalue().decode(errors="replace"), err.getvalue().decode(errors="replace")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGTERM, old_term)
    return code if code is not None else -1, stdout, stderr, error


def completed(argv: list[str]) -> subprocess.CompletedProcess:
    """:func:`run_cli` as a finished process (``returncode``, ``stdout``, ``stderr``); an
    exception the command let escape (a traceback, in a process) is raised here."""
    code, out, err, error = run_cli(argv)
    if error is not None:
        raise error
    return subprocess.CompletedProcess(argv, code, out, err)


@functools.cache
def one_process_rows(preset: str, *overrides: str) -> tuple[dict, ...]:
    """The JSON-log rows (loss, grad norm, tokens per expert, ...) of ``primus-train --config
    PRESET OVERRIDES`` trained in this process, on one thread as the commands run
    (``OMP_NUM_THREADS=1``): the one-process reference of the parallel layouts' tests, made once
    a session for each config (the same config is several tests' reference)."""
    import torch

    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.loop import train

    torch.set_num_threads(1)
    return tuple(json.loads(json.dumps(m.to_dict())) for m in train(load_config(preset, list(overrides))))


def one_process_losses(preset: str, *overrides: str) -> list[float]:
    """The losses of :func:`one_process_rows`."""
    return [r["loss"] for r in one_process_rows(preset, *overrides)]
