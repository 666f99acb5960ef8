"""Dtype names: the canonical short names problems use (``bf16``, ``f32`` ...), their
element sizes, the spellings users type, and the torch dtypes they stand for."""

from __future__ import annotations

from typing import Any

# Canonical dtype names, their element sizes, and the torch dtype they come from.
DTYPE_BYTES: dict[str, float] = {
    "f64": 8,
    "f32": 4,
    "tf32": 4,
    "bf16": 2,
    "f16": 2,
    "f8e4m3": 1,
    "f8e5m2": 1,
}

# Other spellings users type (``--dtype fp16``, ``"dtype": "float16"``): alias -> canonical.
DTYPE_ALIASES: dict[str, str] = {
    "fp64": "f64", "float64": "f64", "double": "f64",
    "fp32": "f32", "float32": "f32", "float": "f32",
    "bfloat16": "bf16",
    "fp16": "f16", "float16": "f16", "half": "f16",
    "fp8e4m3": "f8e4m3", "fp8e5m2": "f8e5m2",
}


def canonical_dtype(name: Any) -> str:
    """``"fp16"`` -> ``"f16"``; a canonical name as is; ValueError listing the names."""
    text = str(name).strip().lower()
    if text in DTYPE_BYTES:
        return text
    if text in DTYPE_ALIASES:
        return DTYPE_ALIASES[text]
    raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPE_BYTES)}; or fp16, float16, fp32, bfloat16)")


_TORCH_DTYPE_NAMES: dict[str, str] = {
    "torch.float64": "f64",
    "torch.float32": "f32",
    "torch.bfloat16": "bf16",
    "torch.float16": "f16",
    "torch.float8_e4m3fn": "f8e4m3",
    "torch.float8_e4m3fnuz": "f8e4m3",
    "torch.float8_e5m2": "f8e5m2",
    "torch.float8_e5m2fnuz": "f8e5m2",
    # names as the profiler writes them in "Input type"
    "double": "f64",
    "float": "f32",
    "c10::BFloat16": "bf16",
    "c10::Half": "f16",
    "c10::Float8_e4m3fn": "f8e4m3",
    "c10::Float8_e4m3fnuz": "f8e4m3",
    "c10::Float8_e5m2": "f8e5m2",
    "c10::Float8_e5m2fnuz": "f8e5m2",
}


def dtype_name(dtype: Any) -> str:
    """Canonical name ("bf16", "f32", ...) of a torch dtype or a profiler type string."""
    text = str(dtype)
    if text in DTYPE_BYTES:
        return text
    try:
        return _TORCH_DTYPE_NAMES[text]
    except KeyError:
        raise ValueError(f"unsupported dtype {text!r}") from None


def torch_dtype(name: str):
    """The torch dtype for a canonical name ("tf32" maps to float32 storage)."""
    import torch

    table = {
        "f64": torch.float64,
        "f32": torch.float32,
        "tf32": torch.float32,
        "bf16": torch.bfloat16,
        "f16": torch.float16,
        "f8e4m3": torch.float8_e4m3fn,
        "f8e5m2": torch.float8_e5m2,
    }
    return table[name]


def default_compute(dtype: str) -> str:
    """Compute type PyTorch uses by default: fp32 accumulation for all float GEMMs."""
    return "f64" if dtype == "f64" else "f32"
