"""The public API: ``import primus_perf`` is cheap, and every name it lists resolves."""

from __future__ import annotations

import re
import subprocess
import sys

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
