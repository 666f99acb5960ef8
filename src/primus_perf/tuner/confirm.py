"""Offline confirmation: a cache's choices A/B timed against the baseline inside real steps,
and the cache corrected where the step does not bear a choice out.

:func:`confirm_run` enables the cache (``runtime.enable``), makes the routing path
alternate each routed problem between its cached choice and the baseline
(``runtime.confirm.Confirmer``) while ``run()`` runs the program's steps (the reference
trainer: ``closed_loop.confirm_trainer``; any script: ``primus-tune confirm -- script.py``),
then :func:`apply_verdicts` writes every verdict into its cache entry
(``core.confirmed_entry``): the in-step figure with its spread on each entry, and the
baseline's solution in place of each choice the step did not bear out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from primus_perf import kinds
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kernels.grouped.router import GroupedChoice, shape_key
from primus_perf.problems import GroupedGemmProblem
from primus_perf.runtime import routes
from primus_perf.runtime.confirm import (
    DROPPED,
    GEMM_KIND,
    KEPT,
    TORCH,
    Confirmer,
    ConfirmPolicy,
    Verdict,
    gemm_routing_cost_us,
)
from primus_perf.tuner.core import confirmed_entry

TORCH_SOLUTION = {"config": {"name": TORCH, "source": TORCH}, "blob": b""}  # a GEMM's baseline


def baseline_solution(kind: str, baseline: str) -> dict[str, Any] | None:
    """The cache solution of a baseline: torch's own GEMM; a grouped GEMM's backend row."""
    if kind == kinds.GEMM.name:
        return dict(TORCH_SOLUTION)
    if kind == kinds.GROUPED.name:
        choice = GroupedChoice.of_backend(baseline)  # triton: its default config
        if choice is None:
            return None
        return {"config": {"name": choice.label(), **choice.to_solution()}, "blob": b""}
    return None


@dataclass
class ConfirmRow:
    """One problem: its cache entry before the confirmation (``before``, with its claim; a
    grouped GEMM shape's first entry), the verdict, and the entry written (None: left as it
    was)."""

    problem: str
    before: CacheEntry | None
    verdict: Verdict
    after: CacheEntry | None = None
    entries: int = 1  # cache entries the verdict covers (a grouped GEMM's: every skew bucket of its shape)


@dataclass
class ConfirmRun:
    """What :func:`confirm_run` did: a row per problem confirmed, how many usable entries
    were not confirmed (``unseen``: never called, or torch's own choice), the program's
    exit code."""

    cache: str
    rows: list[ConfirmRow] = field(default_factory=list)
    unseen: int = 0
    exit_code: int = 0
    interrupted: bool = False

    def count(self, status: str) -> int:
        return sum(r.verdict.status == status for r in self.rows)


def _label(entry: CacheEntry | None, key: str) -> str:
    if entry is None:
        return key
    try:
        return str(kinds.get(entry.kind).problem_type.from_dict(entry.problem))
    except (KeyError, TypeError, ValueError):
        return key


def apply_verdicts(cache: str | os.PathLike, verdicts: Iterable[Verdict], activation: Any) -> list[ConfirmRow]:
    """Write each decided verdict (kept or dropped) into its usable cache entry (this
    device, ``activation.versions``); unconfirmed ones leave their entry as it was."""
    store = TuningCache(cache)
    usable: dict[tuple[str, str], CacheEntry] = {}
    entries = store.entries()
    for kind in {e.kind for e in entries}:
        mine = [e for e in entries if e.kind == kind]
        for key, e in store.select(mine, activation.device, activation.versions.get(kind)).items():
            usable[kind, key] = e
    shapes: dict[str, list[CacheEntry]] = {}  # a grouped GEMM's verdict is its shape's
    for (kind, _key), e in usable.items():
        if kind == kinds.GROUPED.name:
            try:
                shapes.setdefault(shape_key(GroupedGemmProblem.from_dict(e.problem)), []).append(e)
            except (TypeError, ValueError, KeyError):
                continue
    rows, changed = [], []
    for v in verdicts:
        mine = shapes.get(v.key, []) if v.kind == kinds.GROUPED.name else \
            [e for e in (usable.get((v.kind, v.key)),) if e is not None]
        before = mine[0] if mine else None
        label = _label(before, v.key) + (f" (+{len(mine) - 1} skew buckets)" if len(mine) > 1 else "")
        row = ConfirmRow(label, before, v, entries=len(mine))
        if mine and v.status in (KEPT, DROPPED):
            corrected = [confirmed_entry(e, v.figure(), baseline_solution(v.kind, v.baseline)) for e in mine]
            row.after = corrected[0]
            changed += corrected
        rows.append(row)
    store.put_many(changed)
    return rows


def _routing_cost_us(confirmer: Confirmer, gemm_path: str) -> float:
    """What a GEMM call of the run paid for its routing (0 where no GEMM choice was kept:
    nothing to weigh)."""
    if confirmer.gemm_device is None or not any(v.kind == GEMM_KIND and v.kept for v in confirmer.verdicts.values()):
        return 0.0
    import torch

    from primus_perf.kernels.gemm import torch_mm
    from primus_perf.runtime import seams

    route = seams.matmul if gemm_path == "seam" else torch.mm
    return gemm_routing_cost_us(route, torch_mm, confirmer.gemm_device)


def confirm_run(
    cache: str | os.PathLike,
    run: Callable[[Confirmer], int],
    *,
    policy: ConfirmPolicy | None = None,
    clock: Any = None,
    kinds_: Iterable[str] | None = None,
    device_type: str | None = None,
    router_kinds: Any = None,
    log: Callable[[str], None] | None = None,
    gemm_path: str = "override",
) -> ConfirmRun:
    """Enable ``cache``, confirm its routed choices while ``run(confirmer)`` runs the
    program (it returns the program's exit code; it may stop early once
    ``confirmer.confirming`` is 0 after the first steps), then write the verdicts. Ctrl-C
    stops the program; what was decided is still written. The kept GEMM choices must also
    pay for routing every GEMM call of the run (``Confirmer.routing_pays``), priced on the
    path the program's GEMMs take: ``gemm_path`` "override" (``torch.mm`` and friends under
    ``enable()``) or "seam" (the trainer's ``seams.matmul``)."""
    from primus_perf.runtime.handle import ALL_KINDS, enable

    handle = enable(cache, None, ALL_KINDS if kinds_ is None else kinds_, device_type=device_type,
                    router_kinds=router_kinds, log=None)
    confirmer = Confirmer(policy, clock, log)
    out = ConfirmRun(str(cache))
    routes.confirm_with(confirmer)
    try:
        out.exit_code = run(confirmer)
    except KeyboardInterrupt:
        out.interrupted = True
    finally:
        routes.confirm_with(None)
        confirmer.finish()
        try:
            verdicts = confirmer.routing_pays(_routing_cost_us(confirmer, gemm_path))
        finally:
            handle.disable()
    out.rows = apply_verdicts(cache, verdicts, handle.activation)
    usable = sum(len(keys) for keys in handle.activation.keys.values())
    out.unseen = max(0, usable - sum(r.entries for r in out.rows))
    return out
