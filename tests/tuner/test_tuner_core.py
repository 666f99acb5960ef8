"""The tuner core on the CPU, with the real GEMM and attention plugins and a fake timer at
the seam: one selection policy (margin for keeping the default, invalid candidates never
chosen) for both kinds; the tune loop's dedupe, resume, write-after-each-problem and Ctrl-C;
the CLI's table so far, resume hint and exit 130."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from primus_perf.base.devices import current_device
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.attention.backends import sdpa_bshd
from primus_perf.problems import AttentionProblem, GemmProblem
from primus_perf.tuner import core, kinds
from primus_perf.tuner.core import OFFLINE_RULE, Candidate
from primus_perf.tuner.decide import MARGIN, MIN_SAVING_S, Rule, decide, judge, paired
from primus_perf.tuner.gemm.plugin import GemmTuner, python_candidate

pytest.importorskip("triton")  # the attention plugin imports the Triton kernels

from primus_perf.tuner.attention.plugin import AttentionTuner

kinds.plugins()  # the registry resolves (and keeps) the real plugin classes before any test patches one

GEMM = GemmProblem.from_row_major(64, 48, 32, b_transposed=True, dtype="f32")
ATTENTION = AttentionProblem(1, 2, 1, 32, 32, 16, "f16", True)


def gemm_tuner(fast, wrong) -> GemmTuner:
    return GemmTuner(library=None, device="cpu", extra=[python_candidate("fast", fast), python_candidate("wrong", wrong)])


def _gemm_case():
    def fast(a, b, out):
        torch.mm(a, b, out=out)

    def wrong(a, b, out):  # half the product: fast, and wrong
        k = a.shape[1] // 2
        torch.mm(a[:, :k], b[:k], out=out)

    return gemm_tuner(fast, wrong), GEMM


def _attention_case():
    fast = Candidate("fast", {"backend": "sdpa:default"}, run=lambda q, k, v, causal: sdpa_bshd(q, k, v, causal))
    # forgetting the causal mask: a plausible bug the reference check must catch
    wrong = Candidate("wrong", {"backend": "sdpa:default"}, run=lambda q, k, v, causal: sdpa_bshd(q, k, v, False))
    return AttentionTuner(strategy=None, backends=(), extra=[fast, wrong], device="cpu"), ATTENTION


CASES = {"gemm": _gemm_case, "attention": _attention_case}


def fake_timer(seconds: dict[str, float], log: list | None = None):
    """A timer that runs nothing: every part of candidate ``name`` takes ``seconds[name]``
    (split evenly over its parts); the default's name maps to 1.0."""

    def timer(calls, n_sets, reps, seed=0):
        if log is not None:
            log.append(sorted({k[0] for k in calls}))
        parts = {}
        for name, _ in calls:
            parts[name] = parts.get(name, 0) + 1
        return {k: [seconds.get(k[0], 1.0) / parts[k[0]]] * reps for k in calls}

    return timer


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize(
    ("fast_s", "expect"),
    [(0.995, "default"), (0.98, "fast")],  # the documented margin: 1%
    ids=["within-margin-keeps-default", "beyond-margin-wins"],
)
def test_selection_policy_is_the_same_for_every_kind(kind: str, fast_s: float, expect: str) -> None:
    tuner, problem = CASES[kind]()
    res = core.tune_problem(tuner, problem, timer=fake_timer({"fast": fast_s, "wrong": 0.1}))
    default = res.candidates[0].name
    assert default == {"gemm": "torch", "attention": "sdpa:default"}[kind]
    assert res.chosen == (default if expect == "default" else "fast")
    stats = {c.name: c for c in res.candidates}
    # the wrong candidate is the fastest by far, and is never chosen: it fails validation
    assert stats["wrong"].status == "rejected" and "relative error" in stats["wrong"].reason
    assert stats["fast"].error is not None and stats["fast"].error <= 1e-2
    assert res.tuned_s == pytest.approx(fast_s if expect == "fast" else 1.0)
    assert res.default_s == pytest.approx(1.0)
    assert res.speedup == pytest.approx(1.0 / res.tuned_s) and res.to_dict()["speedup"] == res.speedup
    entry = res.entry
    assert entry.kind == kind and entry.problem_key == problem.key()
    assert entry.solution["config"]["name"] == res.chosen
    assert entry.times == {"tuned_ms": pytest.approx(res.tuned_s * 1e3), "default_ms": pytest.approx(1e3)}


