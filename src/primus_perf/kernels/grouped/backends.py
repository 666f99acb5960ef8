"""The grouped-GEMM backends, all with the same two functions:

- ``mm(x[T, K], w[G, K, N], counts) -> y[T, N]``: rows of group g (tokens sorted by group,
  ``counts[g]`` of them) times ``w[g]``. ``w`` may have any strides: the input gradient
  passes ``w.transpose(1, 2)`` of the forward weight.
- ``wgrad(x[T, K], dy[T, N], counts) -> dw[G, K, N]``: ``dw[g] = x_g^T @ dy_g``, a
  contraction over each group's own tokens; an empty group gives zeros.

``counts`` are host integers (the loop and padded backends size their work from them; the
MoE layer reads them once per layer, as expert parallelism's all-to-all split sizes need
anyway). Every backend accumulates in fp32 and returns the input dtype.

A backend that needs only the group boundaries on the device also has ``mm_offs(x, w, ends)``
and ``wgrad_offs(x, dy, ends)``: ``ends`` is the int32 device tensor of cumulative row ends
an ``aten::_grouped_mm`` call was given (``offs``), ``x`` (and ``dy``) all the call's rows;
rows past ``ends[-1]`` are no group's and are left unwritten, as torch's kernel leaves them.
No host read, so no device sync (``passes.run_offsets`` picks the entry; ``offsets.Offsets``).
``grouped_mm`` passes ``ends`` to torch as they are; ``triton`` builds its group tables from
them on the device. The loop and padded bmm have none: they read the counts.

Backends:

- ``loop``: one ``torch.mm`` per non-empty group (the default).
- ``grouped_mm``: ``torch._grouped_mm``. On CUDA it needs bf16 (torch's documentation:
  SM 8.0 or newer); torch 2.13's CPU build also runs bf16 and fp32. Every operand stride
  must be a multiple of 16 bytes (K and N multiples of 8 in bf16). Group starts go to
  torch as the counts leave them where the vendor's kernel takes any start
  (:data:`ANY_GROUP_START`); elsewhere the tokens are copied into a zero-padded buffer
  whose group starts are multiples of 16 bytes / element size rows (padding rows add
  nothing to any product) and the result is gathered back. On an H100 that copy halved
  the backend's speed (``benchmarks/moe/grouped_mm_layouts.py``: 0.99 against 0.46 ms for
  qwen3-30b-a3b's gate/up forward, 1.31 against 0.58 ms for its weight gradient; the
  unpadded results equal to the fp32 product as closely).
- ``padded_bmm``: every group padded with zero rows to the largest count, one
  ``torch.bmm`` over ``[G, max_count, K]``.
- ``triton``: the persistent Triton kernels of :mod:`.triton_kernels`, with a
  :class:`~.configs.GroupedGemmConfig` (``triton_backend(cfg)``; ``BACKENDS["triton"]``
  uses the default config). On the CPU it runs under ``TRITON_INTERPRET=1`` only.

``unsupported(device, dtype, k, n)`` says why a backend cannot run such a call (None when it
can); :func:`available` lists the backends that can.

The default of an untuned grouped GEMM (the trainer's MoE backend config key set to ``auto``)
is :func:`default_backend`: the first row of :data:`DEFAULT_RULE` for the device's vendor and
the dtype whose minimum group count the layer reaches and whose backend can run both of
the layer's GEMMs; the loop otherwise.

The GEMMs a backend makes itself are torch's, never re-routed by an installed dense GEMM
router: every grouped call runs inside ``passes.inside`` (``passes.in_grouped`` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from primus_perf.base import environment
from primus_perf.kernels.grouped.configs import GroupedGemmConfig

MmFn = Callable[[torch.Tensor, torch.Tensor, Sequence[int]], torch.Tensor]
EndsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
WhyNot = Callable[[torch.device, torch.dtype, int, int], "str | None"]


@dataclass(frozen=True)
class Backend:
    name: str
    mm: MmFn
    wgrad: MmFn
    unsupported: WhyNot
    mm_offs: EndsFn | None = None  # the same product from the device ends (no host read)
    wgrad_offs: EndsFn | None = None


def _starts(counts: Sequence[int]) -> list[int]:
    return list(accumulate((int(c) for c in counts), initial=0))


def _scatter_index(
    counts: Sequence[int], new_starts: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Where each of the ``sum(counts)`` rows goes when group g moves to ``new_starts[g]``."""
    shift = torch.tensor(
        [new - old for new, old in zip(new_starts, _starts(counts)[:-1])], dtype=torch.int64
    )
    rows = torch.repeat_interleave(shift, torch.tensor([int(c) for c in counts]))
    return (rows + torch.arange(rows.numel())).to(device)


