"""From a tuning cache to routers: what a program installs at start-up.

:func:`activate` reads the cache once, keeps the entries usable here (same hardware; the
library versions its kind depends on), builds one router per kind from them and returns
them in an :class:`Activation`. It installs nothing: :func:`~.handle.enable` does (and so
does the closed loop's interleaved measurement, through ``routes.install``); a program
turns tuned kernels on with ``primus_perf.enable``, of which this is the first step.

The routers are the kinds' ``router`` parts (``primus_perf.kinds``, attached by
``kernels.routers``): :data:`KINDS` maps each kind that has one to its
:class:`~primus_perf.kinds.RouterPart` (the router factory, the running library versions
its entries must match, an empty router). A router has ``summary()`` in the one shape of
``kernels.routing``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.devices import DeviceIdentity, current_device
from primus_perf.errors import DeviceError
from primus_perf.kernels import routers as _attached  # noqa: F401 (attaches each kind's router part)
from primus_perf.kinds import RouterPart, with_part

NOT_INSTALLED = "not available in this installation"

KINDS: dict[str, RouterPart] = with_part("router")  # kind -> its router part, for every kind that has one


@dataclass
class Activation:
    """What :func:`activate` found, and the routers it built (one per kind with usable entries)."""

    path: str
    device: DeviceIdentity
    loaded: dict[str, int] = field(default_factory=dict)  # kind -> entries in the file
    usable: dict[str, int] = field(default_factory=dict)  # kind -> entries for this device
    stale: list[str] = field(default_factory=list)
    stale_count: dict[str, int] = field(default_factory=dict)  # kind -> entries not for this device/versions
    versions: dict[str, dict[str, str]] = field(default_factory=dict)  # kind -> running library versions
    unavailable: dict[str, str] = field(default_factory=dict)  # kind -> why no router here
    keys: dict[str, set[str]] = field(default_factory=dict)  # kind -> problem keys of its usable entries
    routers: dict[str, Any] = field(default_factory=dict)

    def start_lines(self) -> list[str]:
        lines = [f"tuning cache {self.path}: device {self.device.name}"]
        for kind in sorted(self.loaded):
            if kind in self.unavailable:
                lines.append(f"  {kind}: {self.loaded[kind]} entries, not usable here ({self.unavailable[kind]})")
                continue
            lines.append(f"  {kind}: {self.usable.get(kind, 0)} of {self.loaded[kind]} entries usable")
        lines += [f"  {msg}" for msg in self.stale[:10]]
        if len(self.stale) > 10:
            lines.append(f"  ... and {len(self.stale) - 10} more stale entries")
        return lines

    def end_summary(self) -> dict[str, dict[str, Any]]:
        """Kind -> the router's summary (``{"routed": {key: calls}, "fallback": ..., "failed": [...]}``)."""
        return {kind: router.summary() for kind, router in self.routers.items()}

    def close(self) -> None:
        """Release the routers (the program uninstalls them first)."""
        for router in self.routers.values():
            router.close()
        self.routers.clear()


def activate(
    path: str | os.PathLike,
    device: DeviceIdentity | None = None,
    kinds: Mapping[str, RouterPart] | None = None,
    always: Iterable[str] = (),
) -> Activation:
    """Read the cache at ``path`` and build a router for every kind with usable entries;
    ``kinds``: the kind table (default :data:`KINDS`; entries of other kinds are loaded,
    counted and not routed); ``always``: kinds that get a router (one counting the calls it
    leaves to torch) even without usable entries, where the kind is available here."""
    kinds = KINDS if kinds is None else kinds
    device = device or current_device()
    act = Activation(path=str(path), device=device)
    cache = TuningCache(path, report_stale=act.stale.append)
    by_kind: dict[str, list[CacheEntry]] = {kind: [] for kind in always}
    for entry in cache.entries():
        by_kind.setdefault(entry.kind, []).append(entry)
    for kind, entries in sorted(by_kind.items()):
        act.loaded[kind] = len(entries)
        spec = kinds.get(kind)
        if spec is None:
            act.unavailable[kind] = NOT_INSTALLED
            continue
        try:
            versions = spec.versions()
        except DeviceError as exc:  # e.g. no GPU, so no BLAS-Lt library to match
            act.unavailable[kind] = str(exc)
            continue
        act.versions[kind] = versions
        usable = cache.select(entries, device, versions)
        act.usable[kind] = len(usable)
        act.keys[kind] = {e.problem_key for e in usable.values()}
        act.stale_count[kind] = len(entries) - len(usable)
        router = spec.factory(list(usable.values())) if usable else None
        if router is None and kind in always:
            router = spec.empty()
        if router is not None:
            act.routers[kind] = router
    return act
