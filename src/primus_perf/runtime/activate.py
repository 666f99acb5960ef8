"""From a tuning cache to routers: what a program installs at start-up.

:func:`activate` reads the cache once, keeps the entries usable here (same hardware; the
library versions its kind depends on), builds one router per kind from them (the kind's
``router`` part, ``primus_perf.kinds.RouterPart``) and returns them in an :class:`Activation`.
It installs nothing: ``handle.enable`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from primus_perf.base.devices import DeviceIdentity, current_device
from primus_perf.base.errors import DeviceError
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kinds import RouterPart, with_part

NOT_INSTALLED = "not available in this installation"


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
    # kind -> key -> the usable entries no step confirmed (no in-step verdict): online tuning races them
    unconfirmed: dict[str, dict[str, CacheEntry]] = field(default_factory=dict)
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
    ``kinds``: kind -> router part (default: every kind's; entries of other kinds are loaded,
    counted and not routed); ``always``: kinds that get a router (one with no choice) even
    without usable entries, where the kind is available here."""
    kinds = with_part("router") if kinds is None else kinds
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
            versions = spec.library_versions()
        except DeviceError as exc:  # e.g. no GPU, so no BLAS-Lt library to match
            act.unavailable[kind] = str(exc)
            continue
        act.versions[kind] = versions
        usable = cache.select(entries, device, versions)
        act.usable[kind] = len(usable)
        act.keys[kind] = {e.problem_key for e in usable.values()}
        act.unconfirmed[kind] = {k: e for k, e in usable.items()
                                 if (e.in_step or {}).get("verdict") not in ("kept", "dropped")}
        act.stale_count[kind] = len(entries) - len(usable)
        if usable or kind in always:
            act.routers[kind] = spec.build(list(usable.values()))
    return act
