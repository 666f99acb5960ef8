"""``GroupedGemmProblem``: one grouped GEMM of an MoE expert layer, with the token
distribution held as buckets (total tokens, skew) so the key holds while per-step counts
move a little."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from primus_perf.problems.base import ProblemType
from primus_perf.problems.dtypes import DTYPE_BYTES

GROUPED_PASSES = ("fwd", "dgrad", "wgrad")


def tokens_bucket(total: int) -> int:
    """Total tokens rounded up to a power of two (0 stays 0)."""
    return 0 if total <= 0 else 1 << (int(total) - 1).bit_length()


def skew_buckets(limit: float) -> list[float]:
    """The skew bucket edges up to ``limit``: 1, 1.25, 1.5, then 2^j and 1.5 * 2^j."""
    edges = [1.0, 1.25, 1.5]
    j = 1
    while edges[-1] < limit:
        edges += [float(2**j), 1.5 * 2**j]
        j += 1
    return edges


def skew_bucket(counts: list[int] | tuple[int, ...]) -> float:
    """max / mean tokens per group, rounded up to a bucket edge (:func:`skew_buckets`); 1.0
    for a uniform split (or no tokens). Rounding up keeps small step-to-step movement inside
    one bucket; a routing collapse onto a few experts moves to another one."""
    total = sum(counts)
    if total <= 0:
        return 1.0
    skew = max(counts) * len(counts) / total
    for edge in skew_buckets(skew):
        if edge >= skew - 1e-9:
            return edge
    raise AssertionError("unreachable: skew_buckets reaches the skew")  # pragma: no cover


_GROUPED_KEY = re.compile(
    r"ggemm:(\w+)\|g(\d+)\|k(\d+)\|n(\d+)\|t(\d+)\|s(\d+(?:\.\d+)?)\|(\w+)\|w([NT])"
)


@dataclass(frozen=True)
class GroupedGemmProblem(ProblemType, kind="grouped_gemm"):
    """One grouped GEMM of an MoE expert layer: ``groups`` experts, each with weight
    ``W_g[k, n]``, applied to the tokens routed to it.

    Convention (row-major, as torch holds the tensors): the tokens are sorted by group, so
    group g owns rows ``[o_g, o_g + c_g)`` of ``x[T, k]`` (``c_g`` may be 0). The weights
    are ``w[groups, k, n]`` (``trans_w=False``) or ``w[groups, n, k]`` used transposed
    (``trans_w=True``, the ``nn.Linear`` layout). ``k`` and ``n`` are always the *forward*
    layer's input and output features, and ``phase`` picks one of its three GEMMs:

    - ``fwd``:   ``y_g[c_g, n] = x_g[c_g, k] @ W_g``           (contraction over k)
    - ``dgrad``: ``dx_g[c_g, k] = dy_g[c_g, n] @ W_g^T``       (contraction over n)
    - ``wgrad``: ``dW_g[k, n] = x_g^T @ dy_g``                 (contraction over the group's
      c_g tokens: a different K per group; an empty group gives a zero ``dW_g``)

    The token distribution is part of the problem only as buckets, so that the key holds
    while per-step counts move a little: ``tokens`` is the total rounded up to a power of
    two (:func:`tokens_bucket`), ``skew`` is max/mean tokens per group rounded up to a
    bucket edge (:func:`skew_bucket`). :meth:`from_counts` builds both from real counts;
    :meth:`example_counts` gives counts of the bucket (for a tuner or a benchmark).
    """

    groups: int
    k: int
    n: int
    tokens: int
    skew: float = 1.0
    dtype: str = "bf16"
    trans_w: bool = False
    phase: str = "fwd"

    def __post_init__(self) -> None:
        for name in ("groups", "k", "n", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedGemmProblem.{name} must be a positive int, got {value!r}")
        if self.tokens & (self.tokens - 1):
            raise ValueError(
                f"GroupedGemmProblem.tokens must be a power of two (a bucket), got {self.tokens}"
            )
        skew = self.skew
        if isinstance(skew, bool) or not isinstance(skew, (int, float)):
            raise ValueError(f"GroupedGemmProblem.skew must be a number, got {skew!r}")
        if float(skew) not in skew_buckets(max(1.0, float(skew))):
            raise ValueError(f"GroupedGemmProblem.skew must be a bucket edge, got {skew!r}")
        if skew > self.groups:
            raise ValueError(f"GroupedGemmProblem.skew ({skew}) exceeds groups ({self.groups})")
        object.__setattr__(self, "skew", float(skew))
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"GroupedGemmProblem.dtype: unknown dtype {self.dtype!r}")
        if not isinstance(self.trans_w, bool):
            raise ValueError(f"GroupedGemmProblem.trans_w must be a bool, got {self.trans_w!r}")
        if self.phase not in GROUPED_PASSES:
            raise ValueError(
                f"GroupedGemmProblem.phase must be one of {', '.join(GROUPED_PASSES)}, got {self.phase!r}"
            )

    @classmethod
    def from_counts(
        cls,
        counts: list[int] | tuple[int, ...],
        k: int,
        n: int,
        *,
        dtype: str = "bf16",
        trans_w: bool = False,
        phase: str = "fwd",
    ) -> GroupedGemmProblem:
        """The problem of a call with these tokens per group (buckets computed here)."""
        counts = [int(c) for c in counts]
        if any(c < 0 for c in counts):
            raise ValueError(f"negative token count in {counts}")
        return cls(
            groups=len(counts),
            k=k,
            n=n,
            tokens=max(1, tokens_bucket(sum(counts))),
            skew=skew_bucket(counts),
            dtype=dtype,
            trans_w=trans_w,
            phase=phase,
        )

    def example_counts(self) -> list[int]:
        """Deterministic counts inside this problem's buckets: ``tokens`` in all, the first
        group holding ``skew`` x the mean, the rest spread evenly (earlier groups get the
        remainder)."""
        g, total = self.groups, self.tokens
        big = min(total, round(self.skew * total / g)) if g > 1 else total
        rest, extra = divmod(total - big, g - 1) if g > 1 else (0, 0)
        return [big] + [rest + (1 if i < extra else 0) for i in range(g - 1)]

    def with_phase(self, phase: str) -> GroupedGemmProblem:
        return GroupedGemmProblem(**{**self.to_dict(), "phase": phase})

    def key(self) -> str:
        w = "T" if self.trans_w else "N"
        return (
            f"ggemm:{self.phase}|g{self.groups}|k{self.k}|n{self.n}|t{self.tokens}"
            f"|s{self.skew:g}|{self.dtype}|w{w}"
        )

    @classmethod
    def from_key(cls, key: str) -> GroupedGemmProblem:
        """The problem whose :meth:`key` is ``key``; ValueError for any other string."""
        m = _GROUPED_KEY.fullmatch(key)
        if m is None:
            raise ValueError(f"not a grouped GEMM problem key: {key!r}")
        phase, groups, k, n, tokens, skew, dtype, w = m.groups()
        return cls(groups=int(groups), k=int(k), n=int(n), tokens=int(tokens), skew=float(skew),
                   dtype=dtype, trans_w=w == "T", phase=phase)

    @classmethod
    def from_item(cls, data: dict[str, Any]) -> GroupedGemmProblem:
        """A problems-file item's fields: a ``GroupedGemmProblem`` dict, or ``counts`` (tokens
        per group) in place of ``groups``/``tokens``/``skew``."""
        if "counts" not in data:
            return cls.from_dict(data)
        data = dict(data)
        counts = data.pop("counts")
        if not isinstance(counts, list) or not counts or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts
        ):
            raise ValueError(f"counts must be a non-empty list of token counts >= 0, got {counts!r}")
        if sum(counts) == 0:
            raise ValueError("counts must route at least one token")
        clash = sorted({"groups", "tokens", "skew"} & set(data))
        if clash:
            raise ValueError(f"give counts or {', '.join(clash)}, not both")
        return cls.from_counts(counts, **data)

    # ---- performance model ----------------------------------------------------------------

    @property
    def flops(self) -> int:
        """``2 * tokens * k * n`` for each of the three passes (multiply-add = 2 FLOPs), at the
        bucket's ``tokens`` (:meth:`flops_of` for a call's exact total)."""
        return self.flops_of(self.tokens)

    def flops_of(self, tokens: int) -> int:
        """FLOPs of one call of this problem with ``tokens`` tokens in all."""
        return 2 * tokens * self.k * self.n

    @property
    def bytes_moved(self) -> int:
        """Fewest bytes: the two token-sized operands and the weights once each (the same
        sum in every pass: fwd reads x and W, writes y; dgrad reads dy and W, writes dx;
        wgrad reads x and dy, writes dW), at the bucket's ``tokens``."""
        return self.bytes_of(self.tokens)

    def bytes_of(self, tokens: int) -> int:
        """Fewest bytes of one call with ``tokens`` tokens in all (see :attr:`bytes_moved`)."""
        elems = tokens * (self.k + self.n) + self.groups * self.k * self.n
        return int(elems * DTYPE_BYTES[self.dtype])

    def __str__(self) -> str:
        w = " wT" if self.trans_w else ""
        return (
            f"{self.phase} {self.groups}x[{self.k}x{self.n}] t{self.tokens} skew{self.skew:g}"
            f" {self.dtype}{w}"
        )


