"""A kind is one record: this module defines a complete toy kind (softmax over the last
dimension: its problem type, candidates, router, intercept, tuner plugin, trace part and CLI
part), registers it, tunes it with the public ``primus_perf.tune``, routes a plain program's
``torch.softmax`` calls under ``primus_perf.enable``, finds its problems in a profiler trace
with ``primus_perf.analyze`` and lists them with ``primus-tune toy-softmax``, changing no
file of the package."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

import primus_perf
from primus_perf import kinds
from primus_perf.cache.store import TuningCache
from primus_perf.cli import tune_kind
from primus_perf.kernels.routing import OWN, UNSUPPORTED
from primus_perf.problems import ProblemType
from primus_perf.runtime import dispatch
from primus_perf.runtime.dispatch import Dispatch
from primus_perf.tracelens.analyses.tune_next import tune_next
from primus_perf.tracelens.perf_models import OpModel, TracePart
from primus_perf.tuner.core import Candidate, Reps

KIND = "toy_softmax"
_SOFTMAX = torch.ops.aten._softmax.default
ran: dict[str, int] = {}  # candidate -> calls that ran it


def exp_normalize(x: torch.Tensor) -> torch.Tensor:
    """Softmax by the max-shifted exponentials, normalized: a candidate of its own."""
    ran["exp_normalize"] = ran.get("exp_normalize", 0) + 1
    e = (x - x.amax(dim=-1, keepdim=True)).exp()
    return e / e.sum(dim=-1, keepdim=True)


def make_kind() -> kinds.Kind:
    """The toy kind's record and its parts, defined here."""

    @dataclass(frozen=True)
    class SoftmaxProblem(ProblemType, kind=KIND):
        rows: int
        cols: int
        dtype: str = "f32"

        def key(self) -> str:
            return f"{KIND}:{self.rows}x{self.cols}|{self.dtype}"

        def to_dict(self) -> dict[str, Any]:
            return asdict(self)

        @classmethod
        def from_dict(cls, data: dict[str, Any]) -> SoftmaxProblem:
            return cls(**data)

        @classmethod
        def of(cls, x: torch.Tensor) -> SoftmaxProblem:
            return cls(x.numel() // x.shape[-1], x.shape[-1], {torch.float32: "f32"}[x.dtype])

    def versions() -> dict[str, str]:
        return {"torch": torch.__version__}

    class SoftmaxRouter:
        """Pure: the cached candidate of a call's problem."""

        def __init__(self, choices: dict[str, str]) -> None:
            self.choices = choices

        @classmethod
        def from_entries(cls, entries: list[Any]) -> SoftmaxRouter:
            return cls({e.problem_key: e.solution["config"]["name"] for e in entries})

        def route(self, x: torch.Tensor) -> tuple[str, Any]:
            try:
                key = SoftmaxProblem.of(x).key()
            except KeyError:  # a dtype the toy has no problem for
                return UNSUPPORTED, None
            choice = self.choices.get(key)
            if choice is None:
                return key, None
            return key, OWN if choice == "torch" else (lambda: exp_normalize(x))

        def label(self, key: str) -> str | None:
            return self.choices.get(key)

        def idle(self, baseline: str) -> bool:
            return bool(self.choices) and set(self.choices.values()) == {"torch"}

        def may_route(self, *call: Any) -> bool:
            return True

        def close(self) -> None:
            pass

    class SoftmaxDispatch(Dispatch):
        """The intercept: ``aten::_softmax`` over the last dimension goes to the router."""

        def overrides(self, lib: torch.library.Library, key: str) -> None:
            torch_kernel = torch.library.get_kernel(_SOFTMAX, key)

            def softmax(keyset, x, dim, half_to_float):
                def baseline():
                    return torch_kernel.call_boxed(keyset, x, dim, half_to_float)

                if self.router is None or dim not in (-1, x.dim() - 1) or half_to_float:
                    return baseline()
                found, run = self.router.route(x)
                return self.answer(found, run, baseline)

            lib.impl("_softmax", softmax, key, with_keyset=True)

    class Session:
        """One problem: two candidates, checked against the fp32 reference, timed on its input."""

        n_sets, tolerance, details = 1, 1e-5, {}

        def __init__(self, problem: SoftmaxProblem) -> None:
            self.x = torch.randn(problem.rows, problem.cols)

        def candidates(self) -> list[Candidate]:
            return [Candidate("torch", run=lambda x: torch.softmax(x, -1)), Candidate("exp_normalize", run=exp_normalize)]

        def error(self, c: Candidate) -> float:
            ref = torch.softmax(self.x.double(), -1)
            return ((c.run(self.x).double() - ref).norm() / ref.norm()).item()

        def calls(self, c: Candidate) -> dict[str, Any]:
            return {"fwd": lambda _set: c.run(self.x)}

        def close(self) -> None:
            pass

    class SoftmaxTuner:
        kind, version, problem_type, reps = KIND, "toy-1", SoftmaxProblem, Reps(rough=3, final_min=6, final_max=6)

        def versions(self) -> dict[str, str]:
            return versions()

        def check(self, problem: SoftmaxProblem) -> None:
            pass

        def open(self, problem: SoftmaxProblem, timer: Any, step: Any) -> Session:
            return Session(problem)

    def model(s: Any) -> OpModel | None:
        """The perf model of ``aten::_softmax(x, dim, half_to_float)`` from its recorded inputs."""
        x = s.dims[0]
        if s.types[0] != "float":
            return None
        p = SoftmaxProblem(math.prod(x[:-1]), x[-1])
        return OpModel(KIND, p, "fwd", 5 * p.rows * p.cols, 8 * p.rows * p.cols)  # max, sub, exp, sum, div; f32

    return kinds.Kind(SoftmaxProblem, "toy softmax", ("rows", "cols"), parts={
        "router": kinds.RouterPart(SoftmaxRouter.from_entries, versions),
        "intercept": SoftmaxDispatch,
        "tuner": SoftmaxTuner,
        "trace": TracePart({"aten::_softmax": model}, attainable=0.9, spec=lambda p: f"--problem {p.rows},{p.cols}"),
        "cli": tune_kind.CliPart("Tune softmax over the last dimension.", SoftmaxTuner,
                                 spec=lambda text, options: SoftmaxProblem(*map(int, text.split(","))),
                                 spec_help="rows,cols"),
    })


@pytest.fixture
def toy() -> Any:
    kind = kinds.register(make_kind())
    yield kind
    kinds.unregister(KIND)


def faster_candidate_timer(calls: dict, n_sets: int, reps: int, seed: int = 0) -> dict:
    """Measured times as a GPU would give them: the candidate at 0.6 ms, torch at 1.0 ms."""
    return {key: [0.6e-3 if key[0] == "exp_normalize" else 1.0e-3] * reps for key in calls}


def test_a_toy_kind_defined_here_is_tuned_and_routed_under_enable(toy: kinds.Kind, tmp_path: Path) -> None:
    problem = toy.problem_type(64, 32)
    cache = tmp_path / "cache.json"
    run = primus_perf.tune([problem], cache=cache, timer=faster_candidate_timer)
    (result,) = run.results
    assert result.kind == KIND and result.chosen == "exp_normalize" and result.speedup == pytest.approx(1 / 0.6)
    (entry,) = TuningCache(cache).entries(KIND)
    assert entry.problem_key == problem.key()

    x, other = torch.randn(64, 32), torch.randn(8, 32)  # the tuned problem; one with no entry
    ran.clear()
    with primus_perf.enable(cache, kinds=(KIND,), device_type="cpu", log=None) as tuned:
        assert dispatch.of(KIND).intercepting
        y = torch.softmax(x, dim=-1)  # a plain program's call
        z = torch.softmax(other, dim=-1)
        s = tuned.summary()[KIND]
    assert ran == {"exp_normalize": 1}
    assert s["problems"]["routed"] == {problem.key(): 1} and s["fallback"] == 1
    torch.testing.assert_close(y, x.softmax(-1))
    torch.testing.assert_close(z, other.softmax(-1))
    assert not dispatch.of(KIND).intercepting  # disabled: torch's kernel again
    torch.softmax(x, dim=-1)
    assert ran == {"exp_normalize": 1}


def test_analyze_finds_the_toy_kinds_problems_and_primus_tune_lists_them(toy: kinds.Kind, tmp_path: Path) -> None:
    x = torch.randn(64, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            torch.softmax(x, dim=-1)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    a = primus_perf.analyze(trace)
    (row,) = a.toy_softmax_problems.itertuples(index=False)  # the kind's table, its shape columns
    problem = toy.problem_type(64, 32)
    assert (row.key, row.rows, row.cols, row.calls, row.flops) == (problem.key(), 64, 32, 3, 5 * 64 * 32)
    assert a.totals["toy_softmax_flops_per_step"] == 3 * 5 * 64 * 32
    (command,) = tune_next(a.problem_tables())["command"]
    assert command == "primus-tune toy-softmax --problem 64,32"

    app = typer.Typer()  # primus-tune's kind commands, built with the toy registered
    tune_kind.register(app)
    listed = CliRunner().invoke(app, [*command.split()[1:], "--dry-run"])
    assert listed.exit_code == 0, listed.output
    assert f"{problem}  {problem.key()}" in listed.output and "1 unique toy softmax problems" in listed.output
    found = CliRunner().invoke(app, ["toy-softmax", "--from-trace", str(trace), "--dry-run"])
    assert found.exit_code == 0 and found.output == listed.output, found.output
    assert json.loads(json.dumps(a.to_json()["toy_softmax_problems"], default=str))[0]["key"] == problem.key()


def test_the_registry_is_as_it_was_after_the_toy() -> None:
    assert KIND not in kinds.names()
    assert kinds.names() == ("gemm", "grouped_gemm", "attention", "fp8_plan")
