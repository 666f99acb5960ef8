"""Load a Kineto trace (``.json`` or ``.json.gz``, CUDA or ROCm) into columns.

The cost of reading big traces is Python objects per event, so the loader decodes with
typed msgspec Structs that keep only the fields the analyses use (unknown keys are
skipped by the decoder, shape lists stay raw JSON until an op that needs them asks), then
turns the events into numpy columns with interned names and drops the Structs. Only the
cpu ops that carry shapes keep their raw argument bytes.

A trace the user can break (not found, bad gzip, truncated JSON, not a trace, no events)
gives one :class:`~primus_perf.errors.TraceError` line naming the file.
"""

from __future__ import annotations

import gzip
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from primus_perf.errors import TraceError

# ---- event kinds (a small int per event; "cat" spellings of CUDA and ROCm traces) --------

KIND_OTHER, KIND_CPU_OP, KIND_ANNOTATION, KIND_RUNTIME, KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET = range(7)
KIND_GPU_ANNOTATION, KIND_FLOW_START, KIND_FLOW_END, KIND_PYTHON = 7, 8, 9, 10

CAT_KIND: dict[str, int] = {
    "cpu_op": KIND_CPU_OP,
    "operator": KIND_CPU_OP,  # older Kineto spelling
    "user_annotation": KIND_ANNOTATION,
    "cuda_runtime": KIND_RUNTIME,
    "cuda_driver": KIND_RUNTIME,
    "runtime": KIND_RUNTIME,  # older Kineto and some ROCm traces
    "kernel": KIND_KERNEL,
    "Kernel": KIND_KERNEL,
    "gpu_memcpy": KIND_MEMCPY,
    "Memcpy": KIND_MEMCPY,
    "gpu_memset": KIND_MEMSET,
    "Memset": KIND_MEMSET,
    "gpu_user_annotation": KIND_GPU_ANNOTATION,
    "python_function": KIND_PYTHON,
}
FLOW_CATS = ("ac2g", "async_gpu")  # host launch -> GPU op flows (CUDA, ROCm)


class _Args(msgspec.Struct, gc=False):
    external_id: int | None = msgspec.field(name="External id", default=None)
    correlation: int | None = None
    stream: int | None = None
    device: int | None = None
    seq: int | None = msgspec.field(name="Sequence number", default=None)
    fwd_tid: int | None = msgspec.field(name="Fwd thread id", default=None)
    nbytes: int | None = msgspec.field(name="bytes", default=None)
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default=msgspec.Raw(b""))
    types: msgspec.Raw = msgspec.field(name="Input type", default=msgspec.Raw(b""))
    strides: msgspec.Raw = msgspec.field(name="Input Strides", default=msgspec.Raw(b""))
    concrete: msgspec.Raw = msgspec.field(name="Concrete Inputs", default=msgspec.Raw(b""))
    rank: int | None = None  # distributedInfo-style args on some events


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = 0
    tid: int | str = 0
    ts: float = 0.0
    dur: float = 0.0
    id: int | str | None = None
    bp: str = ""
    args: _Args | None = None


class _Trace(msgspec.Struct, gc=False):
    traceEvents: msgspec.Raw = msgspec.Raw(b"")
    deviceProperties: list[dict[str, Any]] | None = None
    distributedInfo: dict[str, Any] | None = None
    roctracer_version: Any = None
    cuda_runtime_version: Any = None
    cupti_version: Any = None
    record_shapes: Any = None
    baseTimeNanoseconds: int | None = None


_DECODER = msgspec.json.Decoder(_Trace)
_EVENTS_DECODER = msgspec.json.Decoder(list[_Event])
CHUNK_BYTES = 64 << 20  # events are decoded and turned into columns this many bytes at a time
_BOUNDARY = re.compile(rb"\}\s*,\s*\{")


@dataclass
class ShapeArgs:
    """An op's recorded inputs, decoded on demand from the raw JSON."""

    dims: list[Any]
    types: list[Any]
    strides: list[Any]
    concrete: list[Any]


