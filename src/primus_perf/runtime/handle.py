"""The runtime's :func:`enable`: routers from a tuning cache installed in this process, and
the :class:`Handle` that turns them off.

:func:`enable` reads the cache once (``activate``: entries for this device and library
versions), installs one router per kind (``routes``) and the dispatcher overrides that
send the program's calls of each kind to them (``intercept``; under ``torch.compile``,
Inductor passes that put custom ops in their place: ``compiled``). With an
:class:`OnlineTuning` (given by the layer above: the tuner's in-step tuning, which the
runtime never imports) the routers are wrapped so that every problem the cache does not
hold is tuned inside the real steps and what they lock is written to the cache. Every
rank of a ``torchrun`` job calls it with the same cache; each reads the file and none
rewrites it (online tuning adds entries under the cache's lock).

Programs call ``primus_perf.enable`` (``tuned_kernels``), which builds the online tuning
from a flag; the reference trainer calls this one with the online tuning its starter gave.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from primus_perf.devices import DeviceIdentity
from primus_perf.errors import CacheError, UserError
from primus_perf.kinds import RouterPart
from primus_perf.runtime import native, routes
from primus_perf.runtime.activate import KINDS as ROUTER_KINDS
from primus_perf.runtime.activate import NOT_INSTALLED, Activation, activate
from primus_perf.runtime.intercept import Interception

ALL_KINDS = tuple(ROUTER_KINDS)  # the kinds enable() routes: those with a router part (fp8.apply applies a plan)
_active: Handle | None = None


# online tuning times candidates with device events inside the real steps
ONLINE_NEEDS_GPU = "off: it times kernels with CUDA/ROCm events and this process has no GPU"


class OnlineTuning(Protocol):
    """Tuning inside the real steps, plugged into :func:`enable` from above (the tuner's
    ``online_kinds.InStepTuning``): it wraps the cache's routers so that problems without a
    usable entry are tuned while the program runs."""

    needs_gpu: bool  # it times kernels with device events (False: it brings its own clock)

    def wrap(self, routers: dict[str, Any], activation: Activation, cache: Path,
             log: Callable[[str], None] | None) -> dict[str, Any]:
        """The routers to install: ``routers`` with those of the kinds it tunes wrapped."""
        ...


NATIVE_DISPATCH = "routed calls go through the native dispatch (a C++ table of call signatures)"
NO_ENTRIES = "no usable entry of this kind in a tuned cache: its calls stay torch's, with no override"


def torch_answers_all(router: Any) -> bool:
    """True for a router whose every choice is torch's own kernel (``routes_nothing``; a
    grouped-GEMM one: ``intercepts_nothing``, every choice torch's ``grouped_mm``): the
    program's calls of its kind need no override."""
    return bool(getattr(router, "routes_nothing", False) or getattr(router, "intercepts_nothing", False))


def rank0_stderr(line: str) -> None:
    """Print ``primus_perf: <line>`` to stderr on rank 0 (``RANK``) only."""
    if os.environ.get("RANK", "0") == "0":
        print(f"primus_perf: {line}", file=sys.stderr, flush=True)


@dataclass
class Handle:
    """What :func:`enable` installed; a context manager (:meth:`disable` on exit)."""

    kinds: tuple[str, ...]
    activation: Activation
    routers: dict[str, Any]
    interception: Interception | None
    online: bool = False
    notes: dict[str, str] = field(default_factory=dict)  # kind -> why it is not routed here
    active: bool = True
    online_note: str | None = None  # why online tuning was asked for and is off
    idle: set[str] = field(default_factory=set)  # kinds whose every choice is torch's: no override
    gemm_dispatch: str | None = None  # how GEMM calls reach the router (runtime.native), when overridden

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per kind: ``routed`` and ``fallback`` call counts, ``stale`` (entries for another
        device or library version) and ``unusable`` (entries with no kernel here) entry
        counts, ``failed`` problems, ``problems`` (calls per problem key); online tuning
        adds ``tuning`` calls and ``online`` (per problem: locked choice, calls, overhead);
        grouped GEMMs add ``offs_reads``, the calls that waited for the device to read their
        ``offs`` on the host (per problem under ``problems``); ``intercepted`` is False for a
        kind whose every entry is torch's own kernel (no override: its calls are not counted).
        A kind that cannot route here has ``available: False`` and a ``note``."""
        out: dict[str, dict[str, Any]] = {}
        act = self.activation
        for kind in self.kinds:
            if kind in self.notes:
                out[kind] = {"available": False, "note": self.notes[kind], "entries": act.loaded.get(kind, 0)}
                continue
            router = self.routers.get(kind)
            s = router.summary() if router is not None else {"routed": {}, "fallback": {}, "failed": []}
            row = {
                "available": True,
                "routed": sum(s["routed"].values()),
                "fallback": sum(s["fallback"].values()),
                "entries": act.loaded.get(kind, 0),
                "stale": act.stale_count.get(kind, 0),
                "unusable": len(getattr(router, "unusable", ())),
                "failed": list(s["failed"]),
                "problems": {"routed": s["routed"], "fallback": s["fallback"]},
                "intercepted": kind not in self.idle,  # False: every entry torch's own, no override counts
            }
            for extra in ("tuning", "online"):
                if extra in s:
                    row[extra] = s[extra]
            if "offs_reads" in s:  # grouped GEMMs: calls that read their offs on the host (a device sync)
                row["offs_reads"] = sum(s["offs_reads"].values())
                row["problems"]["offs_reads"] = s["offs_reads"]
            out[kind] = row
        return out

    def start_lines(self) -> list[str]:
        """What was found in the cache, and the kinds not routed here (and why)."""
        lines = self.activation.start_lines()
        lines += [f"  {kind}: not routed ({note})" for kind, note in self.notes.items()]
        if self.gemm_dispatch:
            lines.append(f"  gemm: {self.gemm_dispatch}")
        if self.online:
            lines.append("  online tuning: problems without a usable entry are tuned in the first steps")
        if self.online_note:
            lines.append(f"  online tuning: {self.online_note}")
        return lines

    def end_lines(self) -> list[str]:
        """The summary as text, one line per routed kind."""
        lines = []
        for kind, row in self.summary().items():
            if not row["available"]:
                continue
            line = (f"tuning cache {kind}: {row['routed']} calls used a cached choice, {row['fallback']} fell"
                    f" back to torch; entries: {row['entries']}, {row['stale']} stale, {row['unusable']} unusable")
            if "tuning" in row:
                line += f"; {sum(row['tuning'].values())} calls spent tuning"
            if row.get("offs_reads"):
                line += f"; {row['offs_reads']} calls read their offs on the host (a device sync each)"
            if row["failed"]:
                line += f"; {len(row['failed'])} tuned kernels failed"
            if kind in self.idle:
                line += "; no override of the program's calls (every entry is torch's own kernel)"
            lines.append(line)
        return lines

    def disable(self) -> None:
        """Remove the overrides and routers: every call is torch's again."""
        global _active
        if not self.active:
            return
        self.active = False
        if self.interception is not None:
            self.interception.close()
        routes.remove()
        for router in self.routers.values():
            router.close()
        if _active is self:
            _active = None

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()


