"""The final check of a tuned cache: the step with it against the step without it, and a cache
never ships slower than no cache.

``measure(kinds)`` runs the program's steps in interleaved blocks (``measure.blocks``), the
cache's routers of ``kinds`` on one side and none on the other, and returns each side's block
medians; :func:`final_check` judges them by the one rule (``decide.judge``: the median of the
per-block ratios must beat 1 by ``STEP_MARGIN`` and the noise). Where the whole cache does not
win, each routed kind is measured alone, the kinds that win are kept (measured together where
several do, else the best alone), and every other kind's entries are reset to its baseline
(torch's kernel, the caller's grouped backend) with the step's figure as the reason
(:func:`reset_kinds`), down to a cache that routes nothing. A kind whose every entry is its
baseline installs no override, so such a cache costs the step nothing: "1.00x: torch's own
kernels kept".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from primus_perf.tuner.decide import DROPPED, STEP_MARGIN, Rule, Verdict, judge

Measure = Callable[[tuple[str, ...]], tuple[list[float], list[float]]]
NOTHING_KEPT = "1.00x: torch's own kernels kept"


@dataclass
class Round:
    """One measurement: the kinds routed on the tuned side, both sides' block medians (s)."""

    kinds: tuple[str, ...]
    default_s: list[float]
    tuned_s: list[float]
    verdict: Verdict

    def line(self) -> str:
        v = self.verdict
        what = "the cache" if len(self.kinds) != 1 else f"the cache's {self.kinds[0]} choices alone"
        if v.speedup is None:
            return f"{what}: {v.pairs} block pairs, too few for a verdict"
        return (f"{what}: {v.speedup:.3f}x [{v.low:.3f}-{v.high:.3f}] of the default step over {v.pairs} block pairs"
                f" (needs > {1 + v.threshold:.3f}x): {v.status}")


@dataclass
class FinalCheck:
    """What :func:`final_check` measured and decided: ``kept`` the kinds whose choices stay,
    ``dropped`` kind -> entries reset to the baseline, ``host_bound`` the GPU's busy share of
    a host-bound step (None: not host-bound, or not known)."""

    rounds: list[Round] = field(default_factory=list)
    kept: tuple[str, ...] = ()
    dropped: dict[str, int] = field(default_factory=dict)
    host_bound: float | None = None

    @property
    def figure(self) -> Round | None:
        """The round of the kinds kept (None: nothing kept)."""
        return next((r for r in reversed(self.rounds) if r.kinds == self.kept and r.verdict.kept), None)

    @property
    def speedup(self) -> float:
        """The step with the cache left behind against the step without it (1.0: it routes nothing)."""
        f = self.figure
        return f.verdict.speedup if f is not None and f.verdict.speedup else 1.0

    def lines(self) -> list[str]:
        """The outcome (each round is said as it is measured): what was dropped, the figure."""
        out = []
        if self.dropped:
            out.append("final check: dropped " + ", ".join(f"{k} ({n} entries reset to the baseline)"
                                                          for k, n in self.dropped.items()))
        f = self.figure
        if f is not None:
            out.append(f"speedup with the cache: {f.verdict.speedup:.3f}x [{f.verdict.low:.3f}-{f.verdict.high:.3f}]"
                       f" ({', '.join(f.kinds)} routed)")
        else:
            out.append(f"speedup with the cache: {NOTHING_KEPT}" + (" (the cache routes nothing)" if not self.rounds
                                                                     else ""))
        return out


def _round(measure: Measure, kinds: tuple[str, ...], rule: Rule, log: Callable[[str], None]) -> Round:
    default_s, tuned_s = measure(kinds)
    v = judge(list(zip(default_s, tuned_s)), rule, choice="+".join(kinds), baseline="default")
    r = Round(kinds, default_s, tuned_s, v)
    log(f"final check: {r.line()}")
    return r


def final_check(measure: Measure, routed: Sequence[str], *, rule: Rule | None = None,
                host_bound: float | None = None, log: Callable[[str], None] = lambda _m: None) -> FinalCheck:
    """Which of the ``routed`` kinds stay (module docstring); ``measure(kinds)`` gives the
    default's and the tuned side's block medians. Nothing is written: :func:`reset_kinds` does."""
    rule = rule or Rule(margin=STEP_MARGIN, least=2)
    check = FinalCheck(host_bound=host_bound)
    routed = tuple(routed)
    if not routed:
        return check
    whole = _round(measure, routed, rule, log)
    check.rounds.append(whole)
    if whole.verdict.kept:
        check.kept = routed
        return check
    winners: list[Round] = []
    if len(routed) > 1:
        alone = [_round(measure, (k,), rule, log) for k in routed]
        check.rounds += alone
        winners = [r for r in alone if r.verdict.kept]
    if len(winners) > 1:
        together = _round(measure, tuple(k for r in winners for k in r.kinds), rule, log)
        check.rounds.append(together)
        if together.verdict.kept:
            check.kept = together.kinds
            return check
    if winners:
        check.kept = max(winners, key=lambda r: r.verdict.speedup or 0.0).kinds
    return check


def reset_kinds(cache: str, kinds: Iterable[str], activation: Any, check: FinalCheck) -> dict[str, int]:
    """Every usable entry (this device, ``activation.versions``) of ``kinds`` whose choice is not
    its kind's baseline becomes the baseline's solution, its ``in_step`` saying why (the step's
    figure without the kind's choices kept); returns kind -> entries reset."""
    from primus_perf.cache.store import TuningCache
    from primus_perf.runtime import dispatch
    from primus_perf.tuner.core import confirmed_entry

    store = TuningCache(cache)
    entries = store.entries()
    whole = check.rounds[0].verdict if check.rounds else None
    why = (f"the step with the cache ran {whole.speedup:.3f}x the default, not past the noise"
           + (", nor with this kind's choices alone" if len(check.rounds) > 1 else "")
           if whole is not None and whole.speedup is not None else "the step with the cache did not win")
    changed, counts = [], {}
    for kind in kinds:
        d = dispatch.of(kind)
        baseline = d.baseline_solution(d.baseline_name())
        if baseline is None:
            continue
        mine = [e for e in entries if e.kind == kind]
        usable = store.select(mine, activation.device, activation.versions.get(kind)).values()
        reset = []
        for e in usable:
            if e.solution.get("config") == baseline["config"]:
                continue
            config = e.solution.get("config") or {}
            figure = dict(e.in_step or {})
            figure.setdefault("choice", str(config.get("name") or config.get("backend") or "cached"))
            figure.update({"verdict": DROPPED, "reason": why, "scope": "step", "baseline": d.baseline_name(),
                           "step_speedup": whole.speedup if whole is not None else None})
            reset.append(confirmed_entry(e, figure, baseline))
        changed += reset
        counts[kind] = len(reset)
    store.put_many(changed)
    return {k: n for k, n in counts.items() if n}


def drop(check: FinalCheck, routed: Sequence[str], cache: str, activation: Any) -> FinalCheck:
    """:func:`reset_kinds` of the ``routed`` kinds ``check`` did not keep, recorded in it."""
    lost = [k for k in routed if k not in check.kept]
    return dataclasses.replace(check, dropped=reset_kinds(cache, lost, activation, check) if lost else {})
