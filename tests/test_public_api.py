"""The public API: ``import primus_perf`` is cheap, and every name it lists resolves."""

from __future__ import annotations

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