@pytest.mark.parametrize("kind", CASES)
def test_rough_pass_drops_slow_candidates_but_keeps_the_default(kind: str) -> None:
    tuner, problem = CASES[kind]()
    log: list = []
    res = core.tune_problem(tuner, problem, timer=fake_timer({"fast": 2.0}, log))
    default = res.candidates[0].name
    assert log == [sorted([default, "fast"]), [default]]  # rough: every valid one; final: not the slow one
    assert {c.name: c.status for c in res.candidates}["fast"] == "dropped" and res.chosen == default
    log.clear()
    res = core.tune_problem(tuner, problem, timer=fake_timer({"fast": 0.1}, log))
    assert log[1] == log[0]  # the default, 10x the best, stays for the final pass
    assert {c.name: c.status for c in res.candidates}[default] == "measured" and res.chosen == "fast"


def select(times_s: dict[str, list[float] | float], default: str, rule: Rule = OFFLINE_RULE) -> str:
    """The offline race's choice (``core.tune_problem``): each candidate's rounds paired with
    the default's, judged by the one rule, the best kept one else the default. A number is
    the same time in each of 4 rounds."""
    rounds = {n: list(t) if isinstance(t, list) else [t] * 4 for n, t in times_s.items()}
    return decide(default, {n: judge(p, rule) for n, p in paired(rounds, default).items()})


def test_select_is_the_one_policy() -> None:
    assert MARGIN == 0.01 and OFFLINE_RULE.margin == MARGIN and OFFLINE_RULE.min_saving_s == MIN_SAVING_S
    assert select({"d": 1.0, "x": 0.995}, "d") == "d"
    assert select({"d": 1.0, "x": 0.98}, "d") == "x"
    assert select({"d": 1.0, "x": 1.2}, "d") == "d"
    assert select({"d": 1.0, "x": 0.95}, "d", Rule(margin=0.1, min_saving_s=MIN_SAVING_S)) == "d"
    # a 5% win of a 6 us kernel saves less than a routed call costs: keep the default
    assert select({"d": 6e-6, "x": 5.7e-6}, "d") == "d"
    assert select({"d": 600e-6, "x": 590e-6}, "d") == "x"  # 10 us, 1.7%
    # the best kept candidate wins; a 3% median win inside rounds this noisy keeps the default
    assert select({"d": 1.0, "x": 0.98, "y": 0.9}, "d") == "y"
    assert select({"d": [1.0] * 4, "x": [0.8, 1.2, 0.95, 0.99]}, "d") == "d"


# ---- the loop -------------------------------------------------------------------------


def problems(n: int) -> list[GemmProblem]:
    return [GemmProblem.from_row_major(16 * (i + 1), 32, 16, b_transposed=True, dtype="f32") for i in range(n)]


class CountingTuner(GemmTuner):
    """The real GEMM plugin (torch and planted candidates, no library), counting sessions."""

    def __init__(self) -> None:
        super().__init__(library=None, device="cpu", extra=[python_candidate("fast", lambda a, b, out: torch.mm(a, b, out=out))])
        self.opened: list[str] = []

    def open(self, problem, timer, step):
        self.opened.append(problem.key())
        return super().open(problem, timer, step)


