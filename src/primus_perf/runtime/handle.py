"""The runtime's :func:`enable`: routers from a tuning cache installed in this process, and the
:class:`Handle` that turns them off.

:func:`enable` reads the cache once (``activate``: entries for this device and library
versions), installs one router per kind in the kind's dispatch (``dispatch.of``) and holds the
dispatch's overrides, which send the program's calls of the kind to it, eager and compiled.
With an :class:`OnlineTuning` (given by the layer above: the tuner's in-step tuning, which the
runtime never imports) the routers are wrapped so that every problem the cache does not hold
is tuned inside the real steps and what they lock is written to the cache. Every rank of a
``torchrun`` job calls it with the same cache; each reads the file and none rewrites it
(online tuning adds entries under the cache's lock). Programs call ``primus_perf.enable``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from primus_perf.base import environment
from primus_perf.base.devices import DeviceIdentity
from primus_perf.base.errors import CacheError, UserError
from primus_perf.kinds import RouterPart, with_part
from primus_perf.runtime import dispatch
from primus_perf.runtime.activate import NOT_INSTALLED, Activation, activate

_active: Handle | None = None
# enable() and a handle's disable/suspend/resume, one at a time in a process: two threads that
# enable at once must not both find no active handle
_LOCK = threading.RLock()
# online tuning times candidates with device events inside the real steps
ONLINE_NEEDS_GPU = "off: it times kernels with CUDA/ROCm events and this process has no GPU"
NO_ENTRIES = "no usable entry of this kind in a tuned cache: its calls stay torch's, with no override"


def routable_kinds() -> tuple[str, ...]:
    """The kinds enable() routes: those with a router and an intercept (an FP8 plan is applied
    whole, by ``runtime.fp8.apply``)."""
    routers = with_part("router")
    return tuple(k for k in dispatch.kinds_with_dispatch() if k in routers)


class OnlineTuning(Protocol):
    """Tuning inside the real steps, plugged into :func:`enable` from above (the tuner's
    ``online.InStepTuning``): it wraps the cache's routers so that problems without a
    usable entry are tuned while the program runs."""

    needs_gpu: bool  # it times kernels with device events (False: it brings its own clock)

    def wrap(self, routers: dict[str, Any], activation: Activation, cache: Path,
             log: Callable[[str], None] | None) -> dict[str, Any]: ...


def idle(kind: str, router: Any) -> bool:
    """True for a router whose every choice is what its kind's calls run anyway (torch's
    kernel; the grouped dispatch's backend): the program's calls need no override."""
    check = getattr(router, "idle", None)
    return bool(check is not None and check(dispatch.of(kind).baseline_name()))


def rank0_stderr(line: str) -> None:
    """Print ``primus_perf: <line>`` to stderr on rank 0 (``RANK``) only."""
    if environment.get("RANK") == 0:
        print(f"primus_perf: {line}", file=sys.stderr, flush=True)


@dataclass
class Handle:
    """What :func:`enable` installed; a context manager (:meth:`disable` on exit)."""

    kinds: tuple[str, ...]
    activation: Activation
    routers: dict[str, Any]
    online: bool = False
    notes: dict[str, str] = field(default_factory=dict)  # kind -> why it is not routed here
    active: bool = True
    online_note: str | None = None  # why online tuning was asked for and is off
    idle: set[str] = field(default_factory=set)  # kinds whose every choice is torch's: no override
    paths: dict[str, str] = field(default_factory=dict)  # kind -> how its calls reach the router
    device_type: str = "cpu"  # whose kernels the overrides replace
    _final: dict[str, dict[str, Any]] | None = None  # the summary at disable

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per kind: ``routed`` and ``fallback`` call counts, ``stale`` (entries for another
        device or library version) and ``unusable`` (entries with no kernel here) entry counts,
        ``failed`` problems, ``problems`` (calls per problem key); online tuning adds ``tuning``
        and ``online`` (per problem: locked choice, calls, overhead); grouped GEMMs add
        ``offs_reads`` (calls that waited for the device to read their ``offs``);
        ``intercepted`` is False for a kind whose every entry is torch's own kernel (no
        override: its calls are not counted). A kind that cannot route here has ``available:
        False`` and a ``note``."""
        if self._final is not None:
            return self._final
        out: dict[str, dict[str, Any]] = {}
        act = self.activation
        for kind in self.kinds:
            if kind in self.notes:
                out[kind] = {"available": False, "note": self.notes[kind], "entries": act.loaded.get(kind, 0)}
                continue
            router = self.routers.get(kind)
            s = dispatch.of(kind).summary() if kind not in self.idle else {"routed": {}, "fallback": {}, "failed": []}
            row = {
                "available": True,
                "routed": sum(s["routed"].values()),
                "fallback": sum(s["fallback"].values()),
                "entries": act.loaded.get(kind, 0),
                "stale": act.stale_count.get(kind, 0),
                "unusable": len(getattr(router, "unusable", ())),
                "failed": list(s["failed"]),
                "problems": {"routed": s["routed"], "fallback": s["fallback"]},
                "intercepted": kind not in self.idle,
            }
            row.update({extra: s[extra] for extra in ("tuning", "online") if extra in s})
            if "offs_reads" in s:
                row["offs_reads"] = sum(s["offs_reads"].values())
                row["problems"]["offs_reads"] = s["offs_reads"]
            out[kind] = row
        return out

    def start_lines(self) -> list[str]:
        """What was found in the cache, and the kinds not routed here (and why)."""
        lines = self.activation.start_lines()
        lines += [f"  {kind}: not routed ({note})" for kind, note in self.notes.items()]
        lines += [f"  {kind}: {path}" for kind, path in self.paths.items()]
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

    def suspend(self) -> None:
        """Every call is torch's (the overrides and routers out), until :meth:`resume`."""
        with _LOCK:
            self._suspend()

    def _suspend(self) -> None:
        for kind in self.routers:
            d = dispatch.of(kind)
            d.release(self)
            d.install(None)

    def resume(self, kinds: Iterable[str] | None = None) -> None:
        """The routers and overrides back after :meth:`suspend` (not after :meth:`disable`);
        ``kinds``: only theirs, every other kind's calls stay torch's."""
        with _LOCK:
            if not self.active:
                raise UserError("a disabled tuning cache cannot be resumed; enable() it again")
            self._suspend()
            wanted = set(self.routers if kinds is None else kinds)
            for kind, router in self.routers.items():
                if kind not in wanted:
                    continue
                d = dispatch.of(kind)
                d.install(router)
                if kind not in self.idle:
                    d.keep_overrides(self, self.device_type)

    @property
    def routing(self) -> tuple[str, ...]:
        """The kinds whose calls the cache sends to a choice of its own (an override installed)."""
        return tuple(k for k in self.routers if k not in self.idle)

    def disable(self) -> None:
        """Remove the overrides and routers: every call is torch's again."""
        global _active
        with _LOCK:
            if not self.active:
                return
            self._final = self.summary()
            self.active = False
            self._suspend()
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
    kinds: Iterable[str] | None = None,
    *,
    device_type: str | None = None,
    device: DeviceIdentity | None = None,
    router_kinds: Mapping[str, RouterPart] | None = None,
    log: Callable[[str], None] | None = rank0_stderr,
) -> Handle:
    """Route this process's calls of ``kinds`` (default :func:`routable_kinds`) to the cache's
    choices (module docstring). ``cache``: read once; with ``online``, also written (a missing
    file is then created); ``online``: the tuning to run inside the steps; ``device_type``:
    whose kernels are overridden ("cuda"; "cpu" where there is no GPU); ``router_kinds``: kind
    -> router part (tests pass fake kernels); ``log``: where online tuning's reports go.
    Nothing else is printed: ``Handle.start_lines()`` and ``end_lines()`` say what happened.
    One at a time: from several threads at once, one enables and the others get the one line
    that it is already active."""
    with _LOCK:
        return _enable(cache, online, kinds, device_type=device_type, device=device, router_kinds=router_kinds,
                       log=log)


