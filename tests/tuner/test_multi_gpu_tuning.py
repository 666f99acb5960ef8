"""Tuning on several GPUs, on the CPU: real worker processes (spawned) run the real GEMM
plugin on the CPU, some through a tuner that sleeps a set time per problem (a problem's
time unrelated to its FLOPs) or a worker that kills itself on one problem. Pulling keeps
the workers equally busy, one cache receives every entry, one progress sees every
problem, a killed worker's problem is retried once, Ctrl-C lets the workers finish their
problems (twice: stops them), and the same call resumes."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from primus_perf.base.errors import UserError
from primus_perf.cache.store import TuningCache
from primus_perf.cli.tune_run import run_tuning
from primus_perf.problems import GemmProblem
from primus_perf.tuner import core
from primus_perf.tuner.gemm.plugin import GemmTuner
from primus_perf.tuner.multi_gpu import (
    MultiGpuRun,
    flops_of,
    resolve_gpus,
    run_worker,
    tune_on_gpus,
)

CPU_TUNER = functools.partial(GemmTuner, library=None, device="cpu")
PROBLEMS = [GemmProblem.from_row_major(16 * (1 + i % 4), 24 + 8 * i, 32, b_transposed=True, dtype="f32")
            for i in range(16)]
# one problem with more FLOPs than all the others together, tuned at once, and ten slow
# small ones: any split that balances FLOPs gives one worker the big problem alone and the
# other all ten slow ones (3 s against nothing)
BIG = GemmProblem.from_row_major(256, 256, 256, b_transposed=True, dtype="f32")
SLOW_S = 0.3
UNEVEN = [BIG, *PROBLEMS[:10]]


class SleepyTuner(GemmTuner):
    """The CPU GEMM tuner, after sleeping ``delays[problem key]`` seconds (0 if absent)."""

    def __init__(self, *, delays: dict[str, float], slept: Path | None = None, **kwargs: Any) -> None:
        super().__init__(library=None, device="cpu", **kwargs)
        self.delays, self.slept = delays, slept

    def open(self, problem: GemmProblem, timer: Any, step: Any) -> Any:
        delay = self.delays.get(problem.key(), 0.0)
        time.sleep(delay)
        if delay and self.slept is not None:  # a sleep that ran to its end
            self.slept.touch()
        return super().open(problem, timer, step)


def sleepy(delays: dict[GemmProblem, float], slept: Path | None = None) -> Any:
    return functools.partial(SleepyTuner, delays={p.key(): s for p, s in delays.items()}, slept=slept)


def logging_worker(job: Any, conn: Any) -> None:
    """The library's worker, after noting its process, visible GPU and whether Ctrl-C reaches it."""
    log = Path(job.cache).with_name(f"worker{job.gpu}.json")
    log.write_text(json.dumps({"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                               "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}))
    run_worker(job, conn)


class _DieOn:
    """A connection that kills its process (SIGKILL: no clean-up) when handed ``key``."""

    def __init__(self, conn: Any, key: str) -> None:
        self.conn, self.key = conn, key

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def recv(self) -> Any:
        problem = self.conn.recv()
        if problem is not None and problem.key() == self.key:
            os.kill(os.getpid(), signal.SIGKILL)
        return problem

    def close(self) -> None:
        self.conn.close()


def dying_worker(job: Any, conn: Any) -> None:
    """Every worker is killed when it is handed PROBLEMS[5]."""
    run_worker(job, _DieOn(conn, PROBLEMS[5].key()))


class Recorder(core.Progress):
    def __init__(self) -> None:
        self.total, self.started, self.results, self.steps = 0, 0, [], []

    def start(self, total: int) -> None:
        self.total = total

    def problem(self, problem: Any, index: int) -> None:
        assert index == self.started
        self.started += 1

    def step(self, label: str) -> None:
        self.steps.append(label)

    def done(self, result: core.TuneResult) -> None:
        self.results.append(result)


def ctrl_c_everyone() -> None:
    """What Ctrl-C in a terminal does: SIGINT to this process and to its workers."""
    for pid in [*(p.pid for p in multiprocessing.active_children()), os.getpid()]:
        os.kill(pid, signal.SIGINT)


