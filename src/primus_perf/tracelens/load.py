"""Load a Kineto trace (``.json`` or ``.json.gz``, CUDA or ROCm) into columns.

Both layouts of the Chrome trace format are read: an object with a ``traceEvents`` list
(and ``deviceProperties``, called ``computeProperties`` by Kineto before 2021), and a file
that is one JSON array of events (what Kineto wrote in 2020; the closing ``]`` optional).

The cost of reading big traces is Python objects per event, so the loader decodes with
typed msgspec Structs that keep only the fields the analyses use (unknown keys are
skipped by the decoder, shape lists stay raw JSON until an op that needs them asks), then
turns the events into narrow numpy columns with interned names and drops the Structs.

Memory is bounded whatever the file size: the (gzip-decompressed) text is read as a
stream and the ``traceEvents`` array is decoded ``CHUNK_BYTES`` at a time; only the
columns of the kept events stay (duration events of known categories and launch-flow
starts), in int32 where their values fit.

Tolerance: each chunk is decoded strictly first (the fast path); when a field has an
unexpected type (numbers or hex written as strings, ``"616"``, ``"0x0"``; floats or nulls
where integers are expected) only that chunk is decoded again loosely, and each such value
is converted (``"0x0"`` -> 0) or dropped for its event. The counts are reported once per
trace (:attr:`RawTrace.notes`). A file is rejected only when it is not a trace: not
found, bad gzip, truncated or malformed JSON, not UTF-8, no ``traceEvents`` list; each
gives one :class:`~primus_perf.base.errors.TraceError` line naming the file.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import multiprocessing
import os
import re
import sys
import zlib
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from primus_perf.base.errors import TraceError
from primus_perf.tracelens.arrays import member, unique

# ---- event kinds (a small int per event; "cat" spellings of CUDA, ROCm and 2021 traces) --

KIND_OTHER, KIND_CPU_OP, KIND_ANNOTATION, KIND_RUNTIME, KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET = range(7)
KIND_GPU_ANNOTATION, KIND_FLOW_START = 7, 8

CAT_KIND: dict[str, int] = {
    "cpu_op": KIND_CPU_OP,
    "Operator": KIND_CPU_OP,  # Kineto 2021
    "operator": KIND_CPU_OP,
    "user_annotation": KIND_ANNOTATION,
    "cuda_runtime": KIND_RUNTIME,
    "cuda_driver": KIND_RUNTIME,
    "hip_runtime": KIND_RUNTIME,
    "Runtime": KIND_RUNTIME,  # Kineto 2021
    "runtime": KIND_RUNTIME,
    "kernel": KIND_KERNEL,
    "Kernel": KIND_KERNEL,
    "gpu_memcpy": KIND_MEMCPY,
    "Memcpy": KIND_MEMCPY,
    "gpu_memset": KIND_MEMSET,
    "Memset": KIND_MEMSET,
    "gpu_user_annotation": KIND_GPU_ANNOTATION,
}
# duration events the analyses need nothing from: Python frames (with_stack), the profiler's
# own spans and overhead, CPU instants, synchronization waits drawn on the GPU streams.
# Any other category not in CAT_KIND (another accelerator's device events, CUPTI range
# profiler records, ...) is counted and named in a note: its time is in no figure.
IGNORED_CATS = frozenset({"python_function", "Trace", "overhead", "cpu_instant_event", "cuda_sync",
                          "external_correlation", "Python"})
# host launch -> GPU op flows: CUDA and ROCm ("ac2g"), older names; only their starts are kept
FLOW_CATS = frozenset({"ac2g", "async_gpu", "async", "async_cpu_to_gpu"})
GPU_KINDS = (KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET)
# ``args.rank``: the rank of each event in a file that holds several (TraceLens's trace fusion
# writes it on every event); a piece's column is read when every RANK_PROBE-th event's args
# show one (-1 otherwise: an event without a rank takes its thread's, ``ranks.event_ranks``)
INT_ARGS = ("correlation", "stream", "device", "seq", "rank")
RANK_PROBE = 61
NUM_ARGS = ("registers", "shared", "blocks_per_sm", "occupancy", "alloc", "total", "device_type", "device_id")


class _Args(msgspec.Struct, gc=False, frozen=True):
    # -1: absent (an explicit null is not an int: its chunk takes the tolerant decode)
    correlation: int = -1
    stream: int = -1
    device: int = -1
    seq: int = msgspec.field(name="Sequence number", default=-1)
    rank: int = -1
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))
    strides: msgspec.Raw = msgspec.field(name="Input Strides", default=msgspec.Raw(b""))
    concrete: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw(b""))
    # a kernel's launch resources, a memory event's sizes (NaN: absent)
    grid: msgspec.Raw = msgspec.Raw(b"")
    block: msgspec.Raw = msgspec.Raw(b"")
    registers: float = msgspec.field(name="registers per thread", default=math.nan)
    shared: float = msgspec.field(name="shared memory", default=math.nan)
    blocks_per_sm: float = msgspec.field(name="blocks per SM", default=math.nan)
    occupancy: float = msgspec.field(name="est. achieved occupancy %", default=math.nan)
    alloc: float = msgspec.field(name="Bytes", default=math.nan)
    total: float = msgspec.field(name="Total Allocated", default=math.nan)
    device_type: float = msgspec.field(name="Device Type", default=math.nan)
    device_id: float = msgspec.field(name="Device Id", default=math.nan)


_NO_ARGS = _Args()


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    args: _Args = _NO_ARGS


class _LooseArgs(msgspec.Struct, gc=False):
    """The same fields, any JSON type (the tolerant decode)."""

    correlation: Any = None
    stream: Any = None
    device: Any = None
    seq: Any = msgspec.field(name="Sequence number", default=None)
    rank: Any = None
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))
    strides: msgspec.Raw = msgspec.field(name="Input Strides", default=msgspec.Raw(b""))
    concrete: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw(b""))
    grid: msgspec.Raw = msgspec.Raw(b"")
    block: msgspec.Raw = msgspec.Raw(b"")
    registers: Any = msgspec.field(name="registers per thread", default=None)
    shared: Any = msgspec.field(name="shared memory", default=None)
    blocks_per_sm: Any = msgspec.field(name="blocks per SM", default=None)
    occupancy: Any = msgspec.field(name="est. achieved occupancy %", default=None)
    alloc: Any = msgspec.field(name="Bytes", default=None)
    total: Any = msgspec.field(name="Total Allocated", default=None)
    device_type: Any = msgspec.field(name="Device Type", default=None)
    device_id: Any = msgspec.field(name="Device Id", default=None)


class _LooseEvent(msgspec.Struct, gc=False):
    ph: Any = ""
    cat: Any = ""
    name: Any = ""
    pid: Any = 0
    tid: Any = 0
    ts: Any = 0.0
    dur: Any = 0.0
    id: Any = None
    args: msgspec.Raw = msgspec.Raw(b"")


class _Header(msgspec.Struct, gc=False):
    """The top-level fields besides the events."""

    traceEvents: msgspec.Raw = msgspec.Raw(b"")
    deviceProperties: list[dict[str, Any]] | None = None
    computeProperties: list[dict[str, Any]] | None = None  # what Kineto called them before 2021
    distributedInfo: dict[str, Any] | None = None
    roctracer_version: Any = None


_HEADER = msgspec.json.Decoder(_Header)
_STRICT = msgspec.json.Decoder(list[_Event])
_LOOSE = msgspec.json.Decoder(list[_LooseEvent])
_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_LOOSE_EVENT = msgspec.json.Decoder(_LooseEvent)
_LOOSE_ARGS = msgspec.json.Decoder(_LooseArgs)
CHUNK_BYTES = 16 << 20  # events are decoded and turned into columns this many bytes at a time
READ_BYTES = 16 << 20  # bytes read from the file at a time
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")
# a \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or one of those not after the first
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                             rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*')
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_JOINS = 4  # pieces joined after a cut that fell inside a string, before the text is called malformed


@dataclass
class ShapeArgs:
    """An op's recorded inputs, decoded on demand from the raw JSON."""

    dims: list[Any]
    types: list[Any]
    strides: list[Any]
    concrete: list[Any]


