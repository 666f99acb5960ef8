"""Atomic writes: complete files or the old one, never a temporary left behind."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from primus_perf.base.files import atomic_open, write_json, write_text


def test_writes_creates_parents_and_plain_permissions(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "doc.json"
    write_json(target, {"x": [1, 2]}, indent=1)
    assert json.loads(target.read_text()) == {"x": [1, 2]}
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask
    assert os.listdir(target.parent) == ["doc.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "doc.txt"
    write_text(target, "old")
    with pytest.raises(RuntimeError), atomic_open(target) as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["doc.txt"]
    with pytest.raises(TypeError):
        write_json(target, {"not": object()})
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["doc.txt"]


def test_concurrent_writers_leave_one_complete_version(tmp_path: Path) -> None:
    target = tmp_path / "doc.json"
    payloads = [{"writer": i, "data": list(range(i * 1000, i * 1000 + 5000))} for i in range(8)]
    threads = [threading.Thread(target=lambda d=d: [write_json(target, d) for _ in range(20)]) for d in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(target.read_text()) in payloads
    assert os.listdir(tmp_path) == ["doc.json"]


def test_binary_mode_and_bad_modes(tmp_path: Path) -> None:
    with atomic_open(tmp_path / "b.bin", "wb") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    for mode in ("r", "a", "w+"):
        with pytest.raises(ValueError), atomic_open(tmp_path / "c", mode):
            pass


# --------------------------------------------------------------------------- reading inputs


def test_an_input_that_is_no_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO without a writer, and a symlink to /dev/zero, are refused from the open
    descriptor: the reader never waits on them (no timeout needed)."""
    from primus_perf.base.errors import UserError
    from primus_perf.base.files import check_input_file, read_input

    fifo, zero = tmp_path / "fifo.json", tmp_path / "zero.json"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    for path, said in ((fifo, r"a FIFO \(named pipe\)"), (zero, "a character device"), (tmp_path, "a directory")):
        for read in (read_input, check_input_file):
            with pytest.raises(UserError, match=f"is {said}, not a regular file"):
                read(path, what="trace")
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert read_input(tmp_path / "ok.json", starts_with=(b"{",)) == b'{"a": 1}'


def test_deep_json_and_yaml_bombs_are_value_errors() -> None:
    from primus_perf.base.files import load_json, load_yaml

    with pytest.raises(ValueError, match="nested too deeply"):
        load_json("[" * 100_000 + "]" * 100_000)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    with pytest.raises(ValueError, match="YAML bomb"):
        load_yaml(bomb)
    with pytest.raises(ValueError, match="nested too deeply"):
        load_yaml("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="recursive alias"):
        load_yaml("a: &a [1, *a]")
    assert load_yaml("base: &b {x: 1}\nuse: *b\nmerged: {<<: *b, y: 2}") == {
        "base": {"x": 1}, "use": {"x": 1}, "merged": {"x": 1, "y": 2}}


def test_a_write_removes_the_temporaries_of_writers_killed_on_this_host(tmp_path: Path) -> None:
    """kill -9 leaves a writer's temporary file; the next write of the same target removes
    it at once when its process (named in it) is gone, and keeps a live writer's."""
    import subprocess
    import sys

    from primus_perf.base import files

    target = tmp_path / "report.json"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".report.json.{files._HOST}-{int(gone.stdout)}.abc.tmp"
    live = tmp_path / f".report.json.{files._HOST}-{os.getpid()}.def.tmp"
    for f in (killed, live):
        f.write_text("partial")
    write_json(target, {"x": 1})
    assert not killed.exists() and live.exists() and json.loads(target.read_text()) == {"x": 1}