class CtrlCAt(Recorder):
    """Presses Ctrl-C as the ``index``-th problem (0-based) is handed out; ``twice``: again
    when the run says it is stopping."""

    def __init__(self, index: int, twice: bool = False) -> None:
        super().__init__()
        self.index, self.twice = index, twice

    def problem(self, problem: Any, index: int) -> None:
        super().problem(problem, index)
        if index == self.index:
            ctrl_c_everyone()

    def step(self, label: str) -> None:
        super().step(label)
        if self.twice and label.startswith("stopping"):
            ctrl_c_everyone()


def _tune(problems: list[GemmProblem], cache: Path, *, make_tuner: Any = CPU_TUNER, worker: Any = run_worker,
          progress: core.Progress | None = None, gpus: int = 2) -> MultiGpuRun:
    return tune_on_gpus(problems, cache=cache, make_tuner=make_tuner, gpus=gpus, budget_s=0.01,
                        progress=progress, worker=worker)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory: pytest.TempPathFactory) -> tuple[MultiGpuRun, Recorder, Path]:
    """Two workers tune UNEVEN (and a repeat) through the logging worker and the sleepy tuner."""
    folder = tmp_path_factory.mktemp("uneven")
    progress = Recorder()
    tuner = sleepy({p: SLOW_S for p in UNEVEN if p is not BIG})
    run = _tune([*UNEVEN, UNEVEN[1]], folder / "cache.json", make_tuner=tuner, worker=logging_worker,
                progress=progress)
    return run, progress, folder


def test_two_workers_fill_one_cache(uneven: tuple[MultiGpuRun, Recorder, Path]) -> None:
    run, progress, folder = uneven
    assert not run.interrupted and not run.failures and not run.remaining
    assert [r.problem for r in run.results] == UNEVEN  # deduped, in input order
    entries = TuningCache(folder / "cache.json").entries("gemm")
    assert sorted(e.problem_key for e in entries) == sorted(p.key() for p in UNEVEN)
    assert progress.total == progress.started == len(progress.results) == 11
    assert {label.split(":")[0] for label in progress.steps} == {"gpu 0", "gpu 1"}
    logs = [json.loads((folder / f"worker{g}.json").read_text()) for g in (0, 1)]
    assert [w["visible"] for w in logs] == ["0", "1"]  # one GPU each
    assert len({w["pid"] for w in logs} | {os.getpid()}) == 3  # two processes besides this one
    # Ctrl-C and SIGTERM (also sent to the whole process group) are the parent's
    assert all({signal.SIGINT, signal.SIGTERM} <= set(w["blocked"]) for w in logs), logs
    assert run.workers[0].summary().startswith("gpu 0: start-up ")


def test_pulling_balances_problems_whose_time_is_not_their_flops(uneven: tuple[MultiGpuRun, Recorder, Path]) -> None:
    run, _progress, _folder = uneven
    assert flops_of(BIG) > sum(flops_of(p) for p in UNEVEN[1:])
    a, b = run.workers
    assert [a.gpu, b.gpu] == [0, 1] and a.problems + b.problems == 11
    assert a.startup_s is not None and b.startup_s is not None
    assert all(0 < w.launch_s <= w.startup_s for w in run.workers), run.workers
    # a worker goes idle only when nothing is left to hand out: they stop working within
    # one problem (and some noise) of each other; a split by FLOPs: 3 s and more apart
    finished = [w.startup_s + w.busy_s for w in run.workers]
    longest = max(r.tuning_s for r in run.results)
    assert abs(finished[0] - finished[1]) < longest + 0.5, (run.workers, longest)
    assert min(a.busy_s, b.busy_s) > 2 * SLOW_S and min(a.problems, b.problems) >= 3, run.workers