@dataclass
class RawTrace:
    """One trace as columns: one row per kept duration event ("X") or launch-flow start."""

    path: str
    kind: np.ndarray  # int8 KIND_*
    name: np.ndarray  # int32 code into ``names``
    names: list[str]
    thread: np.ndarray  # int32 code of the event's (pid, tid)
    ts: np.ndarray  # float64, microseconds
    dur: np.ndarray  # float64, microseconds
    correlation: np.ndarray  # int32/int64, -1 when absent (for flows: the flow id)
    stream: np.ndarray  # int32/int64, -1 when absent
    device: np.ndarray  # int32/int64, -1 when absent
    seq: np.ndarray  # int32/int64, -1 when absent
    shape: np.ndarray  # int32 code into ``shape_values``, -1 for events without recorded inputs
    shape_values: list[bytes]  # raw JSON of dims, types, strides, concrete, joined by a NUL byte
    # per row, ``args.rank`` (-1 absent); None when no event records one (a trace of one rank)
    event_rank: np.ndarray | None = None
    threads: list[tuple[int | str, int | str]] = field(default_factory=list)  # (pid, tid) of each ``thread`` code
    device_properties: list[dict[str, Any]] = field(default_factory=list)
    distributed: dict[str, Any] = field(default_factory=dict)
    platform: str = "cuda"  # "cuda" or "rocm"
    fixes: Counter = field(default_factory=Counter)  # (field, "converted ..."/"dropped ...") -> count
    unread: Counter = field(default_factory=Counter)  # category -> duration events not read (not ignorable)
    dropped: Counter = field(default_factory=Counter)  # reason -> events dropped (out of range, duplicated)
    resources: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=RESOURCE_COLUMNS))
    memory: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=MEMORY_COLUMNS))

    @property
    def has_shapes(self) -> bool:
        return bool(self.shape_values)

    def __len__(self) -> int:
        return len(self.kind)

    def shape_args(self, code: int) -> ShapeArgs | None:
        """The recorded inputs for a ``shape`` code (None for -1)."""
        if code < 0:
            return None
        cache = self.__dict__.setdefault("_shape_args", {})
        if code not in cache:
            values = [_json_or_empty(b) for b in self.shape_values[code].split(_SEP)]
            # each is a list, one item per input; anything else was not written by torch.profiler
            args = ShapeArgs(*(v if isinstance(v, list) else [] for v in values))
            for i, d in enumerate(args.dims):  # no tensor has more elements than any memory holds
                if int_dims(d) and not (min(d) >= 0 and math.prod(d) <= MAX_ELEMENTS):
                    args.dims[i] = []
                    self.fixes[("Input Dims", "dropped out-of-range")] += 1
            cache[code] = args
        return cache[code]

    @property
    def rank(self) -> int | None:
        r = self.distributed.get("rank")
        return int(r) if isinstance(r, int) else None

    @property
    def notes(self) -> list[str]:
        """One line per kind of value the tolerant decode converted or dropped."""
        return fix_notes(self.fixes)


