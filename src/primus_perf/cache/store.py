"""The tuning cache: one JSON file of entries, safe under concurrent writers.

An entry (:class:`CacheEntry`) records one tuned problem:

- ``kind``: a kind's name (``primus_perf.kinds``: its problem dict is checked against the
  kind's problem type; an entry of a kind this installation does not know needs a mapping);
- ``problem_key`` and ``problem``: the problem's ``key()`` and ``to_dict()``;
- ``device``: ``DeviceIdentity.to_dict()`` (name, vendor, arch, SM/CU count);
- ``versions``: the library identity, name -> version (``{"cublasLt": "13.1.0"}``,
  ``{"torch": ..., "triton": ..., "cudnn": ...}``);
- ``solution``: ``{"config": <readable dict>, "blob": <opaque bytes, base64 in the file>}``;
- ``times``: the tuner's measured times of the chosen solution and the default
  (``tuned_ms``, ``default_ms``: each call alone, "isolated"; for an online entry the
  medians of the calls its in-step race counted); ``error``: the chosen solution's numerical error against the fp32
  reference; ``tuner_version``; ``created`` (Unix time);
- ``in_step`` (optional): the choice confirmed inside real steps against the baseline
  the program had (``tuner.confirm``): ``speedup`` (median of per-pair ratios),
  ``low``/``high`` (their quartiles), ``samples`` (pairs), ``baseline``, ``choice``,
  ``verdict`` ("kept"; "dropped": the solution is then the baseline's, and ``times`` the
  isolated figure of the choice the step did not bear out), ``method``.
  :meth:`CacheEntry.claim` is the figure to print, saying how it was measured.

An entry is used only on the same hardware (``DeviceIdentity.same_hardware``) and with the
same library versions; :meth:`TuningCache.get` reports any other entry of that problem as
stale, once per cache object, and returns None.

File format: ``{"schema": SCHEMA_VERSION, "entries": [...]}``. The path is resolved to
the real file (a symlinked cache is written through the link; the lock belongs to the real
file). Writes take a file lock (``<real path>.lock``), re-read the file so that entries other
processes wrote meanwhile are kept, remove temporary files that killed writers left
behind, write a temporary file in the same folder, fsync it and rename it over the cache: a
writer killed at any point leaves either the old or the new file, never a torn one.

Readers never move or rewrite a file. A file that does not parse is a
:class:`~primus_perf.base.errors.CacheError`; a file of a newer schema says so and is left in
place for the newer primus-perf that wrote it. Only a writer holding the lock, after
re-reading the file under it, sets a corrupt cache aside (``<path>.corrupt-<timestamp>``)
and reports it; it never overwrites one. A file that is no cache at all (JSON of another
kind, or anything that does not begin as a cache file does) is refused and left as it is:
``cache merge package.json good.json`` never moves ``package.json``.

Each entry is validated on its own (:meth:`CacheEntry.from_dict`), against what a
measurement can be: a bad one is skipped and named once, with the field at fault (``times.
tuned_ms must be 0 (not measured) or a time of 1e-06 to 1e+07 ms, got -1``), the others stay
usable, and merge does not carry it. Checked: the fields' types; a known kind's problem,
and its ``problem_key`` is that problem's key; times are 0 or 1 ns to 3 hours; an in-step
speedup and its quartiles lie in 0.001-1000x with low <= speedup <= high; the error is
>= 0; ``created`` is a time no later than a day from now (a ``created`` of 1e300 would win
every merge); the device's compute units are >= 0.

Merge (:meth:`TuningCache.merge_from`): per slot (kind, problem, hardware, library
versions) the entry with the newest ``created`` wins, across the target and the sources;
on a tie the faster tuned time wins.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import math
import os
import re
import stat
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from primus_perf import kinds
from primus_perf.base.devices import DeviceIdentity
from primus_perf.base.errors import CacheError
from primus_perf.base.files import check_input_file, load_json, remove_orphaned_temps, write_json

SCHEMA_VERSION = 1
LOCK_TIMEOUT_S = 120.0
ORPHAN_AGE_S = 30.0  # a temporary file this old, seen under the lock, belongs to a killed writer
READ_RETRIES = 3  # a file replaced while it was read is read again
_REQUIRED = ("kind", "problem_key", "problem", "device", "versions", "solution")
ONLINE_SUFFIX = "+online"  # the tuner_version of entries online tuning wrote
MS_RANGE = (1e-6, 1e7)  # a timed call: 1 ns to about 3 hours
RATIO_RANGE = (1e-3, 1e3)  # an in-step speedup and its quartiles
FUTURE_S = 86400.0  # ``created`` at most this far ahead of the clock
_CACHE_HEAD = re.compile(rb'\s*\{\s*"schema"\s*:')  # how every cache file begins


class NotACache(ValueError):
    """A file that is no tuning cache (writers leave it as it is)."""


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
    # the choice confirmed inside real steps (``tuner.decide.Verdict.figure``), or None
    in_step: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.kind or not self.problem_key:
            raise ValueError("a cache entry needs a kind and a problem_key")
        if not isinstance(self.solution, dict):
            raise ValueError(f"solution must be a mapping, got {type(self.solution).__name__}")
        blob = self.solution.get("blob")
        if isinstance(blob, str):  # as stored in the file
            try:
                decoded = base64.b64decode(blob, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("solution blob is not valid base64") from None
            self.solution = {**self.solution, "blob": decoded}
        elif blob is None:
            self.solution = {**self.solution, "blob": b""}
        elif not isinstance(blob, bytes):
            raise ValueError(f"solution blob must be bytes or base64 text, got {type(blob).__name__}")

    def label(self) -> str:
        """The problem's label, as every command prints it (the key for a kind this
        installation does not know)."""
        try:
            return str(kinds.get(self.kind).problem_type.from_dict(self.problem))
        except (KeyError, TypeError, ValueError):
            return self.problem_key

    @property
    def device_identity(self) -> DeviceIdentity:
        return DeviceIdentity.from_dict(self.device)

    @property
    def speedup(self) -> float | None:
        """The measured times' ratio (``times``: the tuner's own measurement, isolated
        offline or sampled online; :meth:`claim` says which figure to print)."""
        tuned, default = self.times.get("tuned_ms"), self.times.get("default_ms")
        if not tuned or not default:
            return None
        return default / tuned

    @property
    def measured_by(self) -> str:
        """How ``times`` were measured: "isolated" (offline: each call alone) or "online
        samples" (the counted calls of an online tuning's race in the step)."""
        return "online samples" if self.tuner_version.endswith(ONLINE_SUFFIX) else "isolated"

    def claim(self) -> str:
        """The entry's speedup as printed, saying how it was measured: the in-step figure
        with its spread when the entry has one (``1.031x torch in the step [1.010-1.050],
        16 calls``; a choice the step did not bear out: ``torch kept: heur2 0.990x in the step
        [...]``), else the tuner's own, labeled (``1.200x isolated``)."""
        own = self.speedup
        own_text = f"{own:.3f}x {self.measured_by}" if own else f"- ({self.measured_by})"
        s = self.in_step
        if s and s.get("scope") == "step" and s.get("verdict") == "dropped":  # the final check's
            step = s.get("step_speedup")
            ran = f": the step with the cache ran {float(step):.3f}x" if _is_number(step) else ""
            return f"{s.get('baseline', 'torch')} kept{ran} ({s.get('choice', '?')} dropped by the final check)"
        if not s or s.get("speedup") is None:
            return own_text
        speedup, base = float(s["speedup"]), str(s.get("baseline", "torch"))
        spread = (f"[{float(s.get('low', speedup)):.3f}-{float(s.get('high', speedup)):.3f}],"
                  f" {2 * int(s.get('samples', 0))} calls")
        was = f" ({self.measured_by} {own:.3f}x)" if own else ""
        if s.get("verdict") == "dropped":
            return f"{base} kept: {s.get('choice', '?')} {speedup:.3f}x in the step {spread}{was}"
        return f"{speedup:.3f}x {base} in the step {spread}{was}"

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

    def rank(self) -> tuple[float, float]:
        """Merge order: the newest ``created`` wins; on a tie, the faster tuned time."""
        tuned = self.times.get("tuned_ms")
        return (self.created, -tuned if tuned is not None else -math.inf)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["solution"] = {
            **self.solution,
            "blob": base64.b64encode(self.solution.get("blob") or b"").decode("ascii"),
        }
        return data

    @classmethod
    def from_dict(cls, data: Any) -> CacheEntry:
        """An entry as stored in the file; ValueError naming what is wrong with it."""
        if not isinstance(data, dict):
            raise ValueError(f"an entry must be a mapping, got {type(data).__name__}")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        for key in ("kind", "problem_key"):
            if not isinstance(data[key], str) or not data[key]:
                raise ValueError(f"{key} must be a non-empty string, got {data[key]!r}")
        for key in ("problem", "device", "versions", "solution"):
            if not isinstance(data[key], dict):
                raise ValueError(f"{key} must be a mapping, got {type(data[key]).__name__}")
        _check_device(data["device"])
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["versions"].items()):
            raise ValueError("versions must map library names to version strings")
        times = data.get("times", {})
        if not isinstance(times, dict):
            raise ValueError(f"times must be a mapping, got {type(times).__name__}")
        for key, value in times.items():
            _check_number(f"times.{key}", value, *MS_RANGE, zero="not measured", unit=" ms")
        if data.get("error") is not None:
            _check_number("error", data["error"], 0.0, math.inf)
        if data.get("created") is not None:
            _check_number("created", data["created"], 0.0, time.time() + FUTURE_S, unit=" (Unix time, not in the future)")
        if not isinstance(data.get("tuner_version", ""), str):
            raise ValueError(f"tuner_version must be a string, got {data['tuner_version']!r}")
        _check_in_step(data.get("in_step"))
        config = data["solution"].get("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"solution config must be a mapping, got {type(config).__name__}")
        problem_type = kinds.get(data["kind"]).problem_type if data["kind"] in kinds.names() else None
        if problem_type is not None:  # a registered kind's problem dict is checked
            try:
                key = problem_type.from_dict(data["problem"]).key()
            except (TypeError, ValueError, KeyError) as exc:
                raise ValueError(f"malformed {data['kind']} problem ({str(exc).splitlines()[0][:80]})") from None
            if key != data["problem_key"]:
                raise ValueError(f"problem_key {data['problem_key'][:60]!r} is not its problem's key {key[:60]!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_number(field: str, value: Any, low: float, high: float, *, zero: str = "", unit: str = "") -> None:
    """ValueError naming ``field`` unless ``value`` is a number in [low, high] (or 0, when
    ``zero`` says what 0 means)."""
    if _is_number(value) and (low <= value <= high or (zero and value == 0)):
        return
    either = f"0 ({zero}) or " if zero else ""
    span = f">= {low:g}" if high == math.inf else f"{low:g} to {high:g}"
    raise ValueError(f"{field} must be {either}a number of {span}{unit}, got {value!r}")


def _check_in_step(in_step: Any) -> None:
    if in_step is None:
        return
    if not isinstance(in_step, dict):
        raise ValueError(f"in_step must be a mapping, got {type(in_step).__name__}")
    for key in ("speedup", "low", "high", "step_speedup"):
        if in_step.get(key) is not None:
            _check_number(f"in_step.{key}", in_step[key], *RATIO_RANGE, unit="x")
    for key in ("choice_ms", "baseline_ms"):
        if in_step.get(key) is not None:
            _check_number(f"in_step.{key}", in_step[key], *MS_RANGE, zero="not measured", unit=" ms")
    if in_step.get("samples") is not None:
        _check_number("in_step.samples", in_step["samples"], 0, 1e9)
    low, mid, high = (in_step.get(k) for k in ("low", "speedup", "high"))
    if None not in (low, mid, high) and not low <= mid <= high:
        raise ValueError(f"in_step quartiles must hold the speedup: low {low!r} <= speedup {mid!r} <= high {high!r}")


def _check_device(device: dict[str, Any]) -> None:
    if not isinstance(device.get("name"), str) or not isinstance(device.get("arch", ""), str):
        raise ValueError("device must have a name and an arch")
    units = device.get("compute_units", 0)
    if isinstance(units, bool) or not isinstance(units, int) or units < 0:
        raise ValueError(f"device.compute_units must be an int >= 0, got {units!r}")


def _describe(data: Any, index: int) -> str:
    if isinstance(data, dict):
        return f"{data.get('kind') or '?'} entry #{index} {str(data.get('problem_key') or '')[:60]}".rstrip()
    return f"entry #{index}"


@dataclass
class _Parsed:
    """A cache file as read: its valid entries, and its invalid ones (kept as they are by
    writers, so that nothing is lost, and skipped by readers)."""

    entries: list[CacheEntry] = field(default_factory=list)
    invalid: list[tuple[str, Any]] = field(default_factory=list)  # (why, raw entry)


def check_cache_file(path: str | os.PathLike) -> Path:
    """A tuning cache named to be read (a command's argument, ``build_report``'s ``cache``): a
    regular, non-empty file (:func:`~primus_perf.base.files.check_input_file`), else one UserError.
    (:class:`TuningCache` itself reads a missing or empty file as an empty cache.)"""
    return check_input_file(path, what="tuning cache")


class TuningCache:
    """A cache file; every method reads the file afresh, so several processes can share it."""

    def __init__(self, path: str | os.PathLike, *, report_stale: Callable[[str], None] | None = None):
        self.given = Path(path)
        self.path = Path(os.path.realpath(path))  # through symlinks: the file and its lock
        self._lock = FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S)
        self._reported: set[Any] = set()
        self._report = report_stale or (lambda msg: warnings.warn(msg, stacklevel=4))

    def _report_once(self, key: Any, message: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self._report(message)

    # ---- reading ---------------------------------------------------------------------------

    def _read_bytes(self) -> bytes | None:
        """The file's bytes; None when there is no file. Never blocks on a FIFO or a device:
        opened non-blocking and checked on its descriptor."""
        try:
            with open(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                    raise CacheError(f"tuning cache {self.given} is {kind}")
                head = f.read(64)
                if head.strip() and not head.lstrip().startswith(b"{"):
                    return head  # not JSON: reported without reading gigabytes
                return head + f.read()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise CacheError(f"tuning cache {self.given} is a directory") from None
        except OSError as exc:
            raise CacheError(f"cannot read tuning cache {self.given}: {exc.strerror}") from None

    def _parse(self, raw: bytes) -> list[Any]:
        """The raw entries of a file's bytes; ValueError for a file that is not a cache,
        CacheError for one of a newer schema."""
        if not raw.strip():
            return []  # an empty file (e.g. made by mktemp): an empty cache
        try:
            doc = load_json(raw)
        except ValueError:
            if _CACHE_HEAD.match(raw):
                raise  # a cache file, corrupt
            raise NotACache("not a primus-perf tuning cache") from None
        if not isinstance(doc, dict) or "entries" not in doc:
            raise NotACache("not a primus-perf tuning cache")
        schema = doc.get("schema")
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
            raise CacheError(
                f"tuning cache {self.given} was written by a newer primus-perf (schema {schema}; this one"
                f" reads {SCHEMA_VERSION}); left in place"
            )
        if schema != SCHEMA_VERSION:
            raise ValueError(f"schema {schema!r}, expected {SCHEMA_VERSION}")
        if not isinstance(doc["entries"], list):
            raise ValueError("'entries' is not a list")
        return doc["entries"]

    def _load(self) -> _Parsed:
        """The file's entries, each validated; ValueError (with the reason) for a corrupt
        file. A file replaced while it was read is read again."""
        error: Exception | None = None
        for _ in range(READ_RETRIES):
            before = _identity(self.path)
            raw = self._read_bytes()
            if raw is None:
                return _Parsed()
            try:
                items = self._parse(raw)
                break
            except (ValueError, UnicodeDecodeError) as exc:
                error = exc
                if _identity(self.path) == before:
                    cls = NotACache if isinstance(exc, NotACache) else ValueError
                    raise cls(str(exc).splitlines()[0][:120]) from None
        else:
            raise ValueError(str(error).splitlines()[0][:120])
        parsed = _Parsed()
        for i, item in enumerate(items):
            try:
                parsed.entries.append(CacheEntry.from_dict(item))
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                why = f"skipped invalid {_describe(item, i)} in {self.given}: {str(exc).splitlines()[0][:120]}"
                parsed.invalid.append((why, item))
                self._report_once(("invalid", why), why)
        return parsed

    def _read(self) -> list[CacheEntry]:
        """Valid entries on disk; [] for a missing file; CacheError for a corrupt one (left
        where it is: readers never move files)."""
        try:
            return self._load().entries
        except NotACache as exc:
            raise CacheError(f"{self.given} is {exc}") from None
        except ValueError as exc:
            raise CacheError(f"tuning cache {self.given} is corrupt ({exc})") from None

    def entries(self, kind: str | None = None) -> list[CacheEntry]:
        return [e for e in self._read() if kind is None or e.kind == kind]

    def get(
        self, kind: str, problem_key: str, device: DeviceIdentity, versions: dict[str, str]
    ) -> CacheEntry | None:
        """The entry for this problem on this device and library versions, else None; other
        entries of the problem are reported as stale (once)."""
        mine = (e for e in self.entries(kind) if e.problem_key == problem_key)
        return self.select(mine, device, versions).get(problem_key)

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
            else:
                self._report_once(
                    entry.slot(), f"stale {entry.kind} cache entry {entry.problem_key} ({reason}); not used"
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
        self._update(lambda slots: [slots.__setitem__(e.slot(), e) for e in new])
        return len(new)

    def merge_from(self, *others: str | os.PathLike) -> int:
        """Copy the entries of other cache files into this one: per slot, the newest
        ``created`` wins across this file and the others (a tie: the faster tuned time).
        Invalid entries of the sources are skipped (and named). Returns how many entries
        were taken from the sources. CacheError for a missing or unreadable source."""
        incoming: dict[tuple, CacheEntry] = {}
        for other in others:
            source = TuningCache(other, report_stale=self._report)
            if not source.path.exists():
                raise CacheError(f"tuning cache to merge from not found: {other}")
            for e in source.entries():
                old = incoming.get(e.slot())
                if old is None or e.rank() > old.rank():
                    incoming[e.slot()] = e
        taken = 0

        def merge(slots: dict[tuple, CacheEntry]) -> None:
            nonlocal taken
            for slot, e in incoming.items():
                old = slots.get(slot)
                if old is None or e.rank() > old.rank():
                    slots[slot] = e
                    taken += 1

        self._update(merge)
        return taken

    def _update(self, change: Callable[[dict[tuple, CacheEntry]], Any]) -> None:
        """Under the lock: read the file, apply ``change`` to its entries by slot, write it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(f"cannot write tuning cache {self.given}: {exc.strerror}") from None
        try:
            with self._lock:
                remove_orphaned_temps(self.path, older_than_s=ORPHAN_AGE_S)
                parsed = self._load_for_writing()
                slots = {e.slot(): e for e in parsed.entries}
                change(slots)
                kept_invalid = [raw for _, raw in parsed.invalid]  # nothing is lost
                self._write([e.to_dict() for e in slots.values()] + kept_invalid)
        except Timeout:
            raise CacheError(
                f"tuning cache {self.given} stayed locked for {LOCK_TIMEOUT_S:.0f} s"
                f" (is another tuner stuck? lock file {self._lock.lock_file})"
            ) from None
        except OSError as exc:  # the lock file cannot be made (read-only folder, ...)
            raise CacheError(f"cannot write tuning cache {self.given}: {exc.strerror}") from None

    def _load_for_writing(self) -> _Parsed:
        """The file as a writer holding the lock sees it; a corrupt cache (read again under
        the lock) is set aside and reported, never overwritten; a file that is no cache is
        refused and left as it is."""
        try:
            return self._load()
        except NotACache as exc:
            raise CacheError(f"{self.given} is {exc}; left as it is (name a tuning cache to write)") from None
        except ValueError as exc:
            aside = self._move_aside()
            raise CacheError(
                f"tuning cache {self.given} is corrupt ({exc}); kept as {aside}, the next write starts a new one"
            ) from None

    def _move_aside(self) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path, aside)
        return aside

    def _write(self, entries: list[dict[str, Any]]) -> None:
        write_json(self.path, {"schema": SCHEMA_VERSION, "entries": entries}, fsync=True, separators=(",", ":"))


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is replaced or rewritten."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
