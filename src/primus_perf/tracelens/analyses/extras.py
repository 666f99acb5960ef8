"""What the main loader does not keep, read in a second streaming pass over one trace file:
the launch resources Kineto records on each kernel (grid, block, registers per thread,
shared memory, blocks per SM, estimated achieved occupancy) and the ``[memory]`` instant
events of a trace recorded with ``profile_memory=True`` (with the CPU ops they fall in).

The pass reuses the loader's streaming reader (bounded memory: the events are decoded a
chunk at a time with structs that hold only these fields) and runs on demand: only the
kernel-efficiency and memory tables ask for it (:mod:`.kernel_efficiency`, :mod:`.memory`).
Values of an unexpected type are dropped for their event (a kernel without resources is
left out of the efficiency table, a memory event without ``Bytes`` out of the curve).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L

KERNEL_COLUMNS = ["ts_us", "dur_us", "name", "grid", "block", "registers", "shared_bytes", "blocks_per_sm",
                  "occupancy_pct"]
MEMORY_COLUMNS = ["ts_us", "bytes", "total_allocated", "device_type", "device_id", "thread"]
OP_COLUMNS = ["ts_us", "dur_us", "name", "thread"]


class _KArgs(msgspec.Struct, gc=False):
    grid: Any = None
    block: Any = None
    registers: Any = msgspec.field(name="registers per thread", default=None)
    shared: Any = msgspec.field(name="shared memory", default=None)
    blocks_per_sm: Any = msgspec.field(name="blocks per SM", default=None)
    occupancy: Any = msgspec.field(name="est. achieved occupancy %", default=None)
    nbytes: Any = msgspec.field(name="Bytes", default=None)
    total: Any = msgspec.field(name="Total Allocated", default=None)
    device_type: Any = msgspec.field(name="Device Type", default=None)
    device_id: Any = msgspec.field(name="Device Id", default=None)


class _Ev(L._LooseEvent, gc=False):
    """The loader's tolerant event, its args decoded into the fields above."""

    args: _KArgs | None = None  # type: ignore[assignment]


_DECODE = msgspec.json.Decoder(list[_Ev])
_DECODE_ONE = msgspec.json.Decoder(_Ev)
_RAW = msgspec.json.Decoder(list[msgspec.Raw])
_KERNEL_CATS = frozenset(c for c, k in L.CAT_KIND.items() if k == L.KIND_KERNEL)
_OP_CATS = frozenset(c for c, k in L.CAT_KIND.items() if k == L.KIND_CPU_OP)


@dataclass
class Extras:
    """One trace's kernel resources, memory events and (when it has memory events) CPU ops."""

    kernels: pd.DataFrame  # KERNEL_COLUMNS ("x,y,z" grid and block), threads per block, grid_blocks
    memory: pd.DataFrame  # MEMORY_COLUMNS; bytes > 0 an allocation, < 0 a free
    ops: pd.DataFrame  # OP_COLUMNS (empty when the trace has no memory events)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return np.nan
    return float(v)


def _dims(v: Any) -> tuple[str, float]:
    """``[x, y, z]`` as ("x,y,z", x*y*z); anything else as ("", NaN)."""
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return ",".join(map(str, v)), float(np.prod(v, dtype=np.float64))
    return "", np.nan


def _decode(piece: bytes | memoryview) -> list[_Ev]:
    try:
        return _DECODE.decode(piece)
    except msgspec.ValidationError:  # an odd event: decode one by one and drop what does not fit
        out = []
        for item in _RAW.decode(piece):
            try:
                out.append(_DECODE_ONE.decode(item))
            except msgspec.ValidationError:
                continue
        return out


def read_extras(path: str | Path) -> Extras:
    """Read the kernel resources and memory events of one trace (see the module docstring)."""
    reader = L._Reader(path, L.CHUNK_BYTES)
    krows: list[tuple] = []
    mrows: list[tuple] = []
    orows: list[tuple] = []
    carry = b""
    for piece in reader.pieces():
        if carry:  # a cut inside a string: join as the loader does
            piece, carry = carry[:-1] + reader.gap + bytes(piece[1:]), b""
        try:
            events = _decode(piece)
        except msgspec.DecodeError:
            carry = bytes(piece)
            continue
        for ev in events:
            a = ev.args
            if ev.ph == "X":
                if ev.cat in _KERNEL_CATS and a is not None and a.grid is not None:
                    grid, blocks = _dims(a.grid)
                    block, threads = _dims(a.block)
                    krows.append((_num(ev.ts), _num(ev.dur), str(ev.name), grid, block, _num(a.registers),
                                  _num(a.shared), _num(a.blocks_per_sm), _num(a.occupancy), threads, blocks))
                elif ev.cat in _OP_CATS:
                    orows.append((_num(ev.ts), _num(ev.dur), str(ev.name), f"{ev.pid}/{ev.tid}"))
            elif ev.ph == "i" and ev.name == "[memory]" and a is not None and not np.isnan(_num(a.nbytes)):
                mrows.append((_num(ev.ts), _num(a.nbytes), _num(a.total), _num(a.device_type), _num(a.device_id),
                              f"{ev.pid}/{ev.tid}"))
    kernels = pd.DataFrame(krows, columns=[*KERNEL_COLUMNS, "threads", "grid_blocks"])
    memory = pd.DataFrame(mrows, columns=MEMORY_COLUMNS)
    ops = pd.DataFrame(orows if mrows else [], columns=OP_COLUMNS)
    return Extras(kernels, memory, ops)