def fix_notes(fixes: Counter) -> list[str]:
    """``converted 1,234 string-typed `args.bytes` values`` lines, largest count first."""
    out = []
    for (field_name, what), n in fixes.most_common():
        verb, _, kind = what.partition(" ")
        out.append(f"{verb} {n:,} {kind} `{field_name}` value(s) for their events")
    return out


def dropped_notes(dropped: Counter) -> list[str]:
    """One line: the events the loader dropped and why (none: no line)."""
    if not dropped:
        return []
    return [f"dropped {sum(dropped.values()):,} event(s): " + "; ".join(f"{n:,} {why}" for why, n in dropped.most_common())]


def unread_notes(unread: Counter) -> list[str]:
    """One line naming the categories of duration events the analyzer does not read, if any."""
    if not unread:
        return []
    what = ", ".join(f"{n:,} `{cat}`" for cat, n in unread.most_common())
    return [f"not read: {what} duration event(s), of categories unknown to the analyzer (another accelerator's "
            "device events, range profiler records, ...): their time is in no figure"]


def int_dims(d: Any) -> bool:
    """Whether a recorded input is a tensor's dims: a non-empty list of ints."""
    return isinstance(d, list) and bool(d) and all(type(x) is int for x in d)


def _json_or_empty(b: bytes) -> Any:
    if not b:
        return []
    try:
        return msgspec.json.decode(b)
    except msgspec.DecodeError:
        return []


# ---------------------------------------------------------------------------- reading