def test_killed_worker_problem_is_retried_once_and_reported(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    run = _tune(PROBLEMS, cache, worker=dying_worker)
    deadly = PROBLEMS[5]
    assert [p.key() for p in run.remaining] == [deadly.key()]  # all the others were done
    assert [r.problem for r in run.results] == [p for p in PROBLEMS if p is not deadly]
    assert len(run.failures) == 2 and all(f" exited with code -9 while tuning {deadly};" in f for f in run.failures)
    assert run.failures[0].endswith("handed to another GPU") and run.failures[1].endswith("not retried")
    assert {f.split(":")[0] for f in run.failures} == {"gpu 0", "gpu 1"}
    assert sorted(e.problem_key for e in TuningCache(cache).entries()) == sorted(r.problem.key() for r in run.results)
    assert not run.interrupted


def test_ctrl_c_lets_each_worker_finish_its_problem_and_the_same_call_resumes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache.json"
    progress = CtrlCAt(3)
    first = _tune(PROBLEMS, cache, make_tuner=sleepy(dict.fromkeys(PROBLEMS, 0.15)), progress=progress)
    assert first.interrupted and not first.failures
    # none was handed out after Ctrl-C, and every one handed out was finished and kept
    assert progress.started == len(first.results) == 4 and len(first.remaining) == 12
    assert any(label.startswith("stopping") for label in progress.steps)
    stored = {e.problem_key for e in TuningCache(cache).entries()}
    assert stored == {r.problem.key() for r in first.results}
    capsys.readouterr()
    second = run_tuning(PROBLEMS, CPU_TUNER, str(cache), budget_s=0.01, gpus=2)  # the CLI's call
    assert not second.interrupted and not second.failures and not second.remaining
    assert second.cached == 4 and second.tuned == 12
    out = capsys.readouterr().out
    assert "12 tuned, 4 already in the cache" in out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("gpu ")] == ["gpu 0", "gpu 1"]
    assert sorted(e.problem_key for e in TuningCache(cache).entries()) == sorted(p.key() for p in PROBLEMS)


def test_ctrl_c_twice_stops_the_workers_at_once(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    first = max(PROBLEMS, key=flops_of)  # handed out first; the next takes 30 s
    progress = CtrlCAt(1, twice=True)
    slept = tmp_path / "slept"  # touched by a worker whose 30 s sleep ended: the run waited for it
    run = _tune(PROBLEMS, cache, make_tuner=sleepy({p: 30.0 for p in PROBLEMS if p is not first}, slept),
                progress=progress, gpus=1)
    assert not slept.exists()
    assert run.interrupted and not run.failures and progress.started == 2
    assert [r.problem for r in run.results] == [first] and len(run.remaining) == 15
    assert [e.problem_key for e in TuningCache(cache).entries()] == [first.key()]


def test_resolve_gpus() -> None:
    assert resolve_gpus("1") == 1
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(UserError, match="--gpus"):
            resolve_gpus(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_gpus_beyond_the_visible_ones_is_a_user_error() -> None:
    with pytest.raises(UserError, match="visible"):
        resolve_gpus("all")
    with pytest.raises(UserError, match="only 0 GPU"):
        resolve_gpus("2")
    from primus_perf.cli.tune import app

    result = CliRunner().invoke(app, ["gemm", "--problems", "x.json", "--gpus", "2"])
    assert isinstance(result.exception, UserError) and "only 0 GPU" in str(result.exception)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_tune_bf16_gemms_into_one_cache(tmp_path: Path) -> None:
    problems = [GemmProblem.from_row_major(1024 * (i + 1), 2048, 1024, b_transposed=True) for i in range(4)]
    cache = tmp_path / "cache.json"
    run = tune_on_gpus(problems, cache=cache, make_tuner=GemmTuner, gpus=2, budget_s=1.0, worker=logging_worker)
    assert not run.failures and len(run.results) == 4
    assert all(w.startup_s is not None and w.problems >= 1 for w in run.workers), run.workers
    entries = TuningCache(cache).entries("gemm")
    assert len(entries) == 4 and {e.device["name"] for e in entries} == {torch.cuda.get_device_name(0)}
    assert [json.loads((tmp_path / f"worker{g}.json").read_text())["visible"] for g in (0, 1)] == ["0", "1"]
