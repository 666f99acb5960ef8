"""Tile configurations of the Triton grouped GEMM and their validity rules.

A config is data (:class:`GroupedGemmConfig`). :func:`config_invalid` says why a
combination cannot (or should not) run a problem (shared-memory overflow, accumulators that
do not fit the register file, tiles far larger than the problem), before anything is
launched; the tuner's search space (``tuner/grouped/space.py``) prunes with it. Vendor
differences are rows of tables: shared memory per architecture
(:func:`primus_perf.base.devices.shared_memory_per_block`) and the launch options only ROCm's
Triton backend knows (``waves_per_eu``, ``matrix_instr_nonkdim``; ``kernels.triton_launch``
passes them to the launch only on that vendor).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from primus_perf.base.devices import shared_memory_per_block
from primus_perf.kernels.triton_launch import options_label
from primus_perf.problems import DTYPE_BYTES, GroupedGemmProblem, dataclass_from_dict

GROUP_ORDERS = ("natural", "largest_first")

MAX_ACC_REGS = 128  # fp32 accumulator registers per thread a tile may take (of 255)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One Triton grouped-GEMM launch: output tiles of ``block_m x block_n``, ``block_k``
    per inner step; a persistent grid (one program per SM/CU, each walking the (group,
    tile) work items); inside a group ``group_m`` row tiles walk the column tiles together
    (L2 reuse; 1: row by row); groups visited in their own order or largest first.

    The default is the Hopper-sized tile (128 x 128 x 64, 8 warps, 3 stages: 96 KiB of
    shared memory, 64 accumulator registers per thread): the earlier 64 x 64 x 32 with 4
    warps measured 63-116 TFLOP/s on the H100 cases of the MoE grouped-GEMM benchmark,
    its tiles too small to feed the tensor cores (each token tile re-read N/64 times)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    group_order: str = "largest_first"
    waves_per_eu: int = 0  # ROCm only
    matrix_instr_nonkdim: int = 0  # ROCm only; 0 = compiler default

    def label(self) -> str:
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps}"
            f" s{self.num_stages} gm{self.group_m} {self.group_order}"
        ) + options_label(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupedGemmConfig:
        return dataclass_from_dict(cls, data)


def smem_bytes(cfg: GroupedGemmConfig, dtype: str) -> int:
    """A and B tiles once per pipeline stage."""
    elem = DTYPE_BYTES[dtype]
    stages = max(cfg.num_stages, 1)
    return int(stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * elem)


def _pow2(x: int) -> bool:
    return x > 0 and not x & (x - 1)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def output_shape(problem: GroupedGemmProblem) -> tuple[int, int, int]:
    """(rows per group at most, columns, contraction) of the pass's output tiles: fwd
    ``[tokens, n]`` over k, dgrad ``[tokens, k]`` over n, wgrad ``[k, n]`` over tokens."""
    if problem.phase == "fwd":
        return problem.tokens, problem.n, problem.k
    if problem.phase == "dgrad":
        return problem.tokens, problem.k, problem.n
    return problem.k, problem.n, problem.tokens


def config_invalid(cfg: GroupedGemmConfig, problem: GroupedGemmProblem, arch: str) -> str | None:
    """Why ``cfg`` cannot (or should not) run ``problem`` on ``arch``; None if it can."""
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(cfg, name)
        if not _pow2(value) or value < 16:
            return f"{name} must be a power of two >= 16"
    if not _pow2(cfg.num_warps) or cfg.num_warps > 16:
        return "num_warps must be a power of two <= 16"
    if cfg.num_stages < 1:
        return "num_stages must be >= 1"
    if cfg.group_m < 1:
        return "group_m must be >= 1"
    if cfg.group_order not in GROUP_ORDERS:
        return f"group_order must be one of {', '.join(GROUP_ORDERS)}"
    if smem_bytes(cfg, problem.dtype) > shared_memory_per_block(arch):
        return "shared memory"
    if arch != "cpu" and cfg.block_m * cfg.block_n // (32 * cfg.num_warps) > MAX_ACC_REGS:
        return "registers"
    rows, cols, depth = output_shape(problem)
    if cfg.block_n > 16 and cfg.block_n > _next_pow2(cols):
        return "block_n larger than the output columns"
    if cfg.block_k > 16 and cfg.block_k > _next_pow2(depth):
        return "block_k larger than the contraction"
    if cfg.block_m > 16 and cfg.block_m > _next_pow2(rows):
        return "block_m larger than the output rows"
    return None
