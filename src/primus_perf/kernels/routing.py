"""What every router shares: call counts and one summary shape.

A router is a callable that answers a dispatch point's call with the tensor of the tuned
kernel, or None ("not mine": the dispatch runs torch's default). Every router counts its
calls by problem key the same way, so that ``summary()`` has one structure for every kind::

    {"routed": {key: calls}, "fallback": {key: calls}, "failed": [keys]}

``routed``: calls that used the cached choice (also when that choice is torch's default);
``fallback``: calls left to torch (no usable entry, or a tuned kernel that failed);
``failed``: problems whose tuned kernel raised once and are left to torch from then on.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol


class CachedChoice(Protocol):
    """What a router reads of a usable tuning-cache entry (``cache.store.CacheEntry`` has
    these fields; kernels do not import the cache)."""

    problem_key: str
    problem: dict[str, Any]
    solution: dict[str, Any]  # {"config": readable dict, "blob": opaque bytes}


class Router:
    """Base of the routers: the counters, :meth:`summary` and :meth:`close`."""

    def __init__(self) -> None:
        self.routed: Counter[str] = Counter()
        self.fallback: Counter[str] = Counter()
        self.failed: set[str] = set()

    def _fall_back(self, key: str) -> None:
        self.fallback[key] += 1

    def may_route(self, *call: Any) -> bool:
        """Whether a call with these operands (fake tensors when a compiler traces it) may
        run something other than torch's default. A compiler keeps torch's own kernel, and
        its fusions, where this says no; a router that cannot tell (online tuning) says yes."""
        return True

    def _run(self, key: str, launch: Callable[..., Any], *args: Any) -> Any:
        """``launch(*args)`` for a problem with a cached choice; a tuned kernel that raises is
        reported once and its problem goes to torch from then on."""
        if key in self.failed:
            self._fall_back(key)
            return None
        try:
            out = launch(*args)
        except Exception as exc:
            return self._failure(key, exc)
        self.routed[key] += 1
        return out

    def _failure(self, key: str, exc: Exception) -> None:
        """A tuned kernel raised: say so once; its problem goes to torch from then on."""
        self.failed.add(key)
        print(f"tuning cache: tuned kernel for {key} failed ({exc}); using torch for it", file=sys.stderr)
        self._fall_back(key)

    def summary(self) -> dict[str, Any]:
        return {"routed": dict(self.routed), "fallback": dict(self.fallback), "failed": sorted(self.failed)}

    def close(self) -> None:
        """Release what the router holds (library descriptors); it routes nothing after."""


def choice_solution(backend: str, config: Any) -> dict[str, Any]:
    """The readable ``config`` part of a cache entry for a backend choice (attention, grouped
    GEMM): the backend's name, and the Triton config's fields when the choice has one."""
    out: dict[str, Any] = {"backend": backend}
    if config is not None:
        out.update(config.to_dict())
    return out


def solution_backend(data: Any, what: str) -> str:
    """The backend named by a cache entry's solution; ValueError naming ``what`` otherwise."""
    try:
        return str(data["backend"])
    except (KeyError, TypeError):
        raise ValueError(f"not {what} solution: {data!r}") from None