def _blocks(path: str | Path) -> Iterator[bytes]:
    """The uncompressed bytes of a trace file, ``READ_BYTES`` at a time (gzip detected by its
    magic number); unreadable files and bad gzip data give one TraceError line."""
    p = Path(path)
    try:
        f = open(p, "rb")  # noqa: SIM115 (closed below; wrapped by gzip when compressed)
    except FileNotFoundError:
        raise TraceError(f"trace not found: {p}") from None
    except IsADirectoryError:
        raise TraceError(f"{p} is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from None
    with f:
        try:
            stream: Any = gzip.GzipFile(fileobj=f) if f.read(2) == b"\x1f\x8b" else f
            f.seek(0)
            while block := stream.read(READ_BYTES):
                yield block
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            raise TraceError(f"{p}: bad gzip data ({exc})") from None
        except OSError as exc:
            raise TraceError(f"cannot read trace {p}: {exc}") from None


def read_bytes(path: str | Path) -> bytes:
    """The uncompressed bytes of a (small) trace file."""
    return b"".join(_blocks(path))


def _header(raw: bytes, path: str) -> _Header:
    if not raw.strip():
        raise TraceError(f"{path}: empty file")
    try:
        return _HEADER.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: not a Kineto trace ({exc})") from None
    except msgspec.DecodeError as exc:
        what = "truncated" if "truncated" in str(exc).lower() else "malformed"
        raise TraceError(f"{path}: {what} JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text at byte {exc.start}") from None


def _events_error(path: str, exc: Exception) -> TraceError:
    if isinstance(exc, UnicodeDecodeError):
        return TraceError(f"{path}: trace events are not UTF-8 text")
    return TraceError(f"{path}: malformed trace events ({exc})")


def _split_tail(rest: bytes, path: str) -> tuple[bytes, bytes]:
    """The end of the events array in the last bytes of the file: (events, what follows
    the closing ``]``). Candidates are tried from the end: the tail must close the object
    and the events before it must be a JSON array (else the error of the events before the
    earliest candidate that closes the object, as the decoder states it)."""
    stripped = rest.rstrip()
    if not stripped.endswith(b"}"):
        raise TraceError(f"{path}: truncated JSON (the trace does not end with '}}')")
    pos = len(stripped)
    tries = 0
    error: Exception | None = None
    while tries < 64:
        pos = stripped.rfind(b"]", 0, pos)
        if pos < 0:
            break
        tail = stripped[pos + 1:]
        t = tail.lstrip()
        if t == b"}" or t.startswith(b","):
            try:
                msgspec.json.decode(b"{" + t[1:] if t.startswith(b",") else b"{}")
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
                pass
            else:
                body = stripped[:pos]
                try:
                    _decode_piece(b"[" + body + b"]", Counter())
                    return body, tail
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    error = exc
                except UnicodeDecodeError as exc:
                    raise _events_error(path, exc) from None
        tries += 1
    raise _events_error(path, error) if error is not None else \
        TraceError(f"{path}: malformed trace events (the traceEvents array is not closed)")


def _last_boundary(buf: bytearray) -> tuple[int, int] | None:
    """Positions of the ``}`` and ``{`` of the last ``}, {`` between two events in ``buf``."""
    pos = len(buf)
    while True:
        close = buf.rfind(b"}", 0, pos)
        if close < 0:
            return None
        m = _BOUNDARY.match(buf, close)
        if m is not None:
            return close, m.end() - 1
        pos = close


class _Reader:
    """Split the text of a trace into its header and ``traceEvents`` pieces, streaming."""

    def __init__(self, path: str | Path, chunk_bytes: int) -> None:
        self.path = str(path)
        self.blocks = _blocks(path)
        self.chunk = chunk_bytes
        self.prefix = b""
        self.tail = b""
        self.gap = b","
        self.array = False  # the file is one JSON array of events (no header)

    def pieces(self, spans: bool = False) -> Iterator[bytes | memoryview | _Span]:
        """The events array as JSON arrays of whole events, about ``chunk_bytes`` each;
        ``prefix`` and ``tail`` are set once it is exhausted. Each piece is cut after the
        last event boundary of the text read so far, and bracketed in place (the bytes
        between two events become ``]`` and ``[``), so the text is copied once. With
        ``spans``, an uncompressed file's pieces are given by their place in the file
        (:class:`_Span`), read by whoever decodes them; only the text around each cut and
        the end of the file are read here."""
        buf = bytearray()
        key = None
        read = 0  # bytes of the file read so far
        for block in self.blocks:
            buf += block
            read += len(block)
            if not buf.strip():
                continue
            if buf.lstrip()[:1] == b"[":  # the JSON Array Format: the events are the whole file
                self.array = True
                break
            key = _EVENTS_KEY.search(buf)
            if key is not None:
                break
        if self.array:
            self.prefix = b""
        elif key is None:
            _header(bytes(buf), self.path)  # raises what is wrong (empty, malformed, ...)
            raise TraceError(f"{self.path}: not a Kineto trace (no traceEvents)")
        else:
            self.prefix = bytes(buf[:key.start()])
            del buf[:key.end()]
        while not buf.strip():
            block = next(self.blocks, None)
            if block is None:
                raise TraceError(f"{self.path}: truncated JSON (nothing after traceEvents)")
            buf += block
            read += len(block)
        i = len(buf) - len(buf.lstrip())
        if buf[i:i + 1] != b"[":
            raise TraceError(f"{self.path}: not a Kineto trace (traceEvents is not a list)")
        del buf[:i]  # keep the "[": every piece starts with one
        if spans and self.plain:
            start = read - len(buf) + 1  # the first event's place in the file
            del buf
            self.blocks.close()
            yield from self._spans(start)
            return
        for block in self.blocks:
            buf += block
            if len(buf) < self.chunk:
                continue
            cut = _last_boundary(buf)
            if cut is None:
                continue
            close, open_ = cut
            self.gap = bytes(buf[close + 1:open_])  # the text between the two events, as written
            buf[close + 1] = 0x5D  # "]"
            yield memoryview(buf)[:close + 2]
            rest = bytearray(b"[")
            rest += memoryview(buf)[open_:]
            buf = rest
        if self.array:
            body = _array_body(bytes(buf[1:]), self.path)
        else:
            body, self.tail = _split_tail(bytes(buf[1:]), self.path)
        del buf
        if body.strip():
            yield b"[" + body + b"]"

    @property
    def plain(self) -> bool:
        """Whether the file is uncompressed (its pieces can be read by their place in it)."""
        with open(self.path, "rb") as f:
            return f.read(2) != b"\x1f\x8b"

    def _spans(self, start: int) -> Iterator[bytes | _Span]:
        """The pieces of an uncompressed file from ``start`` (the first event): each cut at the
        first event boundary ``chunk`` bytes on, found by reading the text there; the last
        piece (up to two chunks) read here, as :meth:`pieces` ends."""
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            while start + 2 * self.chunk < size:
                at = start + self.chunk
                f.seek(at)
                window, m = b"", None
                while m is None and (more := f.read(SPAN_WINDOW)):
                    window += more
                    m = _BOUNDARY.search(window)
                if m is None:  # no boundary before the end: the rest is one piece
                    break
                self.gap = window[m.start() + 1:m.end() - 1]
                yield _Span(self.path, start, at + m.start() + 1)
                start = at + m.end() - 1
            f.seek(start)
            rest = f.read()
        if self.array:
            body = _array_body(rest, self.path)
        else:
            body, self.tail = _split_tail(rest, self.path)
        del rest
        if body.strip():
            yield b"[" + body + b"]"

    def header(self) -> _Header:
        if self.array:
            return _Header()
        return _header(self.prefix + b'"traceEvents": []' + self.tail, self.path)


SPAN_WINDOW = 1 << 16  # bytes read at a time to find the event boundary at a cut


class _Span:
    """A piece of the events array of an uncompressed file, by its place there: whoever
    decodes it reads it (a helper process: the text is not sent between processes)."""

    __slots__ = ("end", "path", "start")

    def __init__(self, path: str, start: int, end: int) -> None:
        self.path, self.start, self.end = path, start, end

    def text(self) -> bytearray:
        """``[`` + the events + ``]``, as the other pieces are."""
        n = self.end - self.start
        buf = bytearray(n + 2)
        buf[0], buf[-1] = 0x5B, 0x5D
        view = memoryview(buf)[1:-1]
        got = 0
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self.start)
                while got < n and (k := f.readinto(view[got:])):
                    got += k
        except OSError as exc:  # removed or replaced while it was read
            raise TraceError(f"cannot read trace {self.path}: {exc.strerror or exc}") from None
        finally:
            view.release()
        if got < n:
            raise TraceError(f"{self.path}: the file became shorter while it was read")
        return buf


def _text(piece: bytes | memoryview | _Span) -> bytes | memoryview | bytearray:
    return piece.text() if isinstance(piece, _Span) else piece


def _array_body(rest: bytes, path: str) -> bytes:
    """The events of a file in the JSON Array Format (after its ``[``): the closing ``]`` is
    optional there (a profiler that stopped early leaves it out), a trailing comma too."""
    body = rest.rstrip()
    if body.endswith(b"]"):
        body = body[:-1].rstrip()
    elif not body.rstrip(b",").rstrip().endswith(b"}") and body.strip():
        raise TraceError(f"{path}: truncated JSON (the event array ends inside an event)")
    return body.rstrip(b",").rstrip()


# ---------------------------------------------------------------------------- tolerant decode


