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

from primus_perf.base import files
from primus_perf.base.devices import DeviceIdentity
from primus_perf.base.errors import CacheError
from primus_perf.cache.store import SCHEMA_VERSION, CacheEntry, TuningCache
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
    procs = [ctx.Process(target=_writer, args=(path, w, 80)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    keys = {e.problem_key for e in TuningCache(path).entries()}
    assert len(keys) == 8 * 80


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


CORRUPT = [b'{"schema": 1, "entries": [', b'{"schema": 0, "entries": []}', b'{"schema": 1, "entries": {}}',
           b'{"schema": 1, "entries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]
NOT_CACHES = [b"\x1f\x8b garbage", b"[]", b'{"name": "app", "version": "1.0.0"}', b"{not json", b"[" * 100_000]


@pytest.mark.parametrize("content", CORRUPT, ids=["truncated", "older-schema", "dict", "nested-100k"])
def test_a_reader_never_moves_a_corrupt_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(content)
    with pytest.raises(CacheError, match="corrupt") as info:
        TuningCache(path).entries()
    assert "\n" not in str(info.value)
    assert path.read_bytes() == content and os.listdir(tmp_path) == ["c.json"]


@pytest.mark.parametrize("content", NOT_CACHES, ids=["binary", "list", "package.json", "not-json", "deep"])
def test_a_file_that_is_no_cache_is_refused_and_never_moved(tmp_path: Path, content: bytes) -> None:
    """`cache merge package.json good.json` once renamed package.json aside: a file that is no
    cache is named as such by readers and writers (merge too) and stays as it is."""
    path, good = tmp_path / "c.json", tmp_path / "good.json"
    path.write_bytes(content)
    TuningCache(good).put(entry(1))
    for action in (lambda: TuningCache(path).entries(), lambda: TuningCache(path).put(entry(2)),
                   lambda: TuningCache(path).merge_from(good), lambda: TuningCache(good).merge_from(path)):
        with pytest.raises(CacheError, match="is not a primus-perf tuning cache") as info:
            action()
        assert "\n" not in str(info.value)
    assert path.read_bytes() == content and sorted(os.listdir(tmp_path)) == ["c.json", "c.json.lock", "good.json",
                                                                           "good.json.lock"]


@pytest.mark.parametrize("content", CORRUPT, ids=["truncated", "older-schema", "dict", "nested-100k"])
def test_a_writer_sets_a_corrupt_file_aside_and_never_overwrites_it(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(content)
    with pytest.raises(CacheError, match="kept as"):
        TuningCache(path).put(entry(1))
    (aside,) = tmp_path.glob("c.json.corrupt-*")
    assert aside.read_bytes() == content
    TuningCache(path).put(entry(1))  # the next write starts a new cache
    assert len(TuningCache(path).entries()) == 1


def test_a_newer_schema_is_named_and_left_in_place_by_readers_and_writers(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    content = b'{"schema": 7, "entries": [{"future": true}]}'
    path.write_bytes(content)
    for action in (lambda: TuningCache(path).entries(), lambda: TuningCache(path).put(entry(1)),
                   lambda: TuningCache(tmp_path / "t.json").merge_from(path)):
        with pytest.raises(CacheError, match=r"written by a newer primus-perf \(schema 7"):
            action()
    assert path.read_bytes() == content and sorted(os.listdir(tmp_path)) == ["c.json", "c.json.lock"]


def _bad(mutate) -> dict:
    data = entry(50).to_dict()
    mutate(data)
    return data


BAD_ENTRIES = {
    "bad-base64": lambda d: d["solution"].update(blob="@@not base64@@"),
    "empty-kind": lambda d: d.update(kind=""),
    "solution-string": lambda d: d.update(solution="algo 3"),
    "time-string": lambda d: d["times"].update(tuned_ms="fast"),
    "time-nan": lambda d: d["times"].update(tuned_ms=float("nan")),
    "problem-malformed": lambda d: d.update(problem={"m": -1}),
    "problem-list": lambda d: d.update(problem=[1, 2]),
    "device-missing": lambda d: d.pop("device"),
    "units-string": lambda d: d["device"].update(compute_units="many"),
    "versions-numbers": lambda d: d.update(versions={"cublasLt": 13}),
    "created-string": lambda d: d.update(created="yesterday"),
    "not-a-mapping": lambda d: d.clear(),
}
# values a measurement cannot have: the one line names the field
NAMED_BAD = {
    "tuned-negative": (lambda d: d["times"].update(tuned_ms=-1), "times.tuned_ms must be 0 (not measured) or"),
    "tuned-1e-300": (lambda d: d["times"].update(tuned_ms=1e-300), "times.tuned_ms"),
    "in-step-negative": (lambda d: d.update(in_step={"speedup": -1.2, "low": -1.3, "high": -1.1, "samples": 8}),
                         "in_step.speedup"),
    "in-step-outside-its-quartiles": (lambda d: d.update(in_step={"speedup": 1.5, "low": 1.0, "high": 1.2}),
                                      "in_step quartiles must hold the speedup"),
    "key-of-another-problem": (lambda d: d.update(problem_key=entry(51).problem_key), "is not its problem's key"),
    "created-1e300": (lambda d: d.update(created=1e300), "created must be a number of 0 to"),
    "units-negative": (lambda d: d["device"].update(compute_units=-5), "device.compute_units must be an int >= 0"),
    "error-negative": (lambda d: d.update(error=-0.5), "error must be a number of >= 0"),
}
BAD_ENTRIES.update({name: mutate for name, (mutate, _) in NAMED_BAD.items()})


@pytest.mark.parametrize("name", list(NAMED_BAD))
def test_a_value_no_measurement_can_have_is_named_by_its_field(tmp_path: Path, name: str) -> None:
    mutate, said = NAMED_BAD[name]
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": [entry(1).to_dict(), _bad(mutate)]}))
    seen: list[str] = []
    assert [e.problem_key for e in TuningCache(path, report_stale=seen.append).entries()] == [entry(1).problem_key]
    (line,) = seen
    assert "skipped invalid gemm entry #1" in line and said in line and "\n" not in line, line


@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_a_bad_entry_is_skipped_and_named_once_the_rest_stays_usable(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.json"
    good = [entry(1).to_dict(), entry(2).to_dict()]
    bad = _bad(BAD_ENTRIES[name]) or "not a mapping"
    path.write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": [good[0], bad, good[1]]}))
    seen: list[str] = []
    cache = TuningCache(path, report_stale=seen.append)
    for _ in range(3):
        assert {e.problem_key for e in cache.entries()} == {entry(1).problem_key, entry(2).problem_key}
    assert len(seen) == 1 and "entry #1" in seen[0], seen
    # a writer keeps the bad entry as it is (nothing is lost); merge does not carry it
    cache.put(entry(3))
    written = [json.dumps(e, sort_keys=True) for e in json.loads(path.read_text())["entries"]]
    assert json.dumps(bad, sort_keys=True) in written
    target = TuningCache(tmp_path / "t.json", report_stale=seen.append)
    assert target.merge_from(path) == 3
    assert len(json.loads(target.path.read_text())["entries"]) == 3


def test_merge_newest_created_wins_across_target_and_sources_ties_go_to_the_faster(tmp_path: Path) -> None:
    a, b, out = (TuningCache(tmp_path / n) for n in ("a.json", "b.json", "out.json"))

    def version(i: int, created: float, algo: int, tuned_ms: float = 1.0) -> CacheEntry:
        e = entry(i)
        e.created, e.solution, e.times = created, {"config": {"algo": algo}, "blob": b""}, {"tuned_ms": tuned_ms}
        return e

    out.put_many([version(1, 300.0, 1), version(2, 100.0, 2), version(4, 50.0, 4, tuned_ms=2.0)])
    a.put_many([version(1, 200.0, 11), version(2, 150.0, 12), entry(3, device=H200)])
    b.put_many([version(2, 120.0, 22), version(4, 50.0, 44, tuned_ms=1.5)])
    assert out.merge_from(a.path, b.path) == 3  # entry 2 from a, 3 from a, 4 from b (faster at a tie)
    algo = {e.problem_key: e.solution["config"]["algo"] for e in out.entries() if e.device["name"] == H100.name}
    assert algo == {entry(1).problem_key: 1, entry(2).problem_key: 12, entry(4).problem_key: 44}
    assert out.merge_from(a.path, b.path) == 0  # merging again changes nothing


def test_merge_from_a_missing_source_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="not found"):
        TuningCache(tmp_path / "out.json").merge_from(tmp_path / "nope.json")
    assert not (tmp_path / "out.json").exists()


def test_a_symlinked_cache_is_written_through_the_link_with_the_real_files_lock(tmp_path: Path) -> None:
    real = tmp_path / "shared" / "cache.json"
    real.parent.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(real)
    TuningCache(link).put(entry(1))
    TuningCache(real).put(entry(2))
    assert link.is_symlink() and len(TuningCache(link).entries()) == 2
    assert TuningCache(link)._lock.lock_file == TuningCache(real)._lock.lock_file == str(real) + ".lock"


def test_the_next_writer_removes_orphaned_temporary_files_only(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    TuningCache(path).put(entry(1))
    old = tmp_path / ".c.json.killed1.tmp"
    young = tmp_path / ".c.json.live.tmp"
    other = tmp_path / ".other.json.x.tmp"
    for f in (old, young, other):
        f.write_bytes(b"partial")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    # named by their writer: this host's killed process (gone at once), this process (live)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".c.json.{files._HOST}-{int(dead.stdout)}.x1.tmp"
    live = tmp_path / f".c.json.{files._HOST}-{os.getpid()}.x2.tmp"
    for f in (killed, live):
        f.write_bytes(b"partial")
    TuningCache(path).entries()  # a reader removes nothing
    assert old.exists() and killed.exists()
    TuningCache(path).put(entry(2))
    assert not old.exists() and not killed.exists() and young.exists() and other.exists() and live.exists()


READER = """
import os, sys, time
from primus_perf.cache.store import TuningCache
from primus_perf.base.errors import CacheError
cache, end, n = TuningCache(sys.argv[1]), time.time() + float(sys.argv[2]), 0
while time.time() < end:
    n += len(cache.entries())
print(n)
"""


def test_readers_during_writes_never_move_or_change_a_file(tmp_path: Path) -> None:
    path = str(tmp_path / "c.json")
    TuningCache(path).put(entry(9999))
    ctx = mp.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(path, w, 40)) for w in range(2)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    reader = subprocess.Popen([sys.executable, "-c", READER, path, "6"], stdout=subprocess.PIPE, text=True, env=env)
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=300)
        assert p.exitcode == 0
    out, _ = reader.communicate(timeout=120)
    assert reader.returncode == 0 and int(out) > 0
    assert not list(tmp_path.glob("*.corrupt-*"))
    assert len(TuningCache(path).entries()) == 1 + 2 * 40
