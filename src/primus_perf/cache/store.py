"""The tuning cache: one JSON file of entries, safe under concurrent writers.

An entry (:class:`CacheEntry`) records one tuned problem:

- ``kind``: "gemm" or "attention" (the store is kind-agnostic; tuners own their kinds);
- ``problem_key`` and ``problem``: ``GemmProblem``/``AttentionProblem`` ``key()`` and
  ``to_dict()``;
- ``device``: ``DeviceIdentity.to_dict()`` (name, vendor, arch, SM/CU count);
- ``versions``: the library identity, name -> version (``{"cublasLt": "13.1.0"}``,
  ``{"torch": ..., "triton": ..., "cudnn": ...}``);
- ``solution``: ``{"config": <readable dict>, "blob": <opaque bytes, base64 in the file>}``;
- ``times``: measured times of the chosen solution and the default (``tuned_ms``,
  ``default_ms``); ``error``: the chosen solution's numerical error against the fp32
  reference; ``tuner_version``; ``created`` (Unix time).

An entry is used only on the same hardware (``DeviceIdentity.same_hardware``) and with the
same library versions; :meth:`TuningCache.get` reports any other entry of that problem as
stale, once per cache object, and returns None.

File format: ``{"schema": SCHEMA_VERSION, "entries": [...]}``. Writes take a file lock
(``<path>.lock``), re-read the file so that entries other processes wrote meanwhile are
kept, write a temporary file in the same folder, fsync it and rename it over the cache: a
writer killed at any point leaves either the old or the new file, never a torn one. A file
that does not parse, or has another schema, is moved aside to
``<path>.corrupt-<timestamp>`` and reported as a :class:`~primus_perf.errors.CacheError`;
it is never overwritten.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from primus_perf.devices import DeviceIdentity
from primus_perf.errors import CacheError
from primus_perf.files import write_json

SCHEMA_VERSION = 1
LOCK_TIMEOUT_S = 120.0


@dataclass
class CacheEntry:
    kind: str
    problem_key: str
    problem: dict[str, Any]
    device: dict[str, Any]
    versions: dict[str, str]
    solution: dict[str, Any]
    times: dict[str, float] = field(default_factory=dict)
    error: float | None = None
    tuner_version: str = ""
    created: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not self.kind or not self.problem_key:
            raise ValueError("a cache entry needs a kind and a problem_key")
        blob = self.solution.get("blob")
        if isinstance(blob, str):  # as stored in the file
            self.solution = {**self.solution, "blob": base64.b64decode(blob)}
        elif blob is None:
            self.solution = {**self.solution, "blob": b""}

    @property
    def device_identity(self) -> DeviceIdentity:
        return DeviceIdentity.from_dict(self.device)

    @property
    def speedup(self) -> float | None:
        tuned, default = self.times.get("tuned_ms"), self.times.get("default_ms")
        if not tuned or not default:
            return None
        return default / tuned

    def slot(self) -> tuple:
        """Entries with the same slot replace each other: same kind, problem, hardware and
        library versions."""
        d = self.device_identity
        return (
            self.kind,
            self.problem_key,
            d.name,
            d.arch,
            d.compute_units,
            tuple(sorted(self.versions.items())),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["solution"] = {
            **self.solution,
            "blob": base64.b64encode(self.solution.get("blob") or b"").decode("ascii"),
        }
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheEntry:
        names = {f.name for f in fields(cls)}
        missing = {"kind", "problem_key", "problem", "device", "versions", "solution"} - set(data)
        if missing:
            raise ValueError(f"missing field(s) {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


def _raw_slot(data: dict[str, Any]) -> tuple:
    """``CacheEntry.slot()`` of an entry still in its stored form."""
    d = data["device"]
    return (
        data["kind"],
        data["problem_key"],
        d["name"],
        d["arch"],
        int(d["compute_units"]),
        tuple(sorted(data["versions"].items())),
    )


class TuningCache:
    """A cache file; every method reads the file afresh, so several processes can share it."""

    def __init__(self, path: str | os.PathLike, *, report_stale: Callable[[str], None] | None = None):
        self.path = Path(path)
        self._lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)
        self._stale_reported: set[tuple] = set()
        self._report_stale = report_stale or (lambda msg: warnings.warn(msg, stacklevel=3))

    # ---- reading ---------------------------------------------------------------------------

    def _read(self) -> list[CacheEntry]:
        """Entries on disk; [] for a missing file; CacheError (file moved aside) if corrupt."""
        return [CacheEntry.from_dict(e) for e in self._read_raw()]

    def _read_raw(self) -> list[dict[str, Any]]:
        """The entries on disk as plain dicts, checked enough to be turned into entries."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except IsADirectoryError:
            raise CacheError(f"tuning cache {self.path} is a directory, not a file") from None
        except OSError as exc:
            raise CacheError(f"cannot read tuning cache {self.path}: {exc.strerror}") from None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or "entries" not in doc:
                raise ValueError("not a primus-perf tuning cache")
            if doc.get("schema") != SCHEMA_VERSION:
                raise ValueError(f"schema {doc.get('schema')!r}, expected {SCHEMA_VERSION}")
            entries = doc["entries"]
            if not isinstance(entries, list):
                raise ValueError("'entries' is not a list")
            for e in entries:
                _raw_slot(e)  # every entry has the fields that identify it
            return entries
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            aside = self._move_aside()
            reason = str(exc).splitlines()[0][:120]
            raise CacheError(
                f"tuning cache {self.path} is corrupt ({reason}); kept as {aside}"
            ) from None

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            os.replace(self.path, aside)
        return aside

    def entries(self, kind: str | None = None) -> list[CacheEntry]:
        return [e for e in self._read() if kind is None or e.kind == kind]

    def get(
        self, kind: str, problem_key: str, device: DeviceIdentity, versions: dict[str, str]
    ) -> CacheEntry | None:
        """The entry for this problem on this device and library versions, else None; other
        entries of the problem are reported as stale (once)."""
        return self.select(self.entries(kind), device, versions).get(problem_key)

    def select(
        self, entries: Iterable[CacheEntry], device: DeviceIdentity, versions: dict[str, str] | None
    ) -> dict[str, CacheEntry]:
        """Problem key -> usable entry among ``entries``. ``versions=None`` skips the library
        check (for callers that compare versions themselves)."""
        usable: dict[str, CacheEntry] = {}
        for entry in entries:
            reason = self.stale_reason(entry, device, versions)
            if reason is None:
                usable[entry.problem_key] = entry
            elif entry.slot() not in self._stale_reported:
                self._stale_reported.add(entry.slot())
                self._report_stale(
                    f"stale {entry.kind} cache entry {entry.problem_key} ({reason}); not used"
                )
        return usable

    @staticmethod
    def stale_reason(
        entry: CacheEntry, device: DeviceIdentity, versions: dict[str, str] | None
    ) -> str | None:
        ident = entry.device_identity
        if not ident.same_hardware(device):
            return (
                f"tuned on {ident.name} {ident.arch} x{ident.compute_units}, running on"
                f" {device.name} {device.arch} x{device.compute_units}"
            )
        if versions is not None:
            diff = {k: (entry.versions.get(k), v) for k, v in versions.items() if entry.versions.get(k) != v}
            if diff:
                return ", ".join(f"{k} {old} -> {new}" for k, (old, new) in sorted(diff.items()))
        return None

    # ---- writing ---------------------------------------------------------------------------

    def put(self, entry: CacheEntry) -> None:
        self.put_many([entry])

    def put_many(self, new: Iterable[CacheEntry]) -> int:
        """Add or replace entries (same slot = replaced) under the lock; returns the count."""
        new = list(new)
        if not new:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self._lock:
                merged = {_raw_slot(e): e for e in self._read_raw()}
                for e in new:
                    merged[e.slot()] = e.to_dict()
                self._write(list(merged.values()))
        except Timeout:
            raise CacheError(
                f"tuning cache {self.path} stayed locked for {LOCK_TIMEOUT_S:.0f} s"
                f" (is another tuner stuck? lock file {self._lock.lock_file})"
            ) from None
        return len(new)

    def _write(self, entries: list[dict[str, Any]]) -> None:
        write_json(self.path, {"schema": SCHEMA_VERSION, "entries": entries}, fsync=True, separators=(",", ":"))

    def merge_from(self, *others: str | os.PathLike) -> int:
        """Copy every entry of other cache files into this one (newest wins per slot)."""
        incoming: dict[tuple, CacheEntry] = {}
        for other in others:
            for e in TuningCache(other).entries():
                old = incoming.get(e.slot())
                if old is None or e.created >= old.created:
                    incoming[e.slot()] = e
        return self.put_many(incoming.values())
