"""The public API: ``import primus_perf`` is cheap, and every name it lists resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import primus_perf


def test_import_does_not_load_torch():
    code = "import sys, primus_perf; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name", [n for n in primus_perf.__all__ if n != "__version__"])
def test_every_public_name_resolves(name):
    value = getattr(primus_perf, name)
    assert value is not None
    assert getattr(value, "__name__", name) == name


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        primus_perf.nope  # noqa: B018


def test_dir_lists_the_api():
    assert {"analyze", "tune", "TuningCache", "GemmProblem", "AttentionProblem"} <= set(dir(primus_perf))


@pytest.mark.parametrize("call,said", [
    (lambda: primus_perf.enable(123), "primus_perf.enable: cache must be str or PathLike or None, got int 123"),
    (lambda: primus_perf.analyze(5), "primus_perf.analyze: paths must be Sequence or str or Path, got int 5"),
    (lambda: primus_perf.load_problems(None), "primus_perf.load_problems: path must be str or PathLike, got NoneType"),
    (lambda: primus_perf.capture_trainer("tiny", [], "out", "3 steps"), "schedule must be Schedule, got str"),
    (lambda: primus_perf.enable("c.json", online="yes"), "online must be bool, got str 'yes'"),
])
def test_the_api_checks_its_arguments_types(call, said: str) -> None:
    """A wrong type is one clear error (a TypeError and a UserError) naming the function and
    the parameter, before anything runs."""
    with pytest.raises(primus_perf.ArgumentTypeError, match=re.escape(said)) as info:
        call()
    assert isinstance(info.value, TypeError) and isinstance(info.value, primus_perf.UserError)


# --------------------------------------------------------------------------- what the CLI refuses

TRACE = str(Path(__file__).parent / "data" / "traces" / "h100_cuda_graph.json.gz")
# a call of the API given ``p``, a path that is not a trace: each must refuse it unread
ODD_PATH_CALLS = {
    "analyze": "pp.analyze(p)",
    "analyze-second": f"pp.analyze([{TRACE!r}, p])",
    "build_report": "pp.build_report([p])",
    "build_report-cache": f"pp.build_report({TRACE!r}, cache=p)",
    "compare-base": f"pp.compare(p, {TRACE!r})",
    "compare-candidate": f"pp.compare({TRACE!r}, p)",
}
ODD_PATH_SCRIPT = """
import sys
import primus_perf as pp
for p in sys.argv[1:]:
    for name, call in CALLS.items():
        try:
            eval(call)
            print(name, "accepted", p, flush=True)
        except pp.UserError as exc:
            print(name, "error:", exc, flush=True)
"""


def test_the_api_refuses_a_fifo_or_a_device_unread_as_the_command_does(tmp_path) -> None:
    """What the commands refuse (tests/cli/test_bad_inputs.py: a FIFO, /dev/zero in every file
    slot) the API refuses with the same line, before reading anything: no call waits for a
    FIFO's writer or reads /dev/zero to its end (in a process of its own: a call that hangs
    fails the test, with the calls that answered before it)."""
    import os

    fifo = str(tmp_path / "trace.json")
    os.mkfifo(fifo)  # no writer: opening it for reading waits forever
    code = f"CALLS = {ODD_PATH_CALLS!r}\n{ODD_PATH_SCRIPT}"
    try:
        r = subprocess.run([sys.executable, "-c", code, fifo, "/dev/zero"], capture_output=True, text=True,
                           timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a call hung; these answered: {exc.stdout!r}")
    assert r.returncode == 0, r.stderr[-2000:]
    what = {fifo: "a FIFO (named pipe)", "/dev/zero": "a character device"}
    assert r.stdout.splitlines() == [f"{name} error: {'tuning cache' if 'cache' in name else 'trace'} {p} is {what[p]}, "
                                     "not a regular file" for p in (fifo, "/dev/zero") for name in ODD_PATH_CALLS]
    # one check behind both: the command's error line is the API's message
    cli = subprocess.run([sys.executable, "-m", "primus_perf.cli.profile", "analyze", fifo], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 2 and cli.stderr.strip() == r.stdout.splitlines()[0].removeprefix("analyze "), cli.stderr


@pytest.mark.parametrize("overrides,key", [(["train.steps=0"], "train.steps"), (["train.steps=-3"], "train.steps")])
def test_load_config_refuses_what_primus_train_refuses(overrides: list[str], key: str) -> None:
    """``primus-train ... train.steps=0`` ends with one line naming the key (exit 2:
    tests/cli/test_bad_inputs.py); the library refuses the same config with the same error."""
    with pytest.raises(primus_perf.UserError, match=re.escape(f"config key '{key}' must be positive")):
        primus_perf.load_config("tiny", overrides)