# ---- aten::_grouped_mm calls -------------------------------------------------------------


@dataclass(frozen=True)
class GroupedMmCall:
    """What one ``aten::_grouped_mm(a, b, offs)`` call is, in :class:`GroupedGemmProblem`
    terms: its pass, ``groups``, ``tokens`` (all rows of the jagged or batched dimension),
    the forward layer's ``k`` and ``n`` and the forward weight's storage (``trans_w``)."""

    phase: str
    groups: int
    tokens: int
    k: int
    n: int
    trans_w: bool

    def problem(self, dtype: str, counts: list[int] | tuple[int, ...] | None = None) -> GroupedGemmProblem:
        """The problem with these tokens per group (None: split evenly, as a trace that does
        not record ``offs`` leaves it). Its ``tokens`` bucket is the call's rows (known
        without reading ``offs``), the counts' total but for rows past the last group (an
        expert-parallel sentinel tail); the counts give the skew."""
        if counts is not None and any(int(c) < 0 for c in counts):
            raise ValueError(f"negative token count in {list(counts)}")
        return GroupedGemmProblem(groups=self.groups, k=self.k, n=self.n, tokens=max(1, tokens_bucket(self.tokens)),
                                  skew=1.0 if counts is None else skew_bucket([int(c) for c in counts]),
                                  dtype=dtype, trans_w=self.trans_w, phase=self.phase)


