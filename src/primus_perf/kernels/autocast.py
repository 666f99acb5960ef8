"""The dtype a GEMM runs in under autocast: the custom autograd Functions of the trainer's
dense and grouped GEMMs cast their inputs once to it (:func:`cast_operands`, as
``custom_fwd(cast_inputs=...)`` does) and run their GEMMs with autocast off, so a router
sees the operands' real dtype."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype of ``device_type`` ("cuda", "cpu"), or None when autocast is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM with activations ``x`` runs in: the autocast dtype of ``x``'s device
    when autocast is on there, else ``x``'s own."""
    cast = autocast_dtype(x.device.type)
    return x.dtype if cast is None else cast


def cast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and weight in :func:`gemm_dtype` (a tensor already in it is not copied)."""
    dtype = gemm_dtype(x)
    return x.to(dtype), w.to(dtype)
