"""The attention tuner's side of the tuning cache: entries of kind ``"attention"``.

An entry holds the problem (``AttentionProblem.to_dict()``, key ``problem.key()``), the
device identity, the library versions (torch, Triton, cuDNN), the solution (readable
``config``: ``AttentionChoice.to_solution()``; no opaque blob), the measured fwd+bwd
times of the choice and of torch's default, the worst numerical error of the Triton
config, and the tuner version. The cache module (``primus_perf.cache``) stores entries of
every kind; this module only converts, and builds the trainer's router from entries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from primus_perf.errors import CacheError
from primus_perf.tuner.attention.router import AttentionChoice, AttentionRouter

KIND = "attention"


def entry_fields(result: Any) -> dict[str, Any]:
    """The fields of the cache entry for one ``AttentionTuneResult``."""
    from primus_perf.tuner.attention.backends import DEFAULT, TRITON
    from primus_perf.tuner.attention.tune import TUNER_VERSION

    choice = AttentionChoice(result.selected, result.config if result.selected == TRITON else None)
    error = result.numerics_error if result.selected == TRITON else 0.0
    return {
        "kind": KIND,
        "problem_key": result.problem.key(),
        "problem": result.problem.to_dict(),
        "device": result.device.to_dict(),
        "versions": dict(result.versions),
        "solution": {"config": choice.to_solution(), "blob": b""},
        "times": {
            "tuned_ms": result.ms(result.selected),
            "default_ms": result.ms(DEFAULT),
        },
        "error": None if error is None or math.isnan(error) else float(error),
        "tuner_version": TUNER_VERSION,
    }


def running_versions() -> dict[str, str]:
    """The library versions an attention entry must match: torch, Triton, cuDNN."""
    from primus_perf.devices import library_versions

    return {k: v for k, v in library_versions().items() if k in ("torch", "triton", "cudnn")}


def save_results(results: Iterable[Any], path: str | Path) -> int:
    """Put one entry per result into the cache at ``path``; returns the number written."""
    from primus_perf.cache.store import CacheEntry, TuningCache

    return TuningCache(Path(path)).put_many(CacheEntry(**entry_fields(r)) for r in results)


def _field(entry: Any, name: str) -> Any:
    return entry[name] if isinstance(entry, dict) else getattr(entry, name)


def choices_from_entries(entries: Iterable[Any]) -> dict[str, AttentionChoice]:
    """Problem key -> cached choice, for the attention entries among ``entries``.

    Entries of other kinds are skipped; an attention entry whose solution cannot be read
    raises CacheError (a corrupt cache is reported, not silently ignored)."""
    out: dict[str, AttentionChoice] = {}
    for entry in entries:
        if _field(entry, "kind") != KIND:
            continue
        key = _field(entry, "problem_key")
        solution = _field(entry, "solution")
        config = solution["config"] if isinstance(solution, dict) else solution.config
        try:
            out[key] = AttentionChoice.from_solution(config)
        except ValueError as exc:
            raise CacheError(f"attention cache entry {key}: {exc}") from None
    return out


def router_from_entries(entries: Iterable[Any]) -> AttentionRouter | None:
    """The trainer's attention router for the cache's (already validated) entries."""
    choices = choices_from_entries(entries)
    return AttentionRouter(choices) if choices else None


def register() -> bool:
    """Install ``router_from_entries`` with the cache runtime; False if it is absent."""
    try:
        from primus_perf.cache import runtime
    except ImportError:
        return False
    from primus_perf.tuner.attention.tune import library_versions

    runtime.register_router_factory(KIND, router_from_entries, versions=library_versions)
    return True