@dataclass
class RawTrace:
    """One trace as columns: one row per duration event ("X") or flow event."""

    path: str
    kind: np.ndarray  # int8 KIND_*
    name: np.ndarray  # int32 code into ``names``
    names: list[str]
    pid: np.ndarray  # int64 (string pids get negative codes)
    tid: np.ndarray  # int64
    ts: np.ndarray  # float64, microseconds
    dur: np.ndarray  # float64, microseconds
    external_id: np.ndarray  # int64, -1 when absent
    correlation: np.ndarray  # int64, -1 when absent (for flows: the flow id)
    stream: np.ndarray  # int64, -1 when absent
    device: np.ndarray  # int64, -1 when absent
    seq: np.ndarray  # int64, -1 when absent
    nbytes: np.ndarray  # int64, -1 when absent
    shape: np.ndarray  # int32 code into ``shape_values``, -1 for events without recorded inputs
    shape_values: list[tuple[bytes, bytes, bytes, bytes]]  # raw JSON (dims, types, strides, concrete)
    device_properties: list[dict[str, Any]] = field(default_factory=list)
    distributed: dict[str, Any] = field(default_factory=dict)
    platform: str = "cuda"  # "cuda" or "rocm"

    @property
    def has_shapes(self) -> bool:
        return bool(self.shape_values)

    def __len__(self) -> int:
        return len(self.kind)

    def shape_args(self, code: int) -> ShapeArgs | None:
        """The recorded inputs for a ``shape`` code (None for -1)."""
        if code < 0:
            return None
        values = [msgspec.json.decode(b) if b else [] for b in self.shape_values[code]]
        # each is a list, one item per input; anything else was not written by torch.profiler
        return ShapeArgs(*(v if isinstance(v, list) else [] for v in values))

    @property
    def rank(self) -> int | None:
        r = self.distributed.get("rank")
        return int(r) if isinstance(r, int) else None


