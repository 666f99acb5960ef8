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
gives one :class:`~primus_perf.errors.TraceError` line naming the file.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from primus_perf.errors import TraceError

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
INT_ARGS = ("correlation", "stream", "device", "seq", "nbytes")


class _Args(msgspec.Struct, gc=False):
    # -1: absent (an explicit null is not an int: its chunk takes the tolerant decode)
    correlation: int = -1
    stream: int = -1
    device: int = -1
    seq: int = msgspec.field(name="Sequence number", default=-1)
    nbytes: int = msgspec.field(name="bytes", default=-1)
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))
    strides: msgspec.Raw = msgspec.field(name="Input Strides", default=msgspec.Raw(b""))
    concrete: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw(b""))


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    args: _Args | None = None


class _LooseArgs(msgspec.Struct, gc=False):
    """The same fields, any JSON type (the tolerant decode)."""

    correlation: Any = None
    stream: Any = None
    device: Any = None
    seq: Any = msgspec.field(name="Sequence number", default=None)
    nbytes: Any = msgspec.field(name="bytes", default=None)
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))
    strides: msgspec.Raw = msgspec.field(name="Input Strides", default=msgspec.Raw(b""))
    concrete: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw(b""))


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
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*')
_INT64 = (-(1 << 63), (1 << 63) - 1)


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
    nbytes: np.ndarray  # int32/int64, -1 when absent
    shape: np.ndarray  # int32 code into ``shape_values``, -1 for events without recorded inputs
    shape_values: list[tuple[bytes, bytes, bytes, bytes]]  # raw JSON (dims, types, strides, concrete)
    device_properties: list[dict[str, Any]] = field(default_factory=list)
    distributed: dict[str, Any] = field(default_factory=dict)
    platform: str = "cuda"  # "cuda" or "rocm"
    fixes: Counter = field(default_factory=Counter)  # (field, "converted ..."/"dropped ...") -> count
    unread: Counter = field(default_factory=Counter)  # category -> duration events not read (not ignorable)

    @property
    def has_shapes(self) -> bool:
        return bool(self.shape_values)

    def __len__(self) -> int:
        return len(self.kind)

    def shape_args(self, code: int) -> ShapeArgs | None:
        """The recorded inputs for a ``shape`` code (None for -1)."""
        if code < 0:
            return None
        values = [_json_or_empty(b) for b in self.shape_values[code]]
        # each is a list, one item per input; anything else was not written by torch.profiler
        return ShapeArgs(*(v if isinstance(v, list) else [] for v in values))

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


