"""The two ways a layer runs FP8 (torchao's float8 training does the quantization):

- a weight the trainer passes to ``trainer.model.linear``: :func:`tag_weights` gives the
  weight an ``fp8_linear`` callable (:class:`Fp8Linear`) that ``linear`` calls instead of
  ``F.linear``. A forward pre-hook on the owning module re-tags the module's current
  parameter before every forward, so the tag survives FSDP2 (which swaps the module's
  parameters for their all-gathered copies). Untagged weights keep the bf16 path and its
  GEMM routing.
- an ``nn.Linear`` of any program: :func:`convert_linears` swaps it for torchao's
  ``Float8Linear`` (``convert_to_float8_training`` with a module filter, one call per recipe).

``compile=True`` runs each FP8 layer through ``torch.compile`` (the quantization's absolute
maximum, scale and cast fuse into a few kernels; in eager they are several kernels a
tensor). Each recipe gets its own compiled code object, so the model's few GEMM shapes of
one recipe stay within Dynamo's recompile limit.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from primus_perf.kernels.fp8.recipes import BF16, torchao_config

TAG = "fp8_linear"  # the weight attribute trainer.model.linear looks for
_HOOK = "_fp8_tag_hook"


def _mm_config(config: Any) -> Any:
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    return LinearMMConfig(*(
        ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
        for g in (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    ))


def _fp8_mm(x: torch.Tensor, weight: torch.Tensor, mm_config: Any, config: Any) -> torch.Tensor:
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    return matmul_with_hp_or_float8_args.apply(x, weight.t(), mm_config, config)


class Fp8Linear:
    """``x @ weight.T`` with the three GEMMs in FP8 by recipe ``name``. Under autocast the
    input is cast to the autocast dtype (as ``F.linear`` would) and the output has that
    dtype; the weight is quantized from its master copy."""

    def __init__(self, name: str, device: torch.device, *, compile: bool = False,
                 fsdp_float8_all_gather: bool = False) -> None:
        self.name = name
        self.config = torchao_config(name, device, fsdp_float8_all_gather=fsdp_float8_all_gather)
        self.mm_config = _mm_config(self.config)
        fn = _fp8_mm
        if compile:
            suffix = "_fsdp" if fsdp_float8_all_gather else ""
            code = _fp8_mm.__code__.replace(co_name=f"_fp8_mm_{name}{suffix}")
            fn = torch.compile(types.FunctionType(code, _fp8_mm.__globals__, code.co_name), dynamic=False)
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            x = x.to(torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            return self._fn(x, weight, self.mm_config, self.config)

    def __repr__(self) -> str:
        return f"Fp8Linear({self.name!r})"


_MADE: dict[tuple[str, str, bool, bool], Fp8Linear] = {}


def fp8_linear(name: str, device: torch.device, *, compile: bool = False,
               fsdp_float8_all_gather: bool = False) -> Fp8Linear:
    """The one :class:`Fp8Linear` of a recipe on a device type: switching plans reuses its
    configs and its compiled code (a new one would recompile)."""
    key = (name, device.type, compile, fsdp_float8_all_gather)
    if key not in _MADE:
        _MADE[key] = Fp8Linear(name, device, compile=compile, fsdp_float8_all_gather=fsdp_float8_all_gather)
    return _MADE[key]


def _retag(module: nn.Module, _args: Any) -> None:
    for attr, fn in module._fp8_weights.items():  # type: ignore[union-attr]
        param = getattr(module, attr)
        if getattr(param, TAG, None) is not fn:
            setattr(param, TAG, fn)


def tag_weights(module: nn.Module, weights: Mapping[str, Fp8Linear | None]) -> None:
    """Run ``module``'s weights named in ``weights`` (attribute -> :class:`Fp8Linear`, or
    None for bf16) through FP8 in ``trainer.model.linear``."""
    current: dict[str, Fp8Linear] = dict(getattr(module, "_fp8_weights", {}))
    for attr, fn in weights.items():
        param = getattr(module, attr)
        if fn is None:
            current.pop(attr, None)
            if hasattr(param, TAG):
                delattr(param, TAG)
        else:
            current[attr] = fn
            setattr(param, TAG, fn)
    module._fp8_weights = current  # type: ignore[assignment]
    hook = getattr(module, _HOOK, None)
    if current and hook is None:
        setattr(module, _HOOK, module.register_forward_pre_hook(_retag))
    elif not current and hook is not None:
        hook.remove()
        delattr(module, _HOOK)


def convert_linears(model: nn.Module, plan: Mapping[str, str], device: torch.device) -> list[str]:
    """Swap the ``nn.Linear`` modules the plan names (module name -> recipe; ``bf16`` keeps
    one) for torchao's ``Float8Linear``; returns the converted names."""
    from torchao.float8 import convert_to_float8_training

    done: list[str] = []
    for name in sorted({r for r in plan.values() if r != BF16}):
        wanted = {m for m, r in plan.items() if r == name}

        def pick(mod: nn.Module, fqn: str, wanted: set[str] = wanted) -> bool:
            return fqn in wanted and isinstance(mod, nn.Linear)

        convert_to_float8_training(model, config=torchao_config(name, device), module_filter_fn=pick)
        done += sorted(wanted)
    return done