def read_bytes(path: str | Path) -> bytes:
    """The uncompressed bytes of a trace file (gzip detected by its magic number)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"trace not found: {p}") from None
    except IsADirectoryError:
        raise TraceError(f"{p} is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(f"{p}: bad gzip data ({exc})") from None
    return raw


def _decode(raw: bytes, path: str) -> _Trace:
    if not raw.strip():
        raise TraceError(f"{path}: empty file")
    try:
        return _DECODER.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: not a Kineto trace ({exc})") from None
    except msgspec.DecodeError as exc:
        what = "truncated" if "truncated" in str(exc).lower() else "malformed"
        raise TraceError(f"{path}: {what} JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text at byte {exc.start}") from None


class _Interner:
    """Values to dense int codes: names of events, and the raw shape arguments of ops."""

    def __init__(self) -> None:
        self.codes: dict = {}
        self.values: list = []

    def code(self, v) -> int:
        c = self.codes.get(v)
        if c is None:
            c = self.codes[v] = len(self.values)
            self.values.append(v)
        return c


def _ident(v: int | str, strings: dict[str, int]) -> int:
    if isinstance(v, int):
        return v
    return strings.setdefault(v, -1 - len(strings))


def load(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> RawTrace:
    """Read and decode one trace file into a :class:`RawTrace`."""
    raw = read_bytes(path)
    trace = _decode(raw, str(path))
    events = memoryview(trace.traceEvents)
    if not len(events):
        raise TraceError(f"{path}: not a Kineto trace (no traceEvents)")
    if events[:1] != b"[":
        raise TraceError(f"{path}: not a Kineto trace (traceEvents is not a list)")
    builder = _ColumnBuilder()
    for chunk in _event_chunks(events, chunk_bytes, str(path)):
        try:
            builder.add(chunk)
        except OverflowError:  # an id or size beyond 64 bits: not written by any profiler
            raise TraceError(f"{path}: an integer in the trace events is out of range") from None
    del events, trace.traceEvents, raw
    return builder.finish(trace, str(path))


def _events_error(path: str, exc: Exception) -> TraceError:
    if isinstance(exc, UnicodeDecodeError):
        return TraceError(f"{path}: trace events are not UTF-8 text")
    return TraceError(f"{path}: malformed trace events ({exc})")


def _event_chunks(view: memoryview, chunk_bytes: int, path: str):
    """Decoded events of the JSON array, ``chunk_bytes`` of text at a time.

    Chunks are cut between two events (``}, {``); if a cut lands inside a string (the
    chunk then fails to decode) the rest is decoded in one piece.
    """
    n = len(view)
    start = 1  # after "["
    end_array = n - 1  # the "]"
    while start < end_array:
        cut = end_array
        if end_array - start > chunk_bytes:
            m = _BOUNDARY.search(view, start + chunk_bytes, min(end_array, start + 2 * chunk_bytes))
            if m is not None:
                cut = m.start() + 1  # just after "}"
        piece = b"[" + bytes(view[start:cut]) + b"]"
        try:
            events = _EVENTS_DECODER.decode(piece)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            if cut == end_array:
                raise _events_error(path, exc) from None
            cut = end_array  # a cut inside a string: decode the rest whole
            try:
                events = _EVENTS_DECODER.decode(b"[" + bytes(view[start:cut]) + b"]")
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc2:
                raise _events_error(path, exc2) from None
        del piece
        yield events
        start = cut + 1 if cut < end_array else end_array
        # skip the comma (and whitespace) between the two events
        while start < end_array and view[start] in b" \t\r\n,":
            start += 1


class _ColumnBuilder:
    """Collect the duration events ("X") and launch flows of decoded chunks as columns."""

    FIELDS = ("kind", "name", "pid", "tid", "ts", "dur", "external_id", "correlation", "stream",
              "device", "seq", "nbytes", "shape")

    def __init__(self) -> None:
        self.names = _Interner()
        self.shapes = _Interner()
        self.strings: dict[str, int] = {}
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
                    continue
                append(ev)
                kappend(k)
            elif (ph == "s" or ph == "f") and ev.cat in FLOW_CATS:
                append(ev)
                kappend(KIND_FLOW_START if ph == "s" else KIND_FLOW_END)
        events.clear()
        n = len(keep)
        none_args = _Args()
        args = [ev.args or none_args for ev in keep]
        strings = self.strings

        def ints(values) -> np.ndarray:
            return np.fromiter((-1 if v is None else v for v in values), dtype=np.int64, count=n)

        kind = np.array(kind_list, dtype=np.int8)
        correlation = ints([a.correlation for a in args])
        for i in np.flatnonzero(kind >= KIND_FLOW_START):
            v = keep[i].id
            correlation[i] = v if isinstance(v, int) else _ident(str(v), strings)
        shape_code = self.shapes.code
        shape = np.fromiter(
            (shape_code((bytes(a.dims), bytes(a.types), bytes(a.strides), bytes(a.concrete)))
             if a.dims else -1 for a in args), dtype=np.int32, count=n)
        name_code = self.names.code
        cols = {
            "kind": kind,
            "name": np.fromiter((name_code(ev.name) for ev in keep), dtype=np.int32, count=n),
            "pid": np.fromiter((_ident(ev.pid, strings) for ev in keep), dtype=np.int64, count=n),
            "tid": np.fromiter((_ident(ev.tid, strings) for ev in keep), dtype=np.int64, count=n),
            "ts": np.fromiter((ev.ts for ev in keep), dtype=np.float64, count=n),
            "dur": np.fromiter((ev.dur for ev in keep), dtype=np.float64, count=n),
            "external_id": ints([a.external_id for a in args]),
            "correlation": correlation,
            "stream": ints([a.stream for a in args]),
            "device": ints([a.device for a in args]),
            "seq": ints([a.seq for a in args]),
            "nbytes": ints([a.nbytes for a in args]),
            "shape": shape,
        }
        for f, arr in cols.items():
            self.parts[f].append(arr)

    def finish(self, trace: _Trace, path: str) -> RawTrace:
        cols = {f: (np.concatenate(p) if p else np.zeros(0, dtype=np.int64)) for f, p in self.parts.items()}
        names = self.names.values
        rt = RawTrace(
            path=path,
            kind=cols["kind"].astype(np.int8),
            name=cols["name"].astype(np.int32),
            names=names,
            pid=cols["pid"], tid=cols["tid"], ts=cols["ts"].astype(np.float64),
            dur=cols["dur"].astype(np.float64),
            external_id=cols["external_id"], correlation=cols["correlation"],
            stream=cols["stream"], device=cols["device"], seq=cols["seq"], nbytes=cols["nbytes"],
            shape=cols["shape"].astype(np.int32),
            shape_values=self.shapes.values,
            device_properties=list(trace.deviceProperties or []),
            distributed=dict(trace.distributedInfo or {}),
            platform="rocm" if trace.roctracer_version is not None else "cuda",
        )
        runtime = {names[c] for c in np.unique(rt.name[rt.kind == KIND_RUNTIME])}
        if any(r.startswith("hip") for r in runtime):
            rt.platform = "rocm"
        return rt
