"""Loading a tuning cache into the trainer's dispatch at start-up.

:func:`activate` reads the cache once, keeps the entries valid for the running device
(same hardware; same library versions where the kind says which versions matter), and for
each kind present asks that kind's provider for a router, which it installs into
``trainer.dispatch``. Kinds are data: :data:`PROVIDERS` names the module that registers a
kind's router factory (imported only when the cache holds entries of that kind) and
:data:`INSTALLERS` the dispatch setter for it.

A provider module calls :func:`register_router_factory(kind, factory, versions)` at import:
``factory(entries) -> router | None`` builds the router from usable entries, and
``versions() -> dict`` returns the running library versions an entry must match (None: only
the hardware is checked). A router may have ``summary() -> dict`` for the end-of-run lines.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.devices import DeviceIdentity, current_device
from primus_perf.trainer import dispatch

RouterFactory = Callable[[list[CacheEntry]], Any]
VersionsFn = Callable[[], dict[str, str]]

PROVIDERS: dict[str, str] = {
    "attention": "primus_perf.tuner.attention.cache_io",
    "gemm": "primus_perf.tuner.gemm_runtime",
}
INSTALLERS: dict[str, Callable[[Any], None]] = {
    "attention": dispatch.set_attention_router,
    "gemm": dispatch.set_gemm_router,
}

_factories: dict[str, tuple[RouterFactory, VersionsFn | None]] = {}


def register_router_factory(
    kind: str, factory: RouterFactory, versions: VersionsFn | None = None
) -> None:
    _factories[kind] = (factory, versions)


@dataclass
class Activation:
    """What :func:`activate` found and installed; ``end_summary`` reads the routers' counts."""

    path: str
    device: DeviceIdentity
    loaded: dict[str, int] = field(default_factory=dict)  # kind -> entries in the file
    usable: dict[str, int] = field(default_factory=dict)  # kind -> entries for this device
    stale: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # kinds with no provider here
    routers: dict[str, Any] = field(default_factory=dict)

    def start_lines(self) -> list[str]:
        lines = [f"tuning cache {self.path}: device {self.device.name}"]
        for kind in sorted(self.loaded):
            lines.append(
                f"  {kind}: {self.usable.get(kind, 0)} of {self.loaded[kind]} entries usable"
                + ("" if kind in self.routers else " (no router installed)")
            )
        lines += [f"  {msg}" for msg in self.stale[:10]]
        if len(self.stale) > 10:
            lines.append(f"  ... and {len(self.stale) - 10} more stale entries")
        lines += [f"  {kind}: no tuner for this kind in this installation" for kind in self.unsupported]
        return lines

    def end_summary(self) -> dict[str, Any]:
        return {
            kind: router.summary() for kind, router in self.routers.items() if hasattr(router, "summary")
        }

    def end_lines(self) -> list[str]:
        lines = []
        for kind, summary in self.end_summary().items():
            routed = sum(v["calls"] if isinstance(v, dict) else v for v in summary.get("routed", {}).values())
            default = sum(summary.get("default", {}).values())
            lines.append(f"tuning cache {kind}: {routed} calls used a cached choice, {default} fell back to torch")
        return lines

    def deactivate(self) -> None:
        for kind in self.routers:
            INSTALLERS[kind](None)
        self.routers.clear()


def activate(path: str | os.PathLike, device: DeviceIdentity | None = None) -> Activation:
    """Load the cache at ``path`` and install a router for every kind it holds."""
    device = device or current_device()
    act = Activation(path=str(path), device=device)
    cache = TuningCache(path, report_stale=act.stale.append)
    by_kind: dict[str, list[CacheEntry]] = {}
    for entry in cache.entries():
        by_kind.setdefault(entry.kind, []).append(entry)
    for kind, entries in sorted(by_kind.items()):
        act.loaded[kind] = len(entries)
        if kind not in INSTALLERS or not _load_provider(kind):
            act.unsupported.append(kind)
            continue
        factory, versions_fn = _factories[kind]
        usable = cache.select(entries, device, versions_fn() if versions_fn else None)
        act.usable[kind] = len(usable)
        router = factory(list(usable.values())) if usable else None
        if router is not None:
            INSTALLERS[kind](router)
            act.routers[kind] = router
    return act


def _load_provider(kind: str) -> bool:
    if kind in _factories:
        return True
    module = PROVIDERS.get(kind)
    if module is None:
        return False
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False
    register = getattr(mod, "register", None)
    if callable(register) and kind not in _factories:
        register()
    return kind in _factories
