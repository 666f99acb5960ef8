"""``AttentionProblem``: one scaled-dot-product attention call, the problem type of the
``attention`` kind."""

from __future__ import annotations

from dataclasses import dataclass

from primus_perf.problems.base import ProblemType
from primus_perf.problems.dtypes import DTYPE_BYTES, canonical_dtype


@dataclass(frozen=True)
class AttentionProblem(ProblemType, kind="attention"):
    """One scaled-dot-product attention call (forward; backward is derived from it).

    ``layout`` names the order of the four tensor dimensions as the caller holds them:
    "bshd" (batch, sequence, heads, head dim; the trainer's and flash-attn's layout) or
    "bhsd" (torch SDPA's). GQA when ``heads_kv < heads_q``; ``heads_q % heads_kv == 0``.
    """

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    dtype: str = "bf16"
    causal: bool = True
    layout: str = "bshd"

    def __post_init__(self) -> None:
        for name in ("batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionProblem.{name} must be a positive int, got {value!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})"
            )
        try:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        except ValueError as exc:
            raise ValueError(f"AttentionProblem.dtype: {exc}") from None
        if self.layout not in ("bshd", "bhsd"):
            raise ValueError(f"AttentionProblem.layout must be 'bshd' or 'bhsd', got {self.layout!r}")

    def key(self) -> str:
        mask = "causal" if self.causal else "full"
        return (
            f"attn|b{self.batch}|hq{self.heads_q}|hkv{self.heads_kv}|sq{self.seq_q}"
            f"|skv{self.seq_kv}|d{self.head_dim}|{self.dtype}|{mask}|{self.layout}"
        )

    # ---- performance model ----------------------------------------------------------------

    @property
    def score_pairs(self) -> int:
        """Number of (query, key) pairs computed per head: all of them, or under a causal
        mask aligned to the bottom right (torch and flash-attn convention when
        seq_q != seq_kv) only those with key index <= query index + (seq_kv - seq_q)."""
        sq, skv = self.seq_q, self.seq_kv
        if not self.causal:
            return sq * skv
        offset = skv - sq
        total = 0
        # rows i in [0, sq): keys j in [0, min(skv, i + offset + 1))
        # closed form over the rows where the bound is inside [0, skv]
        first_full = max(0, skv - offset)  # rows from here on see every key
        lo = max(0, -offset)  # rows before lo see no key
        hi = min(sq, first_full)
        if hi > lo:
            # sum_{i=lo}^{hi-1} (i + offset + 1)
            n = hi - lo
            total += n * (offset + 1) + (lo + hi - 1) * n // 2
        if sq > max(hi, lo):
            total += (sq - max(hi, lo)) * skv
        return total

    @property
    def forward_flops(self) -> int:
        """Two matmuls (Q K^T and P V), two FLOPs per multiply-add, over the computed pairs."""
        return 4 * self.batch * self.heads_q * self.score_pairs * self.head_dim

    @property
    def backward_flops(self) -> int:
        """Five matmuls (dV, dP, dQ, dK and the recomputed S): 2.5x the forward."""
        return self.forward_flops * 5 // 2

    @property
    def bytes_moved(self) -> int:
        """Forward: read Q, K, V once, write O once."""
        elem = DTYPE_BYTES[self.dtype]
        q = self.batch * self.heads_q * self.seq_q * self.head_dim
        kv = 2 * self.batch * self.heads_kv * self.seq_kv * self.head_dim
        return int((2 * q + kv) * elem)

    def __str__(self) -> str:
        mask = "causal" if self.causal else "full"
        gqa = f"/{self.heads_kv}" if self.heads_kv != self.heads_q else ""
        seq = f"{self.seq_q}" if self.seq_q == self.seq_kv else f"{self.seq_q}x{self.seq_kv}"
        return f"b{self.batch} h{self.heads_q}{gqa} s{seq} d{self.head_dim} {self.dtype} {mask}"