def _strides_or_packed(shape: Any, strides: Any) -> list[int]:
    """``strides`` when given as ints of ``shape``'s rank, else those of a packed tensor."""
    if isinstance(strides, (list, tuple)) and len(strides) == len(shape) and all(type(s) is int for s in strides):
        return list(strides)
    out, step = [], 1
    for size in reversed(list(shape)):
        out.append(step)
        step *= max(1, int(size))
    return out[::-1]


def grouped_mm_call(a_shape: Any, a_strides: Any, b_shape: Any, b_strides: Any, offs_groups: int | None,
                    backward: bool) -> GroupedMmCall | None:
    """The :class:`GroupedMmCall` of ``aten::_grouped_mm(a, b, offs)`` from its operands'
    shapes and strides (None: packed), the length of ``offs`` (None: no offs) and whether
    it runs in a backward pass; None for a layout that is no grouped GEMM problem. The one
    reading of such a call: a pass's problem (``kernels.grouped.problem_of``), the runtime's
    override of ``aten::_grouped_mm`` and the trace analyzer all derive their problem here.

    - ``a[T, K] @ b[G, K, N]`` with offs: forward (``trans_w``: ``b`` is a transposed view,
      the ``nn.Linear`` storage ``[G, N, K]``); in a backward pass the input gradient
      ``dy[T, N] @ W^T`` (``b`` is the forward weight transposed: K and N swap);
    - ``a[K, T] @ b[T, N]`` with offs over T: the weight gradient ``dW[G, K, N]``
      (``a`` is ``x^T``);
    - ``a[G, M, K] @ b[G, K, N]``: G equal groups of M tokens; ``a`` used transposed (a
      view of ``x[G, M', K]``, stride 1 not last) is the weight gradient
      ``x^T @ dy``, else forward (input gradient in a backward pass).
    """
    a, b = [int(x) for x in a_shape], [int(x) for x in b_shape]
    sa, sb = _strides_or_packed(a, a_strides), _strides_or_packed(b, b_strides)
    if len(a) == 2 and len(b) == 3 and offs_groups == b[0] and a[1] == b[1]:
        groups, tokens = b[0], a[0]
    elif len(a) == 2 and len(b) == 2 and offs_groups and a[1] == b[0]:
        return GroupedMmCall("wgrad", offs_groups, a[1], a[0], b[1], False)
    elif len(a) == 3 and len(b) == 3 and offs_groups is None and a[0] == b[0] and a[2] == b[1] and a[0] > 0:
        if sa[2] != 1 and a[2] > 1:  # x^T @ dy over each group's M tokens
            return GroupedMmCall("wgrad", a[0], a[0] * a[2], a[1], b[2], False)
        groups, tokens = a[0], a[0] * a[1]
    else:
        return None
    if backward:  # b is the forward weight transposed: [G, N, K] of its [G, K, N]
        return GroupedMmCall("dgrad", groups, tokens, b[2], b[1], sb[1] != 1 and b[1] > 1)
    return GroupedMmCall("fwd", groups, tokens, b[1], b[2], sb[2] != 1 and b[2] > 1)
