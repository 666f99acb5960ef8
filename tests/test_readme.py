"""The snippets of the README and of ``docs/*.md`` run as written on the CPU: every fenced
block marked ```` ```bash runnable ```` or ```` ```python runnable ````, each file's blocks in
order, in one scratch folder per file that has the checkout's ``benchmarks/``, ``examples/``
and ``tests/data/`` (the snippets use the traces and caches committed there). Blocks without
the mark are GPU-sized or set a machine up, and the text says so beside them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = re.compile(r"^```(bash|python) runnable[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
FENCE = re.compile(r"^```(?!`)(\S*)(.*)$", re.M)


def blocks(doc: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in RUNNABLE.finditer(doc.read_text())]


def name(doc: Path) -> str:
    return str(doc.relative_to(ROOT))


ALL = [(doc, index) for doc in DOCS for index in range(len(blocks(doc)))]


def test_the_runnable_marker_is_spelled_one_way() -> None:
    """A block meant to run cannot drop out of the test by a misspelt mark."""
    for doc in DOCS:
        for m in FENCE.finditer(doc.read_text()):
            lang, rest = m.group(1), m.group(2).strip()
            assert rest in ("", "runnable"), f"{name(doc)}: fence {m.group(0)!r}: the mark is ' runnable'"
            assert not (rest and lang not in ("bash", "python")), (name(doc), m.group(0))
    assert len(ALL) >= 10


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], tuple[Path, dict[str, str]]]:
    """The scratch folder of a file (made when its first block runs) and the environment."""
    made: dict[Path, tuple[Path, dict[str, str]]] = {}

    def folder(doc: Path) -> tuple[Path, dict[str, str]]:
        if doc not in made:
            work = tmp_path_factory.mktemp(doc.stem.lower())
            for link in ("benchmarks", "examples"):
                (work / link).symlink_to(ROOT / link)
            (work / "tests").mkdir()
            (work / "tests" / "data").symlink_to(ROOT / "tests" / "data")
            env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "PRIMUS_PERF_CACHE")}
            # `python` and the console scripts of this interpreter's environment come first
            env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
                       PYTHONPATH=str(ROOT / "src"), CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
            made[doc] = work, env
        return made[doc]

    return folder


@pytest.mark.parametrize(("doc", "index"), ALL, ids=[f"{name(d)}-{i}" for d, i in ALL])
def test_readme_block_runs_on_the_cpu(scratch: Callable[[Path], tuple[Path, dict[str, str]]], doc: Path,
                                      index: int) -> None:
    work, env = scratch(doc)
    lang, code = blocks(doc)[index]
    argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    res = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{name(doc)} block {index} ({lang}) failed:\n{code}\n--- stdout\n" \
                                f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}"


def test_the_readme_states_the_suites_time_as_scripts_test_sh_does() -> None:
    """The suite's time is stated once, in scripts/test.sh (SUITE_TIME, which it prints); the
    README's Tests section quotes it."""
    m = re.search(r'^SUITE_TIME="([^"]+)"$', (ROOT / "scripts" / "test.sh").read_text(), re.M)
    assert m, "scripts/test.sh: no SUITE_TIME line"
    assert f"bash scripts/test.sh            # the CPU suite: {m.group(1)}\n" in (ROOT / "README.md").read_text()
