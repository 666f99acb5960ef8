"""``--offline`` / ``--online`` of ``primus-tune gemm``, ``grouped-gemm`` and ``attention``.

``--offline`` (the default) tunes a list of problems before a run: from traces, problems
files or (grouped GEMM) a short recorded run. ``--online`` tunes during a short run
instead: ``--config PRESET [overrides]`` trains the reference trainer for ``--steps``
steps, or ``-- script.py args`` (``-- -m module args``) runs a program; either runs under
``primus_perf.enable(cache, online=True, kinds=[this kind])``, so each new problem's
candidates are timed on the real calls of the first steps and the choices are written to
``--cache``. The run is the enable launcher's (``python -m primus_perf.launch``, a child
process: its exit code is the command's, Ctrl-C reaches both). Online tuning times kernels
with CUDA/ROCm events: without a GPU it is refused before anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import typer

from primus_perf.errors import DeviceError, UserError

ONLINE = typer.Option(
    False, "--online/--offline",
    help="--offline (default): tune the listed problems now. --online: tune during a short run of"
         " --config PRESET [overrides] (--steps steps of the trainer) or of a program given after --"
         " (primus-tune KIND --online -- script.py args); the choices go to --cache. Needs a GPU.")
STEPS_HELP = "With --config: training steps to run (--online) or record (grouped-gemm)"
CONFIG_HELP = "With --online: preset name or YAML path of the trainer run to tune during"
NO_GPU = "online tuning needs a GPU: it times kernels with CUDA/ROCm events and torch sees none here" \
         " (tune offline, the default, from --from-trace or --problems)"
TRAIN_MODULE = "primus_perf.cli.train"
STOP_GRACE_S = 30  # after Ctrl-C, how long the online run has to stop on its own


def online_target(kind: str, config: str | None, steps: int, args: Sequence[str]) -> list[str]:
    """The program an online run runs: the trainer for a config, else the program named."""
    if config is not None:
        return ["-m", TRAIN_MODULE, "--config", config, "--steps", str(steps), *args]
    if not args:
        raise UserError("--online needs a run to tune during: --config PRESET [overrides], or a program"
                        f" after --, e.g. primus-tune {kind.replace('_', '-')} --online --cache c.json -- train.py")
    return list(args)


def run_online(kind: str, cache: str, config: str | None, steps: int, args: Sequence[str]) -> None:
    """Run the config or program with online tuning of ``kind`` into ``cache`` (exit code
    of the program); one line and exit 2 on a machine without a GPU."""
    target = online_target(kind, config, steps, args)
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(NO_GPU)
    import subprocess
    import sys

    launcher = [sys.executable, "-m", "primus_perf.launch"]  # the launcher, as `python -m` runs it
    proc = subprocess.Popen([*launcher, "--cache", cache, "--online", "--kinds", kind, "--", *target])
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too: it stops and keeps what it locked
        try:
            code = proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:  # SIGTERM to this process alone: pass it on
            proc.terminate()
            code = proc.wait()
    raise typer.Exit(code)


def refuse_offline_extras(config: str | None, args: Sequence[str]) -> None:
    """Offline, gemm and attention take their problems from traces and files only."""
    if config is not None:
        raise UserError("--config names a run to tune during: add --online (offline: --from-trace or --problems)")
    if args:
        raise UserError(f"unexpected argument(s) {' '.join(args)}: a program to run is for --online")
