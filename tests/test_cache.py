"""The tuning cache file: round trip, concurrent writers, killed writers, corrupt files,
stale entries, merge."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primus_perf.cache.store import SCHEMA_VERSION, CacheEntry, TuningCache
from primus_perf.devices import DeviceIdentity
from primus_perf.errors import CacheError
from primus_perf.problems import GemmProblem

H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132)
H200 = DeviceIdentity("NVIDIA H200", "nvidia", "sm_90", 132)
LIB = {"cublasLt": "13.1.0"}


def entry(i: int, device: DeviceIdentity = H100, versions: dict | None = None, blob: bytes = b"\x00\x01") -> CacheEntry:
    p = GemmProblem.from_row_major(128 + i, 256, 512, b_transposed=True)
    return CacheEntry(
        kind="gemm",
        problem_key=p.key(),
        problem=p.to_dict(),
        device=device.to_dict(),
        versions=dict(versions or LIB),
        solution={"config": {"algo": i}, "blob": blob},
        times={"tuned_ms": 1.0, "default_ms": 1.1},
        error=1e-3,
        tuner_version="test",
    )


def test_round_trip_keeps_everything(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "c.json")
    e = entry(1, blob=bytes(range(256)))
    cache.put(e)
    (back,) = TuningCache(tmp_path / "c.json").entries()
    assert back == e and back.solution["blob"] == bytes(range(256))
    assert back.speedup == pytest.approx(1.1)
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["schema"] == SCHEMA_VERSION


def test_same_slot_replaces_other_device_adds(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "c.json")
    cache.put(entry(1))
    newer = entry(1)
    newer.solution = {"config": {"algo": 99}, "blob": b""}
    cache.put(newer)
    cache.put(entry(1, device=H200))
    assert len(cache.entries()) == 2
    got = cache.get("gemm", entry(1).problem_key, H100, LIB)
    assert got is not None and got.solution["config"] == {"algo": 99}


def test_stale_entries_are_reported_once_and_not_used(tmp_path: Path) -> None:
    seen: list[str] = []
    cache = TuningCache(tmp_path / "c.json", report_stale=seen.append)
    cache.put(entry(1, device=H200))
    cache.put(entry(2, versions={"cublasLt": "12.9.0"}))
    key1, key2 = entry(1).problem_key, entry(2).problem_key
    for _ in range(3):
        assert cache.get("gemm", key1, H100, LIB) is None
        assert cache.get("gemm", key2, H100, LIB) is None
    assert len(seen) == 2
    assert any("H200" in s for s in seen) and any("12.9.0 -> 13.1.0" in s for s in seen)


def _writer(path: str, worker: int, n: int) -> None:
    """Writes n entries: one at a time, then in small batches (each write re-reads the file)."""
    cache = TuningCache(path)
    ids = [worker * 1000 + i for i in range(n)]
    for i in ids[:20]:
        cache.put(entry(i))
    for start in range(20, n, 5):
        cache.put_many(entry(i) for i in ids[start : start + 5])


def test_eight_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "c.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, w, 200)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    keys = {e.problem_key for e in TuningCache(path).entries()}
    assert len(keys) == 8 * 200


KILLED_WRITER = """
import sys
from primus_perf.cache.store import TuningCache
sys.path.insert(0, sys.argv[2])
from test_cache import entry
cache = TuningCache(sys.argv[1])
big = b"x" * 2_000_000
i = 0
while True:
    cache.put_many([entry(10_000 + i * 50 + j, blob=big) for j in range(50)])
    i += 1
    print(i, flush=True)
"""


def test_writer_killed_mid_write_leaves_a_loadable_cache(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    TuningCache(path).put(entry(1))
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # one big write finished; the next is under way
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    entries = TuningCache(path).entries()
    assert entry(1).problem_key in {e.problem_key for e in entries}
    assert len(entries) >= 51
    # the lock and temp files of the killed writer do not block the next writer
    TuningCache(path).put(entry(2))
    assert len(TuningCache(path).entries()) == len(entries) + 1


@pytest.mark.parametrize(
    "content",
    [b'{"schema": 1, "entries": [', b"\x1f\x8b garbage", b'{"schema": 99, "entries": []}', b"[]"],
    ids=["truncated", "binary", "other-schema", "not-a-cache"],
)
def test_corrupt_file_is_kept_aside_with_one_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(content)
    cache = TuningCache(path)
    with pytest.raises(CacheError, match="corrupt") as info:
        cache.entries()
    assert "\n" not in str(info.value)
    aside = list(tmp_path.glob("c.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == content
    assert not path.exists()


def test_put_on_corrupt_file_never_overwrites_it(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(b'{"schema": 1, "entr')
    with pytest.raises(CacheError):
        TuningCache(path).put(entry(1))
    (aside,) = tmp_path.glob("c.json.corrupt-*")
    assert aside.read_bytes() == b'{"schema": 1, "entr'


def test_merge_newest_wins(tmp_path: Path) -> None:
    a, b, out = (TuningCache(tmp_path / n) for n in ("a.json", "b.json", "out.json"))
    old, new = entry(1), entry(1)
    old.created, new.created = 100.0, 200.0
    new.solution = {"config": {"algo": 7}, "blob": b""}
    a.put_many([old, entry(2)])
    b.put_many([new, entry(3, device=H200)])
    assert out.merge_from(a.path, b.path) == 3
    got = out.get("gemm", entry(1).problem_key, H100, LIB)
    assert got is not None and got.solution["config"] == {"algo": 7}
