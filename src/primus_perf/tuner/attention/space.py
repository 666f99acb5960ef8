"""The space of Triton tile configs the attention tuner searches: values per parameter
(the grid is their product minus the invalid points, ``kernels.attention.configs``), the
default space per vendor, a tiny space for the CPU interpreter, and known-good seeds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from primus_perf.kernels.attention.configs import (
    AttnConfig,
    BwdConfig,
    FwdConfig,
    bwd_invalid,
    fwd_invalid,
)
from primus_perf.problems import AttentionProblem

STRATEGIES = ("grid", "tpe")  # exhaustive, or optuna TPE (search.py)

# Per vendor, the pipeline stages the search tries for the forward and the backward kernels
# (ROCm's Triton pipelines differently) ...
STAGES: dict[str, dict[str, tuple[int, ...]]] = {
    "nvidia": {"fwd": (2, 3), "bwd": (2, 3)},
    "cpu": {"fwd": (2, 3), "bwd": (2, 3)},
    "amd": {"fwd": (1, 2), "bwd": (1,)},
}
# ... and the values of the vendor's own launch options (``kernels.triton_launch``)
VENDOR_OPTION_VALUES: dict[str, dict[str, tuple[int, ...]]] = {
    "nvidia": {},
    "cpu": {},
    "amd": {"waves_per_eu": (0, 1, 2), "matrix_instr_nonkdim": (16, 32)},
}

@dataclass(frozen=True)
class SearchSpace:
    """Values tried per parameter; the grid is their product, minus invalid points."""

    fwd: dict[str, tuple[int, ...]]
    bwd: dict[str, tuple[int, ...]]

    def fwd_configs(self, problem: AttentionProblem, arch: str) -> list[FwdConfig]:
        return _product(FwdConfig, self.fwd, lambda c: fwd_invalid(c, problem, arch))

    def bwd_configs(self, problem: AttentionProblem, arch: str) -> list[BwdConfig]:
        return _product(BwdConfig, self.bwd, lambda c: bwd_invalid(c, problem, arch))


def _product(cls: type, axes: dict[str, tuple[int, ...]], invalid) -> list[Any]:
    names = list(axes)
    grid = (cls(**dict(zip(names, values, strict=True))) for values in itertools.product(*axes.values()))
    return [cfg for cfg in grid if invalid(cfg) is None]


def default_space(vendor: str, head_dim: int) -> SearchSpace:
    """The space searched on a GPU: blocks, warps, stages; vendor options on ROCm."""
    extra = VENDOR_OPTION_VALUES[vendor]
    fwd = {
        "block_m": (64, 128),
        "block_n": (32, 64, 128),
        "num_warps": (4, 8),
        "num_stages": STAGES[vendor]["fwd"],
        **extra,
    }
    # backward: tile pairs (small, big) shared by dK/dV (M1 small, N1 big) and dQ
    bwd = {
        "block_m1": (32, 64),
        "block_n1": (64, 128),
        "block_m2": (64, 128),
        "block_n2": (32, 64),
        "num_warps": (4, 8),
        "num_stages": STAGES[vendor]["bwd"],
        **extra,
    }
    return SearchSpace(fwd=fwd, bwd=bwd)


def tiny_space() -> SearchSpace:
    """A small space for the CPU interpreter (tests): 16/32 blocks."""
    return SearchSpace(
        fwd={"block_m": (16, 32), "block_n": (16, 32), "num_warps": (4,), "num_stages": (1,)},
        bwd={
            "block_m1": (16,),
            "block_n1": (16, 32),
            "block_m2": (16, 32),
            "block_n2": (16,),
            "num_warps": (4,),
            "num_stages": (1,),
        },
    )


def known_good(vendor: str, head_dim: int) -> list[AttnConfig]:
    """Seeds for TPE: configs that are fast on most problems of this vendor."""
    if vendor == "amd":
        return [
            AttnConfig(
                FwdConfig(128, 64, 4, 1, waves_per_eu=2, matrix_instr_nonkdim=16),
                BwdConfig(32, 128, 128, 32, 4, 1, waves_per_eu=1, matrix_instr_nonkdim=16),
            )
        ]
    # measured on an H100 (b4 h32 s4096 d128 causal bf16): the fastest forward and the two
    # fastest backward tiles of the grid
    if head_dim <= 64:
        return [
            AttnConfig(FwdConfig(128, 64, 4, 3), BwdConfig(64, 64, 64, 32, 4, 2)),
            AttnConfig(FwdConfig(64, 64, 4, 3), BwdConfig(64, 128, 128, 64, 8, 3)),
        ]
    return [
        AttnConfig(FwdConfig(64, 64, 4, 3), BwdConfig(64, 128, 128, 64, 8, 3)),
        AttnConfig(FwdConfig(128, 64, 8, 3), BwdConfig(64, 64, 64, 32, 4, 2)),
    ]


def grid_size(space: SearchSpace, problem: AttentionProblem, arch: str) -> tuple[int, int]:
    """How many valid forward and backward configs the space has for this problem."""
    return len(space.fwd_configs(problem, arch)), len(space.bwd_configs(problem, arch))