def _as_int(v: Any, name: str, fixes: Counter) -> int | None:
    """An integer field's value: ints as they are; numbers and hex written as strings and
    integral floats converted; anything else (null included) dropped. Counted in ``fixes``."""
    if type(v) is int:
        if _INT64[0] <= v <= _INT64[1]:
            return v
        fixes[(name, "dropped out-of-range")] += 1
        return None
    if v is None:
        return None
    if isinstance(v, str):
        try:
            out = int(v.strip(), 0)
        except ValueError:
            try:
                out = int(v.strip())  # "0616": int(..., 0) rejects leading zeros
            except ValueError:
                fixes[(name, "dropped non-numeric string-typed")] += 1
                return None
        if _INT64[0] <= out <= _INT64[1]:
            fixes[(name, "converted string-typed")] += 1
            return out
        fixes[(name, "dropped out-of-range")] += 1
        return None
    if isinstance(v, float) and v.is_integer() and _INT64[0] <= v <= _INT64[1]:
        fixes[(name, "converted float-typed")] += 1
        return int(v)
    fixes[(name, f"dropped {type(v).__name__}-typed")] += 1
    return None


def _as_float(v: Any, name: str, fixes: Counter) -> float:
    if type(v) is float or type(v) is int:
        if v == v and abs(v) < 1e300:
            return float(v)
    elif isinstance(v, str):
        try:
            out = float(v)
            if out == out and abs(out) < 1e300:
                fixes[(name, "converted string-typed")] += 1
                return out
        except ValueError:
            pass
    if v is None:
        return 0.0
    fixes[(name, f"dropped {type(v).__name__}-typed")] += 1
    return math.nan


def _as_num(v: Any, name: str, fixes: Counter) -> float:
    """An optional number (a launch resource, a memory event's size): NaN when absent."""
    return math.nan if v is None else _as_float(v, name, fixes)


def _as_str(v: Any, name: str, fixes: Counter) -> str:
    if isinstance(v, str):
        return v
    if v is None:
        return ""
    fixes[(name, f"dropped {type(v).__name__}-typed")] += 1
    return ""


def _as_ident(v: Any, name: str, fixes: Counter) -> int | str:
    if isinstance(v, (int, str)) and not isinstance(v, bool):
        return v
    fixes[(name, f"dropped {type(v).__name__}-typed")] += 1
    return 0


def _or_absent(v: int | None) -> int:
    return -1 if v is None else v


def _tighten(ev: _LooseEvent, fixes: Counter) -> _Event:
    """A loosely decoded event as a strict one (see :func:`_as_int`)."""
    args = _NO_ARGS
    if ev.args:
        try:
            la = _LOOSE_ARGS.decode(ev.args)
        except (msgspec.DecodeError, msgspec.ValidationError):
            fixes[("args", "dropped non-object")] += 1
        else:
            args = _Args(*(_or_absent(_as_int(getattr(la, f), f"args.{_ARG_LABEL.get(f, f)}", fixes)) for f in INT_ARGS),
                         dims=la.dims, types=la.types, strides=la.strides, concrete=la.concrete, grid=la.grid,
                         block=la.block, **{f: _as_num(getattr(la, f), f"args.{f}", fixes) for f in NUM_ARGS})
    ident = ev.id if isinstance(ev.id, (int, str)) and not isinstance(ev.id, bool) else None
    return _Event(ph=_as_str(ev.ph, "ph", fixes), cat=_as_str(ev.cat, "cat", fixes),
                  name=_as_str(ev.name, "name", fixes), pid=_as_ident(ev.pid, "pid", fixes),
                  tid=_as_ident(ev.tid, "tid", fixes), ts=_as_float(ev.ts, "ts", fixes),
                  dur=_as_float(ev.dur, "dur", fixes), id=ident, args=args)


_ARG_LABEL = {"seq": "Sequence number"}


def _decode_piece(text: bytes | memoryview, fixes: Counter) -> list[_Event]:
    """A JSON array of events: strictly; on a type error, loosely (one pass), else event by
    event; a string with a lone UTF-16 surrogate escape (``"\\ud800"``: no character) is
    read with U+FFFD in its place."""
    try:
        return _STRICT.decode(text)
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError:
        text, n = _LONE_SURROGATE.subn(rb"\\ufffd", bytes(text))
        if not n:
            raise
        fixes[("string", "replaced lone-surrogate")] += n
        return _decode_piece(text, fixes)
    except RecursionError:
        raise msgspec.DecodeError(f"nested more than {sys.getrecursionlimit()} levels deep") from None
    try:
        loose = _LOOSE.decode(text)
    except msgspec.ValidationError:  # an event that is not an object
        loose = []
        for item in _RAW_ITEMS.decode(text):
            try:
                loose.append(_LOOSE_EVENT.decode(item))
            except msgspec.ValidationError:
                fixes[("event", "dropped non-object")] += 1
    return [_tighten(ev, fixes) for ev in loose]


# ---------------------------------------------------------------------------- columns


