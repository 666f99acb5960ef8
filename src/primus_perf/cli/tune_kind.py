"""``primus-tune <kind>``: one command per kind of the registry with a CLI part (its record's
``cli``, a :class:`CliPart`), named as the kind with ``-`` for ``_`` (``grouped-gemm``), built
here: the options every kind's command shares (problems files, traces, ``--budget-s``,
``--cache``, ``--gpus``, ``--dry-run``, ``--json``; ``--problem`` where the kind parses a spec)
and the kind's own.

``--offline`` (the default) tunes a list of problems before a run (or, grouped GEMM, those
of a short run of ``--config``). ``--online`` (a kind with an online part) tunes during a
run: ``--config PRESET [overrides]`` trains the reference trainer for ``--steps`` steps, or
``-- script.py args`` (``-- -m module args``) runs a program, under the enable launcher
(``python -m primus_perf.launch --online --kinds KIND``, a child process: its exit code is
the command's, Ctrl-C reaches both), so each new problem's candidates are timed on the real
calls of the first steps and the choices are written to ``--cache``. Online tuning times
kernels with CUDA/ROCm events: without a GPU it is refused before anything runs."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

import typer

from primus_perf import kinds
from primus_perf.base.errors import DeviceError, UserError
from primus_perf.cli.common import console


@dataclass(frozen=True)
class CliPart:
    """A kind's CLI part (its record's ``cli``, see ``primus_perf.kinds``)."""

    help: str  # the command's
    tuner: Any  # its plugin class or a factory (or its "module:attribute"), called with the kind's options; picklable
    options: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)  # the kind's own: name -> (type, typer.Option)
    spec: Callable[[str, dict[str, Any]], Any] | None = None  # (--problem SPEC, values) -> its problem (ValueError)
    spec_help: str = ""  # --problem's help
    spec_options: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)  # options of --problem (not the tuner's)
    check: Callable[[dict[str, Any]], None] | None = None  # the command's values, checked (normalized) before any work
    # offline --config: (config, overrides, steps) -> the (problem, calls) pairs a short run of it made
    record: Callable[[str, list[str], int], list[tuple[Any, int]]] | None = None
    render: Callable[[Any], None] | None = None  # a newly tuned result, as it comes


NO_GPU = "online tuning needs a GPU: it times kernels with CUDA/ROCm events and torch sees none here" \
         " (tune offline, the default, from --from-trace or --problems)"
STOP_GRACE_S = 30  # after Ctrl-C, how long the online run has to stop on its own


def run_online(kind: str, cache: str, config: str | None, steps: int, args: Sequence[str]) -> None:
    """Run the config (the trainer, ``steps`` steps) or the program named with online tuning of
    ``kind`` into ``cache`` (exit code of the program); one line and exit 2 on a machine without a GPU."""
    if config is None and not args:
        raise UserError("--online needs a run to tune during: --config PRESET [overrides], or a program"
                        f" after --, e.g. primus-tune {kind.replace('_', '-')} --online --cache c.json -- train.py")
    target = list(args) if config is None else ["-m", "primus_perf.cli.train", "--config", config, "--steps",
                                                str(steps), *args]
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


Texts, Paths = Optional[list[str]], Optional[list[Path]]  # noqa: UP045 (typer needs Optional)


def _parameters(kind: kinds.Kind, part: CliPart) -> list[inspect.Parameter]:
    """The command's parameters: the shared ones, with the kind's own before ``--budget-s``."""
    online, record = "online" in kind.parts, part.record is not None
    params: list[tuple[str, Any, Any]] = [
        ("args", Texts, typer.Argument(None, help="With --config: config overrides key=value, e.g. model.n_layers=2;"
                                       " with --online and no --config: the program to run after --" if record else
                                       "With --online: config overrides key=value (with --config), or the program to"
                                       " run after --")),
        ("online", bool, typer.Option(False, "--online/--offline", help="--offline (default): tune the listed problems"
                                      " now. --online: tune during a short run of --config PRESET [overrides] (--steps"
                                      " steps of the trainer) or of a program given after -- (primus-tune KIND --online"
                                      " -- script.py args); the choices go to --cache. Needs a GPU.")),
        ("config", Optional[str], typer.Option(None, "--config", "-c", help=f"Preset or YAML: run a few steps, tune"  # noqa: UP045
                                               f" the {kind.title}s they ran" if record else "With --online: preset"
                                               " name or YAML path of the trainer run to tune during")),
        ("steps", int, typer.Option(3, "--steps", min=1, help="With --config: training steps to run (--online) or"
                                    " record (grouped-gemm)")),
    ][: 4 if online or record else 0]  # a run to tune during (online) or to record (offline)
    params = [p for p in params if online or p[0] != "online"]
    params += [
        ("problems_file", Paths, typer.Option(None, "--problems", help="Problems file(s) (JSON/YAML, `primus-profile"
                                              f" shapes`): their {kind.name} items (repeatable)")),
        ("from_trace", Paths, typer.Option(None, "--from-trace", "--trace", help="Profiler trace(s) or run directories:"
                                           f" tune their {kind.title} problems (repeatable)")),
        *[("problem", Texts, typer.Option(None, "--problem", "-p", help=part.spec_help))] * (part.spec is not None),
        *[(name, *opt) for name, opt in {**part.spec_options, **part.options}.items()],
        ("budget_s", float, typer.Option(5.0, "--budget-s", min=0.001, help="Time budget per problem (its final race)")),
        ("cache", str, typer.Option("tuning_cache.json", "--cache", help="Cache file to write")),
        ("gpus", str, typer.Option("1", "--gpus", help="GPUs to tune on: a number or 'all' (one worker process each)")),
        ("dry_run", bool, typer.Option(False, "--dry-run", help="List the problems, tune nothing")),
        ("json_out", Optional[Path], typer.Option(None, "--json", help="Write all results as JSON")),  # noqa: UP045
    ]
    return [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            for name, annotation, default in params]


def run(kind: kinds.Kind, part: CliPart, values: dict[str, Any]) -> None:
    """One ``primus-tune <kind>``: check the input, gather the problems, list or tune them."""
    from primus_perf.cli.tune_run import list_problems, run_tuning
    from primus_perf.tracelens.inputs import check_traces
    from primus_perf.tuner.multi_gpu import resolve_gpus
    from primus_perf.tuner.problems_input import gather_problems

    if part.check is not None:
        part.check(values)
    args, config, steps, cache = list(values.get("args") or ()), values.get("config"), values.get("steps", 3), values["cache"]
    if values.get("online"):
        run_online(kind.name, cache, config, steps, args)
    record = part.record is not None
    if not record and (config is not None or args):  # offline, problems come from traces, files and specs only
        raise UserError("--config names a run to tune during: add --online (offline: --from-trace or --problems)"
                        if config is not None else f"unexpected argument(s) {' '.join(args)}: a program to run is for"
                        " --online")
    if args and config is None:
        raise UserError("config overrides need --config")
    files, traces, specs = values["problems_file"] or (), values["from_trace"] or (), values.get("problem") or ()
    if not (files or traces or specs or config):
        ways = ["--problems FILE", "--from-trace TRACE", *["--problem SPEC"] * bool(part.spec), *["--config PRESET"] * record]
        raise UserError(f"nothing to tune: give {', '.join(ways[:-1])} or {ways[-1]}")
    options = {name: values[name] for name in part.options}
    try:
        given = [part.spec(s, values) for s in specs] if part.spec is not None else []
    except ValueError as exc:
        raise UserError(f"--problem {exc}") from None
    n_gpus = resolve_gpus(values["gpus"])
    check_traces(traces)
    with console.status("reading the problems"):
        problems = gather_problems(kind.name, traces=traces, files=files, given=given) if files or traces or given else []
    made = part.record(config, args, steps) if config is not None else []  # type: ignore[misc]
    calls = {p.key(): n for p, n in made}
    problems = list({p.key(): p for p in [*problems, *(p for p, _ in made)]}.values())
    if values["dry_run"] or calls:  # the problems once, with the calls the run made
        list_problems(problems, kind.title, calls)
    if values["dry_run"]:
        return
    results: list[Any] = []

    def done(res: Any) -> None:
        results.append(res)
        if part.render is not None and not res.cached:
            part.render(res)

    try:
        run_tuning(problems, partial(kinds.resolve(part.tuner), **options), cache, budget_s=values["budget_s"], gpus=n_gpus,
                   on_done=done)
    finally:
        if values["json_out"] is not None:
            from primus_perf.base.files import write_json

            write_json(values["json_out"], [r.to_dict() for r in results], indent=1, default=float)


def register(app: typer.Typer) -> None:
    """``primus-tune <kind>`` for every kind with a CLI part, in registration order: its
    parameters as the command's signature."""
    for name, part in kinds.with_part("cli").items():
        def tune_kind(kind: kinds.Kind = kinds.get(name), part: CliPart = part, **values: Any) -> None:
            run(kind, part, values)

        tune_kind.__signature__ = inspect.Signature(_parameters(kinds.get(name), part))  # type: ignore[attr-defined]
        app.command(name.replace("_", "-"), help=part.help)(tune_kind)
