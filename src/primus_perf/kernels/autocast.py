"""The dtype a GEMM runs in under autocast: the custom autograd Functions of the trainer's
dense and grouped GEMMs cast their inputs once to it (as ``custom_fwd(cast_inputs=...)``
does) and run their GEMMs with autocast off, so a router sees the operands' real dtype."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype of ``device_type`` ("cuda", "cpu"), or None when autocast is off."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