def load(path: str | Path, chunk_bytes: int = CHUNK_BYTES, workers: int = 1) -> RawTrace:
    """Read and decode one trace file into a :class:`RawTrace` (see the module docstring);
    ``workers`` > 1: the pieces of a big file are decoded in that many processes (the same
    result)."""
    reader = _Reader(path, chunk_bytes)
    builder = _ColumnBuilder()
    p = str(path)
    carry, gap, error, joined = b"", b"", None, 0
    for piece, piece_gap, part in _pieces(reader, workers):
        if carry:  # the last cut fell inside a string: join the pieces as written and decode here
            joined += 1
            if joined > _MAX_JOINS:  # no string is that long: the JSON is malformed
                raise _events_error(p, error or ValueError("malformed"))
            piece, carry, part = carry[:-1] + gap + bytes(_text(piece)[1:]), b"", None
        try:
            if part is not None:
                columns = part.result()
                if columns is not None:
                    builder.merge(columns)
                    continue
                raise msgspec.DecodeError("a cut inside a string")
            events = _decode_piece(_text(piece), builder.fixes)
        except msgspec.DecodeError as exc:
            carry, gap, error = bytes(_text(piece)), piece_gap, exc
            continue
        except (msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise _events_error(p, exc) from None
        del piece
        joined = 0
        builder.add(events)
    if carry:
        try:  # the real error, where a helper process only said the piece did not parse
            _decode_piece(carry, Counter())
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            error = exc
        raise _events_error(p, error or ValueError("malformed"))
    rt = builder.finish(reader.header(), p)
    del builder
    if len(rt) >= TRIM_EVENTS:
        trim_heap()
    return rt


TRIM_EVENTS = 1_000_000  # events from which the decoding's freed heap is handed back


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing): decoding leaves hundreds of MB freed but held, which the analysis after it
    would otherwise add to (a 1.06 GB trace: 0.65 -> 0.54 GB peak RSS)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _pieces(reader: _Reader, workers: int) -> Iterator[tuple[bytes | memoryview | _Span, bytes, Future | None]]:
    """(piece, the text after it, the future of its columns) in file order: from the third
    piece on, with ``workers`` > 1, each piece is decoded in a pool of processes, a few
    pieces ahead (None: decode it here). An uncompressed file's pieces are read by the
    helper processes themselves (:class:`_Span`): this one only merges their columns."""
    pool: ProcessPoolExecutor | None = None
    ahead: deque[tuple[bytes | _Span, bytes, Future]] = deque()
    try:
        for i, piece in enumerate(reader.pieces(spans=workers > 1)):
            if pool is None and workers > 1 and i >= 2:
                pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
            if pool is None:
                yield piece, reader.gap, None
                continue
            piece = piece if isinstance(piece, _Span) else bytes(piece)
            ahead.append((piece, reader.gap, pool.submit(_piece_columns, piece)))
            if len(ahead) > 2 * workers:
                yield ahead.popleft()
        while ahead:
            yield ahead.popleft()
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def _piece_columns(piece: bytes | _Span) -> _ColumnBuilder | None:
    """One piece as columns of their own (a helper process's work; a :class:`_Span` is read
    from the file here); None when it does not parse (a cut inside a string: the caller
    joins it with the next piece)."""
    b = _ColumnBuilder()
    try:
        events = _decode_piece(_text(piece), b.fixes)
    except msgspec.DecodeError:
        return None
    b.add(events)
    return b


def _narrow(a: np.ndarray) -> np.ndarray:
    """int64 values as int32 when they all fit."""
    if len(a) and (a.min() < -(1 << 31) or a.max() >= (1 << 31)):
        return a
    return a.astype(np.int32)


class _Interner:
    """Values to dense int codes (names of events, threads, raw shape arguments of ops): the
    code of a value is its position in ``codes``, a dict in insertion order."""

    def __init__(self) -> None:
        self.codes: dict = {}

    def code(self, v) -> int:
        return self.codes.setdefault(v, len(self.codes))

    @property
    def values(self) -> list:
        return list(self.codes)


def _ident(v: int | str) -> int | str:
    """A pid or tid: a number written as a string ("25738") is that number."""
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return v


_PH, _CAT, _TS, _DUR, _ARGS = map(attrgetter, ("ph", "cat", "ts", "dur", "args"))
_DIMS = attrgetter("dims")
_SHAPE = attrgetter("dims", "types", "strides", "concrete")
_SEP = b"\x00"
# (ph, cat) -> kind of the kept events: duration events of known categories, launch-flow starts
_KIND_OF = {**{("X", c): k for c, k in CAT_KIND.items()}, **{("s", c): KIND_FLOW_START for c in FLOW_CATS}}
MAX_ELEMENTS = 1 << 40  # elements of one tensor: 2 TB of bf16
TS_MAX_US = 1e17  # about 3,000 years after 1970: a later start is not a time
DUR_MAX_US = 1e11  # 28 hours: a longer event is not one of a profiled step
RESOURCE_COLUMNS = ["row", "grid", "block", "registers", "shared_bytes", "blocks_per_sm", "occupancy_pct"]
MEMORY_COLUMNS = ["ts_us", "bytes", "total_allocated", "device_type", "device_id", "thread"]


