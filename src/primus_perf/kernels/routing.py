"""What every router shares: the answer it gives a call, and how a cache entry names a choice.

A router is built from a tuning cache's usable entries of one kind and is pure: for one call,
``route(*call) -> (key, run)`` gives the problem's key (:data:`UNSUPPORTED` for a call no
problem describes) and ``run``, the callable that runs the cached choice on this call,
:data:`OWN` where the choice is what the caller runs anyway, or None where the cache has no
usable choice. It counts nothing and keeps no failures: the runtime's dispatch of the kind
owns those. ``may_route(*call)`` says whether it may answer such a call (asked of a traced
call's fake tensors); ``close()`` releases what it holds (library descriptors).
"""

from __future__ import annotations

from typing import Any, Protocol

OWN = "own"  # the cached choice is what the caller would run anyway: torch's kernel, or its backend
UNSUPPORTED = "unsupported"  # the key of calls no problem describes


class CachedChoice(Protocol):
    """What a router reads of a usable tuning-cache entry (``cache.store.CacheEntry`` has
    these fields; kernels do not import the cache)."""

    problem_key: str
    problem: dict[str, Any]
    solution: dict[str, Any]  # {"config": readable dict, "blob": opaque bytes}


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