def _enable(cache: str | os.PathLike | None, online: OnlineTuning | None, kinds: Iterable[str] | None, *,
            device_type: str | None, device: DeviceIdentity | None, router_kinds: Mapping[str, RouterPart] | None,
            log: Callable[[str], None] | None) -> Handle:
    global _active
    import torch

    known = routable_kinds()
    kinds = known if kinds is None else tuple(kinds)
    unknown = [k for k in kinds if k not in known]
    if unknown:
        raise UserError(f"enable(kinds=...): unknown kind(s) {unknown} (one of {', '.join(known)})")
    if _active is not None:
        raise UserError("primus_perf.enable is already active in this process; disable() it first")
    if cache is None:
        raise UserError("no tuning cache: pass --cache PATH or set PRIMUS_PERF_CACHE (enable(cache=PATH) in Python)")
    path = Path(cache)
    if online is None and not path.is_file():
        raise CacheError(f"tuning cache not found: {path}")
    table = with_part("router", among=kinds) if router_kinds is None else router_kinds
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
    handle = Handle(kinds, act, routers, online is not None, notes, online_note=online_note,
                    idle={k for k, r in routers.items() if idle(k, r)}, device_type=device_type)
    held = []
    try:
        for kind, router in routers.items():
            d = dispatch.of(kind)
            held.append(d)
            d.reset()
            d.install(router)  # an idle one too: a program that moves its baseline reaches it
            if kind in handle.idle:
                continue
            d.prepare(log)
            d.keep_overrides(handle, device_type)
            path = d.path()
            if path:
                handle.paths[kind] = path
    except BaseException:
        for d in held:
            d.release(handle)
            d.install(None)
        for router in routers.values():
            router.close()
        raise
    _active = handle
    return handle