class _ColumnBuilder:
    """Collect the duration events ("X") and launch-flow starts of decoded chunks as columns,
    the launch resources of kernels and the ``[memory]`` instant events beside them."""

    FIELDS = ("kind", "name", "thread", "ts", "dur", *INT_ARGS, "shape")

    def __init__(self) -> None:
        self.names = _Interner()
        self.shapes = _Interner()
        self.threads = _Interner()
        self.flow_ids = _Interner()
        self.dims = _Interner()  # a kernel's grid and block, raw JSON
        self.fixes: Counter = Counter()
        self.unread: Counter = Counter()
        self.dropped: Counter = Counter()  # reason -> events dropped
        self.parts: dict[str, list[np.ndarray]] = {f: [] for f in self.FIELDS}
        self.resources: list[dict[str, np.ndarray]] = []
        self.memory: list[tuple] = []
        self.rows = 0

    def add(self, events: list[_Event]) -> None:
        kind_all = np.fromiter(map(_KIND_OF.get, zip(map(_PH, events), map(_CAT, events)), repeat(-1)),
                               dtype=np.int8, count=len(events))
        idx = np.flatnonzero(kind_all >= 0)
        for ev in map(events.__getitem__, np.flatnonzero(kind_all < 0).tolist()):
            if ev.ph == "X":
                if ev.cat not in IGNORED_CATS:
                    self.unread[ev.cat] += 1
            elif ev.ph == "i" and ev.name == "[memory]" and ev.args.alloc == ev.args.alloc:
                a = ev.args
                self.memory.append((ev.ts, a.alloc, a.total, a.device_type, a.device_id,
                                    self.threads.code((ev.pid, ev.tid))))
        keep = list(map(events.__getitem__, idx.tolist()))
        kind = kind_all[idx]
        del kind_all, idx
        events.clear()
        n = len(keep)
        ts = np.fromiter(map(_TS, keep), dtype=np.float64, count=n)
        dur = np.fromiter(map(_DUR, keep), dtype=np.float64, count=n)
        ok = np.isfinite(ts) & np.isfinite(dur) & (ts >= 0) & (ts < TS_MAX_US) & (dur >= 0) & (dur < DUR_MAX_US)
        if not ok.all():
            self.dropped["a negative, non-finite or out-of-range ts or dur"] += int(n - ok.sum())
            keep = list(map(keep.__getitem__, np.flatnonzero(ok).tolist()))
            kind, ts, dur, n = kind[ok], ts[ok], dur[ok], len(keep)
        args = list(map(_ARGS, keep))

        def ints(field: str) -> np.ndarray:
            try:
                return np.fromiter(map(attrgetter(field), args), dtype=np.int64, count=n)
            except OverflowError:  # an integer beyond 64 bits: dropped for its event
                values = [_or_absent(_as_int(v, f"args.{_ARG_LABEL.get(field, field)}", self.fixes))
                          for v in map(attrgetter(field), args)]
                return np.array(values, dtype=np.int64)

        correlation = ints("correlation")
        for i in np.flatnonzero(kind == KIND_FLOW_START).tolist():
            v = keep[i].id  # flow ids that are strings or out of range get codes of their own, below -1
            correlation[i] = v if type(v) is int and _INT64[0] <= v <= _INT64[1] else -2 - self.flow_ids.code(("flow", v))
        shape = np.full(n, -1, dtype=np.int32)
        with_dims = [i for i, d in enumerate(map(_DIMS, args)) if d]
        if with_dims:  # the four raw fields in one key (no NUL byte in JSON text)
            sd = self.shapes.codes
            shape[with_dims] = [sd.setdefault(_SEP.join(_SHAPE(a)), len(sd)) for a in map(args.__getitem__, with_dims)]
        self._resources(kind, args)
        nd, td = self.names.codes, self.threads.codes
        cols = {
            "kind": kind,
            "name": np.array([nd.setdefault(ev.name, len(nd)) for ev in keep], dtype=np.int32),
            # codes of the (pid, tid) pairs as written; finish() merges "25738" with 25738
            "thread": np.array([td.setdefault((ev.pid, ev.tid), len(td)) for ev in keep], dtype=np.int32),
            "ts": ts, "dur": dur, "correlation": _narrow(correlation),
            **{f: _narrow(ints(f)) for f in INT_ARGS[1:-1]},
            "rank": _narrow(ints("rank")) if any(a.rank >= 0 for a in args[::RANK_PROBE])
            else np.full(n, -1, dtype=np.int8),
            "shape": shape,
        }
        for f, arr in cols.items():
            self.parts[f].append(arr)
        self.rows += n

    def merge(self, other: _ColumnBuilder) -> None:
        """Append the columns another builder made of the next piece, its codes made ours."""

        def lut(mine: _Interner, theirs: _Interner) -> np.ndarray:
            return np.array([mine.code(v) for v in theirs.codes] or [0], dtype=np.int32)

        names, threads, shapes = lut(self.names, other.names), lut(self.threads, other.threads), lut(self.shapes,
                                                                                                     other.shapes)
        parts = other.parts
        for f in self.FIELDS:
            for arr in parts[f]:
                if f == "name":
                    arr = names[arr]
                elif f == "thread":
                    arr = threads[arr]
                elif f == "shape":
                    arr = np.where(arr >= 0, shapes[arr], -1)
                elif f == "correlation" and len(arr) and arr.min() < -1:  # flow ids of their own
                    flows = np.array([-2 - self.flow_ids.code(v) for v in other.flow_ids.codes] or [0], dtype=np.int64)
                    arr = np.where(arr < -1, flows[np.clip(-2 - arr, 0, None)], arr)
                self.parts[f].append(arr)
        dims = lut(self.dims, other.dims)
        for r in other.resources:
            self.resources.append({**r, "row": r["row"] + self.rows, "grid": dims[r["grid"]], "block": dims[r["block"]]})
        self.memory += [(*m[:-1], int(threads[m[-1]])) for m in other.memory]
        self.fixes.update(other.fixes)
        self.unread.update(other.unread)
        self.dropped.update(other.dropped)
        self.rows += other.rows

    def _resources(self, kind: np.ndarray, args: list[_Args]) -> None:
        """The launch resources of the kernels that recorded them (rows numbered across chunks)."""
        rows = [i for i in np.flatnonzero(kind == KIND_KERNEL).tolist() if args[i].grid]
        if not rows:
            return
        ka = list(map(args.__getitem__, rows))
        dd = self.dims.codes
        part = {"row": np.asarray(rows, dtype=np.int64) + self.rows,
                "grid": np.array([dd.setdefault(bytes(a.grid), len(dd)) for a in ka], dtype=np.int32),
                "block": np.array([dd.setdefault(bytes(a.block), len(dd)) for a in ka], dtype=np.int32)}
        for col, f in zip(RESOURCE_COLUMNS[3:], NUM_ARGS[:4], strict=True):
            part[col] = np.fromiter(map(attrgetter(f), ka), dtype=np.float64, count=len(ka))
        self.resources.append(part)

    def finish(self, header: _Header, path: str) -> RawTrace:
        cols: dict[str, np.ndarray] = {}
        for f in self.FIELDS:  # one column at a time: the parts are freed as they are joined
            parts = self.parts.pop(f)
            cols[f] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
            del parts
        names = self.names.values
        threads = _Interner()  # the same thread whether its ids were written as numbers or strings
        lut = np.array([threads.code((_ident(p), _ident(t))) for p, t in self.threads.values] or [0], dtype=np.int32)
        cols["thread"] = lut[cols["thread"]]
        kind, corr = cols["kind"], cols["correlation"]
        redundant = kind == KIND_FLOW_START
        redundant[redundant] = member(corr[redundant], corr[kind == KIND_RUNTIME])
        res = pd.DataFrame({c: np.concatenate([p[c] for p in self.resources]) for c in RESOURCE_COLUMNS}) \
            if self.resources else pd.DataFrame({c: np.zeros(0, dtype=np.int64 if c in ("row", "grid", "block")
                                                                 else np.float64) for c in RESOURCE_COLUMNS})
        # two host ops may share name, thread and times (nested, in whole microseconds); launches
        # and GPU events have a correlation id of their own: a repeat of those was written twice,
        # and then so was the rest
        dup = _duplicates(cols, np.flatnonzero(corr >= 0))
        if dup.any():
            dup = _duplicates(cols, np.arange(len(corr)))
        if dup.any():
            self.dropped["duplicated (the same event written again)"] += int(dup.sum())
        if dup.any() or redundant.any():  # a launch flow whose launch is in the trace says nothing more
            keep = ~(dup | redundant)
            for f in cols:  # one column at a time
                cols[f] = cols[f][keep]
            new_row = np.cumsum(keep) - 1
            res = res[keep[res["row"].to_numpy()]].assign(row=lambda r: new_row[r["row"].to_numpy()])
        dims = [_dims_text(b) for b in self.dims.values]
        for c in ("grid", "block"):
            res[c] = pd.Categorical.from_codes(res[c].to_numpy(dtype=np.int32), categories=pd.Index(dims)) if dims \
                else pd.Categorical([])
        memory = pd.DataFrame(self.memory, columns=MEMORY_COLUMNS)
        memory["thread"] = lut[memory["thread"].to_numpy(dtype=np.int64)] if len(memory) else memory["thread"]
        rt = RawTrace(
            path=path, kind=cols["kind"].astype(np.int8, copy=False), name=cols["name"].astype(np.int32, copy=False),
            names=names, thread=cols["thread"].astype(np.int32, copy=False),
            ts=cols["ts"].astype(np.float64, copy=False), dur=cols["dur"].astype(np.float64, copy=False),
            correlation=cols["correlation"], stream=cols["stream"], device=cols["device"], seq=cols["seq"],
            shape=cols["shape"].astype(np.int32, copy=False),
            shape_values=self.shapes.values,
            event_rank=cols["rank"] if len(cols["rank"]) and int(cols["rank"].max()) >= 0 else None,
            threads=threads.values,
            device_properties=[d for d in header.deviceProperties or header.computeProperties or []
                               if isinstance(d, dict)],
            distributed=dict(header.distributedInfo or {}),
            platform="rocm" if header.roctracer_version is not None else "cuda",
            fixes=self.fixes, unread=self.unread, dropped=self.dropped, resources=res.reset_index(drop=True),
            memory=memory,
        )
        runtime = {names[c] for c in unique(rt.name[rt.kind == KIND_RUNTIME])}
        if any(r.startswith("hip") for r in runtime):
            rt.platform = "rocm"
        return rt