def _padded(t: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    out = t.new_zeros(rows, t.shape[1])
    out[index] = t
    return out


# ---- loop ---------------------------------------------------------------------------------


def _loop_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    y = x.new_empty(x.shape[0], w.shape[2])
    starts = _starts(counts)
    for g, c in enumerate(counts):
        if c:
            torch.mm(x[starts[g] : starts[g + 1]], w[g], out=y[starts[g] : starts[g + 1]])
    return y


def _loop_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    dw = x.new_empty(len(counts), x.shape[1], dy.shape[1])
    starts = _starts(counts)
    for g, c in enumerate(counts):
        if c:
            rows = slice(starts[g], starts[g + 1])
            torch.mm(x[rows].t(), dy[rows], out=dw[g])
        else:
            dw[g].zero_()
    return dw


def _torch_ok(device: torch.device, dtype: torch.dtype, k: int, n: int) -> str | None:
    return None


# ---- torch._grouped_mm --------------------------------------------------------------------


def _vendor(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return "amd" if torch.version.hip is not None else "nvidia"


def _align_rows(dtype: torch.dtype) -> int:
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def _aligned_layout(counts: Sequence[int], align: int) -> list[int] | None:
    """Group starts at multiples of ``align`` rows, or None when the counts already are."""
    starts = _starts(counts)
    if all(s % align == 0 for s in starts[:-1]):
        return None
    return list(accumulate((-(-int(c) // align) * align for c in counts), initial=0))


def _offs(ends: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ends), dtype=torch.int32, device=device)


# vendor -> whether torch's _grouped_mm takes a group starting at any row (measured: an H100
# with torch 2.11, and torch 2.13's CPU kernel, on unaligned skewed counts, every pass equal
# to the fp32 product as closely as with padding); not measured on AMD: padded there
ANY_GROUP_START: dict[str, bool] = {"nvidia": True, "cpu": True, "amd": False}


def _padding_layout(counts: Sequence[int], x: torch.Tensor) -> list[int] | None:
    """The padded layout of the counts where the device's kernel needs aligned group
    starts and they are not (:data:`ANY_GROUP_START`), else None."""
    if ANY_GROUP_START.get(_vendor(x.device), False):
        return None
    return _aligned_layout(counts, _align_rows(x.dtype))


def _grouped_mm_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    layout = _padding_layout(counts, x)
    if layout is None:
        return torch._grouped_mm(x, w, offs=_offs(_starts(counts)[1:], x.device))
    index = _scatter_index(counts, layout, x.device)
    y = torch._grouped_mm(_padded(x, index, layout[-1]), w, offs=_offs(layout[1:], x.device))
    return y[index]


def _grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    layout = _padding_layout(counts, x)
    if layout is None:
        return torch._grouped_mm(x.t(), dy, offs=_offs(_starts(counts)[1:], x.device))
    index = _scatter_index(counts, layout, x.device)
    xp, dyp = _padded(x, index, layout[-1]), _padded(dy, index, layout[-1])
    return torch._grouped_mm(xp.t(), dyp, offs=_offs(layout[1:], x.device))


def _grouped_mm_mm_offs(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=ends)


def _grouped_mm_wgrad_offs(x: torch.Tensor, dy: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x.t(), dy, offs=ends)


def _grouped_mm_unsupported(device: torch.device, dtype: torch.dtype, k: int, n: int) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no _grouped_mm"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return "torch._grouped_mm on CUDA runs bf16 only"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "torch._grouped_mm needs SM 8.0 or newer"
    elif dtype not in (torch.bfloat16, torch.float32):
        return "torch._grouped_mm on the CPU runs bf16 and fp32"
    align = _align_rows(dtype)
    if k % align or n % align:
        return f"torch._grouped_mm needs K and N multiples of {align} (16 bytes)"
    return None


# ---- padded bmm ---------------------------------------------------------------------------


def _bmm_layout(counts: Sequence[int]) -> tuple[int, list[int]]:
    longest = max((int(c) for c in counts), default=0)
    return longest, [g * longest for g in range(len(counts) + 1)]


def _bmm_mm(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    longest, layout = _bmm_layout(counts)
    if longest == 0:
        return x.new_empty(0, w.shape[2])
    index = _scatter_index(counts, layout, x.device)
    xp = _padded(x, index, layout[-1]).view(len(counts), longest, x.shape[1])
    return torch.bmm(xp, w).view(layout[-1], w.shape[2])[index]


def _bmm_wgrad(x: torch.Tensor, dy: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    longest, layout = _bmm_layout(counts)
    if longest == 0:
        return x.new_zeros(len(counts), x.shape[1], dy.shape[1])
    index = _scatter_index(counts, layout, x.device)
    G = len(counts)
    xp = _padded(x, index, layout[-1]).view(G, longest, x.shape[1])
    dyp = _padded(dy, index, layout[-1]).view(G, longest, dy.shape[1])
    return torch.bmm(xp.transpose(1, 2), dyp)


# ---- Triton -------------------------------------------------------------------------------


def _triton_unsupported(device: torch.device, dtype: torch.dtype, k: int, n: int) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu" and not environment.get("TRITON_INTERPRET"):
        return "the Triton grouped GEMM runs on the CPU only under TRITON_INTERPRET=1"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the Triton grouped GEMM does not run {dtype}"
    return None


def triton_backend(cfg: GroupedGemmConfig | None = None) -> Backend:
    """The Triton grouped GEMM with the tiles of ``cfg`` (the default config when None)."""
    cfg = cfg or GroupedGemmConfig()

    def kernel(name: str) -> Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]:
        """``triton_kernels.<name>(a, b, counts or ends, cfg)``, Triton imported at the first call."""

        def run(a: torch.Tensor, b: torch.Tensor, groups: Any) -> torch.Tensor:
            from primus_perf.kernels.grouped import triton_kernels

            return getattr(triton_kernels, name)(a, b, groups, cfg)

        return run

    mm, wgrad, mm_offs, wgrad_offs = (kernel(name) for name in ("grouped_mm", "grouped_mm_wgrad", "grouped_mm_offs",
                                                                "grouped_mm_wgrad_offs"))
    return Backend("triton", mm, wgrad, _triton_unsupported, mm_offs, wgrad_offs)


BACKENDS: dict[str, Backend] = {
    "loop": Backend("loop", _loop_mm, _loop_wgrad, _torch_ok),
    "grouped_mm": Backend("grouped_mm", _grouped_mm_mm, _grouped_mm_wgrad, _grouped_mm_unsupported,
                          _grouped_mm_mm_offs, _grouped_mm_wgrad_offs),
    "padded_bmm": Backend("padded_bmm", _bmm_mm, _bmm_wgrad, _torch_ok),
    "triton": triton_backend(),
}


AUTO = "auto"  # the configuration value that applies DEFAULT_RULE

# (vendor, dtype) -> ((minimum local groups, backend), ...), first match wins (a row whose
# backend cannot run the layer's shapes here is skipped); the loop where no row matches.
# Measured on an H100 (torch 2.11, Triton 3.6, bf16). With group starts padded to 8 rows,
# grouped_mm ran 57.9-60.6 ms a step on qwen3-30b-a3b (128 experts of 768) against Triton's
# default config 54.1-55.8 and the loop 98-108, so the rule was Triton from 64 experts.
# Without the padding (ANY_GROUP_START) torch's kernel runs each expert GEMM 1.7-2.1x faster
# than Triton's default config and 1.4-1.7x faster than the best online seed config
# (benchmarks/moe/grouped_mm_layouts.py: qwen3 gate/up forward 0.46 against 0.79 and 0.65 ms;
# deepseek-v3's 32 experts of 2048, 1.01 against 1.55 and 1.14 ms; mixtral's 8 experts of
# 14336, 2.81 against 4.44 and 3.07 ms). In the step (every fixed backend in one trainer,
# benchmarks/runtime/never_slower.py) unpadded grouped_mm is the fastest on qwen3-30b-a3b (50.8 ms
# against Triton's 54.6 and the loop's 90.5; 70.8 against 76.7 and 132.8), while with 32 and
# 48 experts of 2048 (deepseek-v3) the loop stays as fast (85.9 against 86.5 ms; 116.4
# against 116.6) and with 8 of 14336 (mixtral-8x7b) faster (62.5 against 64.4; 86.3 against
# 88.7): grouped_mm from 64 experts. AMD: not measured, so the loop (the backend every device
# runs) until a measurement says otherwise; the CPU keeps the loop too.
DEFAULT_RULE: dict[tuple[str, torch.dtype], tuple[tuple[int, str], ...]] = {
    ("nvidia", torch.bfloat16): ((64, "grouped_mm"),),
}


def default_backend(device: torch.device, dtype: torch.dtype, groups: int,
                    shapes: Sequence[tuple[int, int]]) -> str:
    """The fixed backend for an untuned layer of ``groups`` local experts whose GEMMs are
    ``[*, k] x [k, n]`` for each ``(k, n)`` of ``shapes`` (:data:`DEFAULT_RULE`)."""
    for min_groups, name in DEFAULT_RULE.get((_vendor(device), dtype), ()):
        if groups >= min_groups and all(BACKENDS[name].unsupported(device, dtype, k, n) is None for k, n in shapes):
            return name
    return "loop"


def available(device: torch.device, dtype: torch.dtype, k: int, n: int) -> list[str]:
    """Names of the backends that can run a ``[*, k] x [k, n]`` grouped GEMM here."""
    return [name for name, b in BACKENDS.items() if b.unsupported(device, dtype, k, n) is None]