def unread_notes(unread: Counter) -> list[str]:
    """One line naming the categories of duration events the analyzer does not read, if any."""
    if not unread:
        return []
    what = ", ".join(f"{n:,} `{cat}`" for cat, n in unread.most_common())
    return [f"not read: {what} duration event(s), of categories unknown to the analyzer (another accelerator's "
            "device events, range profiler records, ...): their time is in no figure"]


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
    and the events before it must be a JSON array."""
    stripped = rest.rstrip()
    if not stripped.endswith(b"}"):
        raise TraceError(f"{path}: truncated JSON (the trace does not end with '}}')")
    pos = len(stripped)
    tries = 0
    while tries < 64:
        pos = stripped.rfind(b"]", 0, pos)
        if pos < 0:
            break
        tail = stripped[pos + 1:]
        t = tail.lstrip()
        if t == b"}" or t.startswith(b","):
            try:
                msgspec.json.decode(b"{" + t[1:] if t.startswith(b",") else b"{}")
            except (msgspec.DecodeError, UnicodeDecodeError):
                pass
            else:
                body = stripped[:pos]
                try:
                    _RAW_ITEMS.decode(b"[" + body + b"]")
                    return body, tail
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass
                except UnicodeDecodeError as exc:
                    raise _events_error(path, exc) from None
        tries += 1
    raise TraceError(f"{path}: malformed trace events (the traceEvents array is not closed)")


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

    def pieces(self) -> Iterator[bytes | memoryview]:
        """The events array as JSON arrays of whole events, about ``chunk_bytes`` each;
        ``prefix`` and ``tail`` are set once it is exhausted. Each piece is cut after the
        last event boundary of the text read so far, and bracketed in place (the bytes
        between two events become ``]`` and ``[``), so the text is copied once."""
        buf = bytearray()
        key = None
        for block in self.blocks:
            buf += block
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
        i = len(buf) - len(buf.lstrip())
        if buf[i:i + 1] != b"[":
            raise TraceError(f"{self.path}: not a Kineto trace (traceEvents is not a list)")
        del buf[:i]  # keep the "[": every piece starts with one
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

    def header(self) -> _Header:
        if self.array:
            return _Header()
        return _header(self.prefix + b'"traceEvents": []' + self.tail, self.path)


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
    return 0.0


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
    args = None
    if ev.args:
        try:
            la = _LOOSE_ARGS.decode(ev.args)
        except (msgspec.DecodeError, msgspec.ValidationError):
            fixes[("args", "dropped non-object")] += 1
        else:
            args = _Args(*(_or_absent(_as_int(getattr(la, f), f"args.{_ARG_LABEL[f]}", fixes)) for f in INT_ARGS),
                         dims=la.dims, types=la.types, strides=la.strides, concrete=la.concrete)
    ident = ev.id if isinstance(ev.id, (int, str)) and not isinstance(ev.id, bool) else None
    return _Event(ph=_as_str(ev.ph, "ph", fixes), cat=_as_str(ev.cat, "cat", fixes),
                  name=_as_str(ev.name, "name", fixes), pid=_as_ident(ev.pid, "pid", fixes),
                  tid=_as_ident(ev.tid, "tid", fixes), ts=_as_float(ev.ts, "ts", fixes),
                  dur=_as_float(ev.dur, "dur", fixes), id=ident, args=args)


_ARG_LABEL = {"correlation": "correlation", "stream": "stream", "device": "device", "seq": "Sequence number",
              "nbytes": "bytes"}


def _decode_piece(text: bytes | memoryview, fixes: Counter) -> list[_Event]:
    """A JSON array of events: strictly; on a type error, loosely (one pass), else event by event."""
    try:
        return _STRICT.decode(text)
    except msgspec.ValidationError:
        pass
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


def load(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> RawTrace:
    """Read and decode one trace file into a :class:`RawTrace` (see the module docstring)."""
    reader = _Reader(path, chunk_bytes)
    builder = _ColumnBuilder()
    p = str(path)
    carry, gap, error = b"", b"", None
    for piece in reader.pieces():
        if carry:  # the last cut fell inside a string: join the pieces as written and try again
            piece, carry = carry[:-1] + gap + bytes(piece[1:]), b""
        try:
            events = _decode_piece(piece, builder.fixes)
        except msgspec.DecodeError as exc:
            carry, gap, error = bytes(piece), reader.gap, exc
            continue
        except (msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise _events_error(p, exc) from None
        del piece
        builder.add(events)
    if carry:
        raise _events_error(p, error or ValueError("malformed"))
    return builder.finish(reader.header(), p)


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


class _ColumnBuilder:
    """Collect the duration events ("X") and launch-flow starts of decoded chunks as columns."""

    FIELDS = ("kind", "name", "thread", "ts", "dur", *INT_ARGS, "shape")

    def __init__(self) -> None:
        self.names = _Interner()
        self.shapes = _Interner()
        self.threads = _Interner()
        self.flow_ids = _Interner()
        self.fixes: Counter = Counter()
        self.unread: Counter = Counter()
        self.parts: dict[str, list[np.ndarray]] = {f: [] for f in self.FIELDS}

    def add(self, events: list[_Event]) -> None:
        kinds = CAT_KIND
        keep: list[_Event] = []
        kind_list: list[int] = []
        append, kappend = keep.append, kind_list.append
        for ev in events:
            ph = ev.ph
            if ph == "X":
                k = kinds.get(ev.cat, KIND_OTHER)
                if k == KIND_OTHER:
                    if ev.cat not in IGNORED_CATS:
                        self.unread[ev.cat] += 1
                    continue
                append(ev)
                kappend(k)
            elif ph == "s" and ev.cat in FLOW_CATS:
                append(ev)
                kappend(KIND_FLOW_START)
        events.clear()
        n = len(keep)
        none_args = _Args()
        args = [ev.args or none_args for ev in keep]

        def ints(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64) if n else np.zeros(0, dtype=np.int64)

        kind = np.array(kind_list, dtype=np.int8)
        correlation = ints([a.correlation for a in args])
        flow_ids = self.flow_ids  # flow ids that are strings get codes of their own, below -1
        for i in np.flatnonzero(kind == KIND_FLOW_START):
            v = keep[i].id
            correlation[i] = v if isinstance(v, int) and _INT64[0] <= v <= _INT64[1] else -2 - flow_ids.code(("flow", v))
        # interning: dict.setdefault(value, len(dict)) is the code (a dict keeps insertion order)
        sd = self.shapes.codes
        shape = np.full(n, -1, dtype=np.int32)
        with_dims = [i for i, a in enumerate(args) if a.dims]
        if with_dims:
            shape[with_dims] = [sd.setdefault((bytes(a.dims), bytes(a.types), bytes(a.strides), bytes(a.concrete)),
                                              len(sd)) for a in (args[i] for i in with_dims)]
        nd, td = self.names.codes, self.threads.codes
        cols = {
            "kind": kind,
            "name": np.array([nd.setdefault(ev.name, len(nd)) for ev in keep], dtype=np.int32),
            # codes of the (pid, tid) pairs as written; finish() merges "25738" with 25738
            "thread": np.array([td.setdefault((ev.pid, ev.tid), len(td)) for ev in keep], dtype=np.int32),
            "ts": np.array([ev.ts for ev in keep], dtype=np.float64),
            "dur": np.array([ev.dur for ev in keep], dtype=np.float64),
            "correlation": _narrow(correlation),
            "stream": _narrow(ints([a.stream for a in args])),
            "device": _narrow(ints([a.device for a in args])),
            "seq": _narrow(ints([a.seq for a in args])),
            "nbytes": _narrow(ints([a.nbytes for a in args])),
            "shape": shape,
        }
        for f, arr in cols.items():
            self.parts[f].append(arr)

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
        rt = RawTrace(
            path=path, kind=cols["kind"].astype(np.int8), name=cols["name"].astype(np.int32), names=names,
            thread=cols["thread"].astype(np.int32), ts=cols["ts"].astype(np.float64),
            dur=cols["dur"].astype(np.float64), correlation=cols["correlation"], stream=cols["stream"],
            device=cols["device"], seq=cols["seq"], nbytes=cols["nbytes"], shape=cols["shape"].astype(np.int32),
            shape_values=self.shapes.values,
            device_properties=[d for d in header.deviceProperties or header.computeProperties or []
                               if isinstance(d, dict)],
            distributed=dict(header.distributedInfo or {}),
            platform="rocm" if header.roctracer_version is not None else "cuda",
            fixes=self.fixes, unread=self.unread,
        )
        runtime = {names[c] for c in np.unique(rt.name[rt.kind == KIND_RUNTIME])}
        if any(r.startswith("hip") for r in runtime):
            rt.platform = "rocm"
        return rt
