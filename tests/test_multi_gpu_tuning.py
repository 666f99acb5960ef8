"""Tuning on several GPUs, on the CPU: real worker processes (spawned) run the real GEMM
plugin on the CPU through an injected worker function; the split balances FLOPs, one
cache receives every entry, one progress sees every problem, a killed worker is reported
and the same call resumes with what it left."""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from primus_perf.cache.store import TuningCache
from primus_perf.errors import UserError
from primus_perf.problems import GemmProblem
from primus_perf.tuner import core
from primus_perf.tuner.gemm.plugin import GemmTuner
from primus_perf.tuner.multi_gpu import (
    flops_of,
    resolve_gpus,
    run_worker,
    split_by_cost,
    tune_on_gpus,
)

CPU_TUNER = functools.partial(GemmTuner, library=None, device="cpu")
# 16 problems of unequal cost: a count split would give one worker far more FLOPs
PROBLEMS = [GemmProblem.from_row_major(16 * (1 + i % 4), 24 + 8 * i, 32, b_transposed=True, dtype="f32")
            for i in range(16)]


def logging_worker(job: Any, conn: Any) -> None:
    """The library's worker, after noting which process and visible GPU got which share."""
    log = Path(job.cache).with_name(f"worker{job.gpu}.json")
    log.write_text(json.dumps({"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                               "keys": [p.key() for p in job.problems]}))
    run_worker(job, conn)


class _DieAfterFirstDone:
    """A connection that kills its process (SIGKILL: no clean-up) after the first result."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        self.conn.send(message)
        if message[0] == "done":
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self.conn.close()


def dying_worker(job: Any, conn: Any) -> None:
    """GPU 1's worker is killed after its first problem; GPU 0's finishes."""
    run_worker(job, _DieAfterFirstDone(conn) if job.gpu == 1 else conn)


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


def _tune(cache: Path, worker: Any, progress: core.Progress | None = None) -> core.TuneRun:
    return tune_on_gpus([*PROBLEMS, PROBLEMS[0]], cache=cache, make_tuner=CPU_TUNER, gpus=2,
                        budget_s=0.01, progress=progress, worker=worker)


def test_split_balances_flops_not_counts() -> None:
    shares = split_by_cost(PROBLEMS, 2)
    assert sorted(p.key() for s in shares for p in s) == sorted(p.key() for p in PROBLEMS)
    for share in shares:  # input order kept inside a share
        assert [PROBLEMS.index(p) for p in share] == sorted(PROBLEMS.index(p) for p in share)
    loads = [sum(flops_of(p) for p in s) for s in shares]
    assert max(loads) / min(loads) < 1.05, loads
    halves = [PROBLEMS[:8], PROBLEMS[8:]]  # what splitting by count in order would give
    by_count = [sum(flops_of(p) for p in s) for s in halves]
    assert max(by_count) / min(by_count) > 1.5
    # one costly problem and many cheap ones: the costly one is alone
    cost = {"big": 100, **{f"s{i}": 1 for i in range(10)}}
    shares = split_by_cost(list(cost), 3, cost=cost.__getitem__)
    assert ["big"] in shares and sorted(len(s) for s in shares) == [1, 5, 5]
    assert split_by_cost(["a"], 3, cost=lambda _p: 1) == [["a"], [], []]


def test_two_workers_fill_one_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    progress = Recorder()
    run = _tune(cache, logging_worker, progress)
    assert not run.interrupted and not run.failures and not run.remaining
    assert [r.problem for r in run.results] == PROBLEMS  # deduped, in input order
    entries = TuningCache(cache).entries("gemm")
    assert sorted(e.problem_key for e in entries) == sorted(p.key() for p in PROBLEMS)
    assert progress.total == 16 and progress.started == 16 and len(progress.results) == 16
    assert {label.split(":")[0] for label in progress.steps} == {"gpu 0", "gpu 1"}
    logs = [json.loads((tmp_path / f"worker{g}.json").read_text()) for g in (0, 1)]
    assert [w["visible"] for w in logs] == ["0", "1"]  # one GPU each
    assert len({w["pid"] for w in logs} | {os.getpid()}) == 3  # two processes besides this one
    assert [w["keys"] for w in logs] == [[p.key() for p in s] for s in split_by_cost(PROBLEMS, 2)]


def test_killed_worker_is_reported_and_the_same_call_resumes(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    first = _tune(cache, dying_worker)
    assert len(first.failures) == 1 and first.failures[0].startswith("gpu 1: worker exited with code -9")
    share1 = split_by_cost(PROBLEMS, 2)[1]
    assert len(first.remaining) == len(share1) - 1
    assert {p.key() for p in first.remaining} < {p.key() for p in share1}
    stored = {e.problem_key for e in TuningCache(cache).entries()}
    assert stored == {r.problem.key() for r in first.results} and len(stored) == 16 - len(first.remaining)
    second = _tune(cache, logging_worker)
    assert not second.failures and not second.remaining
    assert second.cached == len(stored) and second.tuned == len(first.remaining)
    assert sorted(e.problem_key for e in TuningCache(cache).entries()) == sorted(p.key() for p in PROBLEMS)


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
    entries = TuningCache(cache).entries("gemm")
    assert len(entries) == 4 and {e.device["name"] for e in entries} == {torch.cuda.get_device_name(0)}
    assert [json.loads((tmp_path / f"worker{g}.json").read_text())["visible"] for g in (0, 1)] == ["0", "1"]