def active() -> Handle | None:
    """The handle :func:`enable` returned, while it is enabled."""
    return _active


def enable(
    cache: str | os.PathLike | None,
    online: OnlineTuning | None = None,
    kinds: Iterable[str] = ALL_KINDS,
    *,
    device_type: str | None = None,
    device: DeviceIdentity | None = None,
    router_kinds: Mapping[str, RouterPart] | None = None,
    log: Callable[[str], None] | None = rank0_stderr,
) -> Handle:
    """Route this process's calls of ``kinds`` to the cache's choices (module docstring).

    ``cache``: the tuning cache (read once; with ``online``, also written: a missing file
    is then created); ``online``: the tuning to run inside the steps (None: none);
    ``kinds``: which kinds (names of ``primus_perf.kinds``); ``device_type``: whose kernels
    are overridden ("cuda"; "cpu" where there is no GPU); ``router_kinds``: the router
    parts (``activate.KINDS``; tests pass fake kernels); ``log``: where online tuning's
    reports go (None: nowhere). Nothing else is printed: ``Handle.start_lines()`` and
    ``end_lines()`` say what happened."""
    global _active
    import torch

    kinds = tuple(kinds)
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        raise UserError(f"enable(kinds=...): unknown kind(s) {unknown} (one of {', '.join(ALL_KINDS)})")
    if _active is not None:
        raise UserError("primus_perf.enable is already active in this process; disable() it first")
    if cache is None:
        raise UserError("no tuning cache: pass --cache PATH or set PRIMUS_PERF_CACHE (enable(cache=PATH) in Python)")
    path = Path(cache)
    if online is None and not path.is_file():
        raise CacheError(f"tuning cache not found: {path}")
    table = ROUTER_KINDS if router_kinds is None else router_kinds
    act = activate(path, device=device, kinds=table, always=[k for k in kinds if k in table])
    left_alone: dict[str, str] = {}
    if online is None and any(act.usable.get(k, 0) for k in kinds):
        # a tuned cache: a kind it holds nothing usable for is left alone (an override only to
        # count the calls it leaves to torch would cost every call); with no usable entry at
        # all, each kind keeps a router that counts them (and names the grouped problems in a trace)
        for k in kinds:
            if not act.usable.get(k, 0) and k in act.routers:
                act.routers.pop(k).close()
                stale = act.stale_count.get(k, 0)
                left_alone[k] = NO_ENTRIES if not stale else f"{NO_ENTRIES} ({stale} stale)"
    notes = {k: left_alone.get(k) or act.unavailable.get(k, NOT_INSTALLED) for k in kinds if k not in act.routers}
    routers = {k: r for k, r in act.routers.items() if k in kinds}
    online_note = None
    if online is not None and act.device.vendor == "cpu" and online.needs_gpu:
        online, online_note = None, ONLINE_NEEDS_GPU
    if online is not None:
        routers = online.wrap(routers, act, path, log)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    routes.install(routers)
    try:
        # a router whose every entry is torch's own choice gets no override (its calls stay torch's)
        intercepted = {k for k, r in routers.items() if not torch_answers_all(r)}
        if routes.GEMM in intercepted:
            native.load(log)  # built on first use (said in the log), before the overrides take it
        interception = Interception(intercepted, device_type) if intercepted else None
    except BaseException:
        routes.remove()
        raise
    dispatch = None
    if routes.GEMM in intercepted:
        dispatch = (NATIVE_DISPATCH if native.installed()
                    else f"routed calls go through Python ({native.why_not()})")
    handle = Handle(kinds, act, routers, interception, online is not None, notes, online_note=online_note,
                    idle={k for k in routers if k not in intercepted}, gemm_dispatch=dispatch)
    _active = handle
    return handle
