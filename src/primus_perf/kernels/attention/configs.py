"""Tile configurations of the Triton flash-attention kernels and the rules of which can run.

A config is data: ``FwdConfig`` for the forward kernel, ``BwdConfig`` for the two
backward kernels (dK/dV over key blocks, dQ over query blocks), ``AttnConfig`` the pair
that a cache entry stores. Invalid combinations (shared-memory overflow, register-file
overflow, blocks larger than needed) are named by ``fwd_invalid``/``bwd_invalid``, before
anything is launched (the tuner's search space, ``tuner/attention/space.py``, uses them).

Vendor differences are rows of tables: the shared memory (LDS) per block by GPU
architecture, and the launch options that only one vendor's Triton backend knows
(``kernels.triton_launch``: ``waves_per_eu`` and ``matrix_instr_nonkdim`` on ROCm).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from primus_perf.base.devices import shared_memory_per_block
from primus_perf.kernels.triton_launch import options_label
from primus_perf.problems import AttentionProblem

HEAD_DIMS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class FwdConfig:
    """Forward kernel tiles: BLOCK_M query rows x BLOCK_N keys per step."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    waves_per_eu: int = 0  # ROCm only
    matrix_instr_nonkdim: int = 0  # ROCm only; 0 = compiler default

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}" + options_label(self)


@dataclass(frozen=True)
class BwdConfig:
    """Backward tiles: dK/dV kernel walks BLOCK_M1 query rows per step over BLOCK_N1 keys;
    dQ kernel walks BLOCK_N2 keys per step over BLOCK_M2 query rows."""

    block_m1: int = 64
    block_n1: int = 128
    block_m2: int = 128
    block_n2: int = 64
    num_warps: int = 8
    num_stages: int = 3
    waves_per_eu: int = 0
    matrix_instr_nonkdim: int = 0

    def label(self) -> str:
        return (
            f"dkdv {self.block_m1}x{self.block_n1} dq {self.block_m2}x{self.block_n2}"
            f" w{self.num_warps} s{self.num_stages}"
        ) + options_label(self)


@dataclass(frozen=True)
class AttnConfig:
    """What the cache stores for the Triton backend: one forward and one backward config."""

    fwd: FwdConfig = field(default_factory=FwdConfig)
    bwd: BwdConfig = field(default_factory=BwdConfig)

    def to_dict(self) -> dict[str, Any]:
        return {"fwd": asdict(self.fwd), "bwd": asdict(self.bwd)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttnConfig:
        try:
            return cls(fwd=_build(FwdConfig, data["fwd"]), bwd=_build(BwdConfig, data["bwd"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not an attention config: {data!r} ({exc})") from None

    def label(self) -> str:
        return f"fwd {self.fwd.label()} | bwd {self.bwd.label()}"


def _build(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise TypeError(f"unknown field(s) {sorted(unknown)}")
    return cls(**{k: int(v) for k, v in data.items()})


# ---- validity -------------------------------------------------------------------------


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} not supported by the Triton kernel {HEAD_DIMS}")


def fwd_smem_bytes(cfg: FwdConfig, head_dim: int, elem: int = 2) -> int:
    """Q tile once, K and V tiles once per pipeline stage."""
    stages = max(cfg.num_stages - 1, 1)
    return cfg.block_m * head_dim * elem + stages * 2 * cfg.block_n * head_dim * elem


def bwd_smem_bytes(cfg: BwdConfig, head_dim: int, elem: int = 2) -> int:
    """The larger of the two kernels: a resident tile pair plus a streamed pair per stage."""
    stages = max(cfg.num_stages - 1, 1)
    dkdv = 2 * cfg.block_n1 * head_dim * elem + stages * 2 * cfg.block_m1 * head_dim * elem
    dq = 2 * cfg.block_m2 * head_dim * elem + stages * 2 * cfg.block_n2 * head_dim * elem
    return max(dkdv, dq)


def _acc_regs_per_thread(rows: int, cols: int, warps: int) -> int:
    return rows * cols // (32 * warps)


def fwd_invalid(cfg: FwdConfig, problem: AttentionProblem, arch: str) -> str | None:
    """Why a forward config cannot (or should not) run on this problem; None if it can."""
    d = problem.head_dim
    if cfg.block_m < 16 or cfg.block_n < 16:
        return "blocks under 16"
    if fwd_smem_bytes(cfg, d) > shared_memory_per_block(arch):
        return "shared memory"
    if arch != "cpu":
        # the fp32 accumulators (O: BLOCK_M x D, S: BLOCK_M x BLOCK_N) must fit registers
        regs = _acc_regs_per_thread(cfg.block_m, d + cfg.block_n, cfg.num_warps)
        if regs > 192:
            return "registers"
    if cfg.block_m > 16 and cfg.block_m // 2 >= _ceil16(problem.seq_q):
        return "BLOCK_M larger than the sequence"
    if cfg.block_n > 16 and cfg.block_n // 2 >= _ceil16(problem.seq_kv):
        return "BLOCK_N larger than the sequence"
    return None


def bwd_invalid(cfg: BwdConfig, problem: AttentionProblem, arch: str) -> str | None:
    d = problem.head_dim
    if min(cfg.block_m1, cfg.block_n1, cfg.block_m2, cfg.block_n2) < 16:
        return "blocks under 16"
    if bwd_smem_bytes(cfg, d) > shared_memory_per_block(arch):
        return "shared memory"
    if arch != "cpu":
        # dK and dV accumulators (2 x BLOCK_N1 x D), dQ (BLOCK_M2 x D) in fp32
        regs = max(
            _acc_regs_per_thread(cfg.block_n1, 2 * d + cfg.block_m1, cfg.num_warps),
            _acc_regs_per_thread(cfg.block_m2, d + cfg.block_n2, cfg.num_warps),
        )
        if regs > 192:
            return "registers"
    seq = min(problem.seq_q, problem.seq_kv)
    if max(cfg.block_n1, cfg.block_m2) // 2 >= _ceil16(seq) and max(cfg.block_n1, cfg.block_m2) > 16:
        return "blocks larger than the sequence"
    return None


def _ceil16(n: int) -> int:
    return (n + 15) // 16 * 16
