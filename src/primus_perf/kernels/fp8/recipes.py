"""FP8 recipes: how a linear layer's three GEMMs (forward ``x @ W.T``, input gradient
``dy @ W``, weight gradient ``dy.T @ x``) are quantized, as data.

A recipe names the scaling granularity (one scale per tensor, or one per row: torchao's
"axiswise") and the FP8 format of the gradients (the forward operands are always e4m3).
torchao's float8 training does the quantization (dynamic scaling: the scale is computed
from the tensor's absolute maximum in the step, so its cost is part of the layer's time).

Which FP8 formats a GPU has is vendor data (:data:`FP8_FORMATS`): OCP e4m3fn/e5m2 on NVIDIA
Hopper/Blackwell and AMD gfx950; the "fnuz" variants on AMD gfx942 (MI300X/MI325X).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from primus_perf.base.errors import UserError

BF16 = "bf16"  # the plan's name for "this layer stays in high precision"


@dataclass(frozen=True)
class Recipe:
    name: str
    granularity: str  # "tensorwise" | "rowwise"
    grad: str  # FP8 format of the output gradient: "e5m2" | "e4m3"
    weight_grad_hp: bool = False  # the weight-gradient GEMM stays in high precision
    note: str = ""


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("tensorwise", "tensorwise", "e5m2", note="one scale per tensor; e4m3 forward, e5m2 gradients"),
    Recipe("tensorwise_e4m3", "tensorwise", "e4m3", note="one scale per tensor; e4m3 everywhere"),
    Recipe("rowwise", "rowwise", "e4m3", note="one scale per row, power-of-2 scales; e4m3 everywhere"),
    Recipe("rowwise_e5m2", "rowwise", "e5m2", note="one scale per row, power-of-2 scales; e5m2 gradients"),
    Recipe("rowwise_with_gw_hp", "rowwise", "e4m3", weight_grad_hp=True,
           note="rowwise forward and input gradient; the weight gradient in bf16"),
)}
DEFAULT_CANDIDATES = ("tensorwise", "rowwise")  # what the plan tuner tries per layer group

# (vendor, arch) -> (e4m3 dtype name, e5m2 dtype name); arch None: the vendor's default
FP8_FORMATS: dict[tuple[str, str | None], tuple[str, str]] = {
    ("nvidia", None): ("float8_e4m3fn", "float8_e5m2"),
    ("amd", "gfx942"): ("float8_e4m3fnuz", "float8_e5m2fnuz"),
    ("amd", "gfx950"): ("float8_e4m3fn", "float8_e5m2"),
    ("cpu", None): ("float8_e4m3fn", "float8_e5m2"),  # torch._scaled_mm runs on the CPU too
}


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise UserError(f"unknown FP8 recipe {name!r} (one of {', '.join(RECIPES)})") from None


def fp8_formats(vendor: str, arch: str = "") -> tuple[Any, Any] | None:
    """The (e4m3, e5m2) torch dtypes of a device, or None where it has no FP8 GEMMs."""
    import torch

    names = FP8_FORMATS.get((vendor, arch)) or FP8_FORMATS.get((vendor, None))
    if vendor == "amd" and (vendor, arch) not in FP8_FORMATS:
        return None  # an AMD GPU before gfx942 has no FP8 GEMMs
    return None if names is None else (getattr(torch, names[0]), getattr(torch, names[1]))


def running_formats(device: Any) -> tuple[Any, Any]:
    """(e4m3, e5m2) dtypes of a torch device; UserError on a GPU without FP8 GEMMs."""
    import torch

    if device.type != "cuda":
        return fp8_formats("cpu")  # type: ignore[return-value]
    if torch.version.hip:
        arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
        found = fp8_formats("amd", arch)
    else:
        major, minor = torch.cuda.get_device_capability(device)
        found = fp8_formats("nvidia") if (major, minor) >= (8, 9) else None
        arch = f"sm_{major}{minor}"
    if found is None:
        raise UserError(f"FP8 training needs a GPU with FP8 GEMMs; {arch} has none (use train.fp8=off)")
    return found


def torchao_config(name: str, device: Any, *, fsdp_float8_all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` of recipe ``name`` with the device's FP8 formats."""
    try:
        from torchao.float8.config import (
            CastConfig,
            Float8LinearConfig,
            ScalingGranularity,
            ScalingType,
        )
    except ImportError:
        raise UserError("FP8 training needs torchao (pip install torchao)") from None
    r = recipe(name)
    e4m3, e5m2 = running_formats(device)
    gran = ScalingGranularity.TENSORWISE if r.granularity == "tensorwise" else ScalingGranularity.AXISWISE
    grad = e5m2 if r.grad == "e5m2" else e4m3
    extra: dict[str, Any] = {}
    if r.weight_grad_hp:  # as torchao's "rowwise_with_gw_hp"
        extra = {
            "cast_config_weight_for_grad_input": CastConfig(scaling_granularity=ScalingGranularity.TENSORWISE,
                                                            target_dtype=e4m3),
            "cast_config_input_for_grad_weight": CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=e4m3),
            "cast_config_grad_output_for_grad_weight": CastConfig(scaling_type=ScalingType.DISABLED,
                                                                  target_dtype=grad),
        }
    return Float8LinearConfig(
        cast_config_input=CastConfig(scaling_granularity=gran, target_dtype=e4m3),
        cast_config_weight=CastConfig(scaling_granularity=gran, target_dtype=e4m3),
        cast_config_grad_output=CastConfig(scaling_granularity=gran, target_dtype=grad),
        round_scales_to_power_of_2=r.granularity == "rowwise",
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather and r.granularity == "tensorwise",
        **extra,
    )


def gemm_shape_ok(out_features: int, in_features: int) -> bool:
    """torch._scaled_mm needs both weight dimensions divisible by 16."""
    return out_features % 16 == 0 and in_features % 16 == 0
