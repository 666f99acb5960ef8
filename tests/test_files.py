"""Atomic writes: complete files or the old one, never a temporary left behind."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from primus_perf.files import atomic_open, write_json, write_text


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
