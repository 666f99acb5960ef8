"""A kind is one record: this module defines a complete toy kind (softmax over the last
dimension: its problem type, candidates, router, intercept and tuner plugin), registers it,
tunes it with the public ``primus_perf.tune`` and routes a plain program's ``torch.softmax``
calls under ``primus_perf.enable``, changing no file of the package."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import primus_perf
from primus_perf import kinds
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.routing import OWN, UNSUPPORTED
from primus_perf.problems import ProblemType
from primus_perf.runtime import dispatch
from primus_perf.runtime.dispatch import Dispatch
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

    return kinds.Kind(SoftmaxProblem, "toy softmax", ("rows", "cols"), parts={
        "router": kinds.RouterPart(SoftmaxRouter.from_entries, versions),
        "intercept": SoftmaxDispatch,
        "tuner": SoftmaxTuner,
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


def test_the_registry_is_as_it_was_after_the_toy() -> None:
    assert KIND not in kinds.names()
    assert kinds.names() == ("gemm", "grouped_gemm", "attention", "fp8_plan")