def interrupting_timer(cache: Path, stop_at: int, seen: list[int]):
    """Two timer calls per problem (rough, final); raises KeyboardInterrupt in problem
    ``stop_at`` (1-based) and records how many entries the cache had at each problem's start."""
    inner = fake_timer({"fast": 0.5})
    calls = [0]

    def timer(c, n_sets, reps, seed=0):
        problem = calls[0] // 2 + 1
        if calls[0] % 2 == 0:
            seen.append(len(TuningCache(cache).entries()) if cache.exists() else 0)
        calls[0] += 1
        if problem == stop_at:
            raise KeyboardInterrupt
        return inner(c, n_sets, reps, seed)

    return timer


def test_loop_dedupes_writes_after_each_problem_and_resumes(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    probs = problems(5)
    tuner = CountingTuner()
    seen: list[int] = []
    run = core.tune([probs[0], probs[1], probs[0], probs[2]], cache=cache, tuners=[tuner],
                    timer=interrupting_timer(cache, 0, seen))
    assert not run.interrupted and run.remaining == []
    assert tuner.opened == [p.key() for p in probs[:3]]  # the repeated problem once
    assert seen == [0, 1, 2]  # written after each problem, before the next one starts
    assert [r.chosen for r in run.results] == ["fast"] * 3 and run.tuned == 3 and run.cached == 0

    tuner2 = CountingTuner()
    run = core.tune(probs, cache=cache, tuners=[tuner2], timer=fake_timer({"fast": 0.5}))
    assert tuner2.opened == [p.key() for p in probs[3:]]  # resume: cached problems are not tuned
    assert run.cached == 3 and run.tuned == 2
    assert [r.problem for r in run.results] == probs
    assert all(r.cached for r in run.results[:3]) and run.results[0].chosen == "fast"
    assert len(TuningCache(cache).entries()) == 5


def test_ctrl_c_keeps_finished_entries_and_reports_the_rest(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    probs = problems(5)
    run = core.tune(probs, cache=cache, tuners=[CountingTuner()], timer=interrupting_timer(cache, 3, []))
    assert run.interrupted
    assert [r.problem for r in run.results] == probs[:2]
    assert run.remaining == probs[2:]
    assert {e.problem_key for e in TuningCache(cache).entries()} == {p.key() for p in probs[:2]}
    assert all(e.device == current_device().to_dict() for e in TuningCache(cache).entries())


def test_cli_prints_the_table_so_far_and_exits_130_on_ctrl_c(tmp_path: Path, monkeypatch) -> None:
    from primus_perf.cli.tune import app
    from primus_perf.tuner import measure
    from primus_perf.tuner.gemm import plugin

    cache = tmp_path / "cache.json"
    probs = problems(5)
    pfile = tmp_path / "problems.json"
    pfile.write_text(json.dumps([p.to_dict() for p in probs]))
    fast = python_candidate("fast", lambda a, b, out: torch.mm(a, b, out=out))
    monkeypatch.setattr(plugin, "GemmTuner", functools.partial(GemmTuner, library=None, device="cpu", extra=[fast]))
    monkeypatch.setattr(measure, "default_timer", lambda: interrupting_timer(cache, 3, []))
    res = CliRunner().invoke(app, ["gemm", "--problems", str(pfile), "--cache", str(cache)])
    assert res.exit_code == 130, res.output
    out = " ".join(res.output.split())
    table = out.split("interrupted:")[0]
    assert str(probs[0]) in table and str(probs[1]) in table and table.count("fast") == 2
    assert "interrupted: 2 tuned and 0 already cached" in out and "3 left" in out
    assert "Resume with the same command" in out and "Aborted" not in out
    assert len(TuningCache(cache).entries()) == 2

    monkeypatch.setattr(measure, "default_timer", lambda: fake_timer({"fast": 0.5}))
    res = CliRunner().invoke(app, ["gemm", "--problems", str(pfile), "--cache", str(cache)])
    assert res.exit_code == 0, res.output
    assert "3 tuned, 2 already in the cache" in " ".join(res.output.split())
