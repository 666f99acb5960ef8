"""Under autocast the trainer's dense GEMMs (``trainer.model.linear``: ``F.linear``, cast by
torch's autocast) and its grouped GEMM (``trainer.moe.grouped_mm``: cast once by
``kernels.autocast.cast_operands``) reach their dispatches' routers with operands of the dtype
the GEMM runs in, in every pass; without autocast the grouped GEMM's weight follows the
activations."""

from __future__ import annotations

import torch

from primus_perf.kernels.autocast import cast_operands, gemm_dtype
from primus_perf.kinds import GROUPED
from primus_perf.trainer.model import linear
from primus_perf.trainer.moe import grouped_mm
from trainer_runs import routing

COUNTS = (3, 0, 5)


def test_cast_operands_follows_autocast_or_the_activations() -> None:
    x, w = torch.randn(4, 8), torch.randn(6, 8, dtype=torch.bfloat16)
    assert gemm_dtype(x) == torch.float32
    x2, w2 = cast_operands(x, w)
    assert x2 is x and w2.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemm_dtype(x) == torch.bfloat16
        x3, w3 = cast_operands(x, w)
        assert x3.dtype == torch.bfloat16 and w3 is w  # already in the GEMM's dtype: not copied


def _linear_dtypes(x: torch.Tensor, w: torch.Tensor, autocast: bool) -> set[tuple[torch.dtype, torch.dtype]]:
    seen: set[tuple[torch.dtype, torch.dtype]] = set()

    class Router:
        def route(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None):
            seen.add((a.dtype, b.dtype))
            return "gemm", None

    with routing("gemm", Router()):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = linear(x, w)
        y.float().sum().backward()
    return seen


def _grouped_dtypes(x: torch.Tensor, w: torch.Tensor, autocast: bool) -> set[tuple[str, torch.dtype, torch.dtype]]:
    seen: set[tuple[str, torch.dtype, torch.dtype]] = set()

    class Router:
        def route(self, phase: str, a: torch.Tensor, b: torch.Tensor, offsets, baseline: str):
            seen.add((phase, a.dtype, b.dtype))
            return "grouped", None

    with routing(GROUPED.name, Router(), backend="loop"):  # the CPU's backend (``auto``)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = grouped_mm(x, w, COUNTS)
        y.float().sum().backward()
    return seen


def test_both_gemms_run_in_the_autocast_dtype() -> None:
    bf16 = torch.bfloat16
    x = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    assert _linear_dtypes(x, w, autocast=True) == {(bf16, bf16)}  # forward, dgrad, wgrad
    assert x.grad is not None and w.grad is not None and w.grad.dtype == torch.float32
    xg = torch.randn(sum(COUNTS), 8, requires_grad=True)
    wg = torch.randn(len(COUNTS), 8, 6, requires_grad=True)
    assert _grouped_dtypes(xg, wg, autocast=True) == {(p, bf16, bf16) for p in ("fwd", "dgrad", "wgrad")}
    assert wg.grad is not None and wg.grad.dtype == torch.float32


def test_without_autocast_the_grouped_weight_follows_the_activations() -> None:
    f32 = torch.float32
    assert _linear_dtypes(torch.randn(4, 8), torch.randn(6, 8, requires_grad=True), autocast=False) == {(f32, f32)}
    w = torch.randn(len(COUNTS), 8, 6, dtype=torch.bfloat16, requires_grad=True)
    assert _grouped_dtypes(torch.randn(sum(COUNTS), 8), w, autocast=False) == {(p, f32, f32) for p in ("fwd", "wgrad")}
