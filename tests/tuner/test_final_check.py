"""The final check of a tuned cache (``tuner.final_check``): which routed kinds stay, decided on
the step's block medians by the one rule, with a program whose step times each kind moves by a
known amount; and what a cache the step did not bear out becomes."""

from __future__ import annotations

from pathlib import Path

import pytest

from primus_perf.base.devices import current_device
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kernels.attention.router import library_versions
from primus_perf.problems import AttentionProblem
from primus_perf.runtime.activate import activate
from primus_perf.tuner.decide import host_bound
from primus_perf.tuner.final_check import NOTHING_KEPT, FinalCheck, drop, final_check


def program(effect: dict[str, float], together: float = 0.0, blocks: int = 4):
    """``measure(kinds)`` of a 10 ms step that each routed kind makes ``effect[kind]`` ms
    shorter (negative: longer), plus ``together`` ms when several are routed; the blocks jitter
    by 0.01 ms. Records the rounds asked for."""
    asked: list[tuple[str, ...]] = []

    def measure(kinds: tuple[str, ...]) -> tuple[list[float], list[float]]:
        asked.append(kinds)
        step = 10.0 - sum(effect[k] for k in kinds) - (together if len(kinds) > 1 else 0.0)
        jitter = [0.0, 0.01, -0.01, 0.005][:blocks]
        return [(10.0 + j) / 1e3 for j in jitter], [(step - j) / 1e3 for j in jitter]

    return measure, asked


def test_a_cache_that_wins_the_step_is_kept_whole_in_one_round() -> None:
    measure, asked = program({"gemm": 0.3, "attention": 0.2})
    check = final_check(measure, ("gemm", "attention"))
    assert check.kept == ("gemm", "attention") and asked == [("gemm", "attention")]
    assert check.speedup == pytest.approx(10 / 9.5, rel=1e-3)
    assert check.lines()[-1].startswith("speedup with the cache: 1.05")


def test_a_losing_kind_is_found_alone_and_the_winner_kept() -> None:
    """The whole cache is slower (attention's choice costs more than GEMM's saves): each kind
    alone, GEMM wins and stays, attention does not."""
    measure, asked = program({"gemm": 0.3, "attention": -0.8})
    check = final_check(measure, ("gemm", "attention"))
    assert asked == [("gemm", "attention"), ("gemm",), ("attention",)]
    assert check.kept == ("gemm",) and check.figure is not None and check.figure.kinds == ("gemm",)


def test_two_winners_alone_that_lose_together_keep_the_better_one() -> None:
    measure, asked = program({"gemm": 0.3, "attention": 0.2}, together=-1.0)
    check = final_check(measure, ("gemm", "attention"))
    assert asked[-1] == ("gemm", "attention") and len(asked) == 4
    assert check.kept == ("gemm",)


def test_within_the_noise_nothing_is_kept() -> None:
    """A cache 0.1% faster is not past STEP_MARGIN: torch's own kernels stay."""
    measure, _ = program({"attention": 0.01})
    check = final_check(measure, ("attention",))
    assert check.kept == () and check.figure is None and check.speedup == 1.0
    assert check.lines()[-1] == f"speedup with the cache: {NOTHING_KEPT}"


def test_a_cache_that_routes_nothing_is_not_measured() -> None:
    measure, asked = program({})
    check = final_check(measure, ())
    assert asked == [] and check.lines() == [f"speedup with the cache: {NOTHING_KEPT} (the cache routes nothing)"]


def test_dropping_a_kind_resets_its_entries_to_the_baseline_and_says_why(tmp_path: Path) -> None:
    cache = tmp_path / "c.json"
    p = AttentionProblem(2, 4, 4, 64, 64, 32, "f32", True, "bshd")
    TuningCache(cache).put(CacheEntry(kind="attention", problem_key=p.key(), problem=p.to_dict(),
                                      device=current_device().to_dict(), versions=library_versions(),
                                      solution={"config": {"backend": "sdpa:math"}, "blob": b""}))
    measure, _ = program({"attention": -0.5})
    check = drop(final_check(measure, ("attention",)), ("attention",), str(cache), activate(cache))
    assert check.dropped == {"attention": 1}
    assert check.lines()[0] == "final check: dropped attention (1 entries reset to the baseline)"
    entry = TuningCache(cache).entries()[0]
    assert entry.solution["config"] == {"backend": "sdpa:default"}
    assert entry.in_step["verdict"] == "dropped" and "ran 0.953x the default" in entry.in_step["reason"]
    assert "torch kept" in entry.claim()


def test_host_bound_is_an_idle_share_of_the_step() -> None:
    assert host_bound(2e-3, 7e-3) == pytest.approx(2 / 7)  # the tiny step on an H200: mostly idle
    assert host_bound(6.5e-3, 7e-3) is None  # busy 93%: not host-bound
    assert host_bound(None, 7e-3) is None and host_bound(1e-3, None) is None
    assert FinalCheck().speedup == 1.0
