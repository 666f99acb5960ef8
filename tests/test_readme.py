"""The README's snippets run as written on the CPU: every fenced block marked
```` ```bash runnable ```` or ```` ```python runnable ````, in order, in one scratch folder
that has the checkout's ``benchmarks/``, ``examples/`` and ``tests/data/`` (the snippets use
the traces and caches committed there). Blocks without the mark are GPU-sized or set a
machine up, and the README says so beside them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUNNABLE = re.compile(r"^```(bash|python) runnable[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
FENCE = re.compile(r"^```(?!`)(\S*)(.*)$", re.M)


def blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in RUNNABLE.finditer(README.read_text())]


def test_the_runnable_marker_is_spelled_one_way() -> None:
    """A block meant to run cannot drop out of the test by a misspelt mark."""
    for m in FENCE.finditer(README.read_text()):
        lang, rest = m.group(1), m.group(2).strip()
        assert rest in ("", "runnable"), f"fence {m.group(0)!r}: the mark is ' runnable'"
        assert not (rest and lang not in ("bash", "python")), m.group(0)
    assert len(blocks()) >= 10


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    work = tmp_path_factory.mktemp("readme")
    for name in ("benchmarks", "examples"):
        (work / name).symlink_to(ROOT / name)
    (work / "tests").mkdir()
    (work / "tests" / "data").symlink_to(ROOT / "tests" / "data")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "PRIMUS_PERF_CACHE")}
    # `python` and the console scripts of this interpreter's environment come first
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    return work, env


@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_block_runs_on_the_cpu(scratch: tuple[Path, dict[str, str]], index: int) -> None:
    work, env = scratch
    lang, code = blocks()[index]
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"README block {index} ({lang}) failed:\n{code}\n--- stdout\n" \
                                f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"
