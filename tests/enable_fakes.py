"""Fakes shared by the enable and online tests: a kernel table whose one row ("fakeblas")
computes the product in float64 and counts its calls, a kind table that uses it (so GEMM
routing runs on the CPU), and a device clock that advances only when a fake kernel runs."""

from __future__ import annotations

from collections import Counter

import torch

from primus_perf.cache.runtime import KINDS, RouterKind
from primus_perf.cache.store import CacheEntry
from primus_perf.devices import DeviceIdentity
from primus_perf.kernels.gemm import GemmRouter, torch_mm
from primus_perf.problems import GemmProblem

FAKE_SOURCE = "fakeblas"
FAKE_VERSIONS = {"fakeblas": "1.0"}
H100 = DeviceIdentity("NVIDIA H100 80GB HBM3", "nvidia", "sm_90", 132)
launched: Counter[str] = Counter()  # problem key -> calls of the fake kernel


class FakeKernel:
    def __init__(self, problem: GemmProblem) -> None:
        self.key = problem.key()

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        launched[self.key] += 1
        return torch_mm(a.double(), b.double()).to(a.dtype)  # past the overrides, as a library kernel

    def close(self) -> None:
        pass


def fake_factory(problem, solution, device):
    return FakeKernel(problem)


FAKE_TABLE = {FAKE_SOURCE: fake_factory}
FAKE_KINDS = {
    "gemm": RouterKind(lambda es: GemmRouter.from_entries(list(es), FAKE_TABLE), lambda: dict(FAKE_VERSIONS),
                       lambda: GemmRouter([], FAKE_TABLE)),
    "attention": KINDS["attention"],
}


def gemm_entry(problem: GemmProblem, device: DeviceIdentity, source: str = FAKE_SOURCE,
               versions: dict | None = None) -> CacheEntry:
    return CacheEntry(kind="gemm", problem_key=problem.key(), problem=problem.to_dict(), device=device.to_dict(),
                      versions=dict(FAKE_VERSIONS if versions is None else versions),
                      solution={"config": {"name": "fake", "source": source}, "blob": b""},
                      times={"tuned_ms": 1.0, "default_ms": 1.1}, tuner_version="test")
