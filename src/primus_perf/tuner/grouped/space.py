"""The search space of the Triton grouped GEMM (the tuner's side of its configs; the configs
and their validity rules are ``kernels.grouped.configs``): the values tried per parameter,
per vendor (:data:`STAGES`, :data:`VENDOR_OPTION_VALUES`), the grid of their product, the
prune hook that keeps the configs that can run a problem (:func:`prune`), and the few
points online tuning races (:data:`ONLINE_SEEDS`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from primus_perf.kernels.grouped.configs import GROUP_ORDERS, GroupedGemmConfig, config_invalid
from primus_perf.problems import GroupedGemmProblem

# Per vendor, the pipeline stages the search tries (ROCm's Triton pipelines differently) ...
STAGES: dict[str, tuple[int, ...]] = {"nvidia": (3, 4), "amd": (2,), "cpu": (2,)}
# ... and the values of the vendor's own launch options (``kernels.triton_launch``)
VENDOR_OPTION_VALUES: dict[str, dict[str, tuple[int, ...]]] = {
    "nvidia": {},
    "cpu": {},
    "amd": {"waves_per_eu": (0, 2), "matrix_instr_nonkdim": (16,)},
}


# Per vendor, the configs online tuning (which has no search) races next to the default
# config: the space's points the offline search picked most on that vendor's GPUs. On an
# H100 it picked 128 x 256 x 64 with 8 warps (4 stages; 3 for the weight gradients) for every
# grouped problem of qwen3-30b-a3b (128 experts, seq 4096): against Triton's default config
# as the trainer's backend the offline cache ran 1.030x in the step and the online one
# 1.001x without these seeds, 1.019x with them (1.18-1.31x a call). Against torch's
# grouped_mm without padding they lose (0.58-0.80x a call) and go after one or two pairs.
ONLINE_SEEDS: dict[str, tuple[GroupedGemmConfig, ...]] = {
    "nvidia": (GroupedGemmConfig(block_n=256, num_stages=4), GroupedGemmConfig(block_n=256, num_stages=3)),
    "amd": (),
    "cpu": (),
}


def prune(configs: Iterable[GroupedGemmConfig], problem: GroupedGemmProblem,
          arch: str) -> tuple[list[GroupedGemmConfig], dict[str, str]]:
    """The configs that can run ``problem`` on ``arch``, in order, and why each other one
    cannot (by its label)."""
    kept: list[GroupedGemmConfig] = []
    pruned: dict[str, str] = {}
    for cfg in configs:
        why = config_invalid(cfg, problem, arch)
        if why is None:
            kept.append(cfg)
        else:
            pruned[cfg.label()] = why
    return kept, pruned


@dataclass(frozen=True)
class SearchSpace:
    """Values tried per parameter; the grid is their product, minus invalid points."""

    axes: dict[str, tuple[Any, ...]]

    def grid(self) -> list[GroupedGemmConfig]:
        names = list(self.axes)
        return [GroupedGemmConfig(**dict(zip(names, values, strict=True)))
                for values in itertools.product(*(self.axes[n] for n in names))]

    def configs(self, problem: GroupedGemmProblem, arch: str) -> list[GroupedGemmConfig]:
        """The grid's configs that can run ``problem`` on ``arch`` (:func:`prune`)."""
        return prune(self.grid(), problem, arch)[0]


def default_space(vendor: str) -> SearchSpace:
    """The space searched on a GPU: Hopper/CDNA-sized tiles (64 or 128 rows, 128 or 256
    columns, 64 deep), 4 or 8 warps, 3 or 4 stages on NVIDIA (2 on ROCm, whose Triton
    pipelines differently), row tiles in bands of 8, largest groups first (the other order
    only moves the small groups' tail); ROCm options on AMD. About 14 valid configs on
    sm_90 after pruning: each compiles once per pass, so a problem's search stays within
    a minute."""
    return SearchSpace(
        {
            "block_m": (64, 128),
            "block_n": (128, 256),
            "block_k": (64,),
            "num_warps": (4, 8),
            "num_stages": STAGES[vendor],
            "group_m": (8,),
            "group_order": ("largest_first",),
            **VENDOR_OPTION_VALUES[vendor],
        }
    )


def tiny_space() -> SearchSpace:
    """A small space for the CPU interpreter (tests): 16/32 tiles, row bands of 1 and 2,
    both group orders."""
    return SearchSpace(
        {
            "block_m": (16, 32),
            "block_n": (16, 32),
            "block_k": (16, 32),
            "num_warps": (4,),
            "num_stages": (1,),
            "group_m": (1, 2),
            "group_order": GROUP_ORDERS,
        }
    )