def _dims_text(raw: bytes) -> str:
    """A launch's ``[x, y, z]`` as ``x,y,z`` ("" when it is not a list of ints)."""
    v = _json_or_empty(raw)
    return ",".join(map(str, v)) if int_dims(v) else ""


_HASH = tuple(np.uint64(x) for x in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                                     0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53))
_SAME = ("kind", "name", "thread", "ts", "dur", "correlation", "stream")


def _duplicates(cols: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
    """Which of ``rows`` repeat an earlier one of them in every field of ``_SAME`` (an event
    written twice): one sort of a hash of the fields, equal hashes compared exactly."""
    dup = np.zeros(len(cols["kind"]), dtype=bool)
    if len(rows) < 2:
        return dup
    with np.errstate(over="ignore"):
        h = cols["kind"][rows].astype(np.uint64)
        for f, k in zip(_SAME[1:], _HASH, strict=False):
            v = cols[f][rows]
            h = (h ^ (v.view(np.uint64) if v.dtype == np.float64 else v.astype(np.int64).view(np.uint64))) * k
    sorted_h = np.sort(h)  # a fast sort of the values first: most traces have no equal hashes
    if not (sorted_h[1:] == sorted_h[:-1]).any():
        return dup
    del sorted_h
    order = np.argsort(h, kind="stable")
    eq = np.flatnonzero(h[order][1:] == h[order][:-1])
    if not len(eq):
        return dup
    first, later = rows[order[eq]], rows[order[eq + 1]]  # each row against the one before it of an equal hash
    same = np.ones(len(eq), dtype=bool)
    for f in _SAME:
        same &= cols[f][first] == cols[f][later]
    dup[later[same]] = True
    return dup
