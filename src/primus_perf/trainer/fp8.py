"""``train.fp8``: the trainer's linear layers in FP8 (torchao float8 through
``trainer.model.linear``; see ``kernels.fp8.linear``).

The layers are the 2-D weights the model passes to ``trainer.model.linear`` (attention Q/K/V and
output projections, MLP gate/up and down projections, shared experts, the output head),
named as in ``model.named_parameters()``; token embeddings, MoE routers and the routed
experts' 3-D weights are not linear layers here. ``train.fp8=<recipe>`` runs every block's
linear layers in FP8 (the output head stays bf16: its logits feed the loss); ``auto`` runs
the tuning cache's measured plan, which may keep any layer in bf16.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from primus_perf.kernels.fp8.linear import Fp8Linear, fp8_linear, tag_weights
from primus_perf.kernels.fp8.plan import Fp8PlanProblem
from primus_perf.kernels.fp8.recipes import BF16, gemm_shape_ok
from primus_perf.trainer.model import Embedding
from primus_perf.trainer.moe import TokenRouter

HEAD = "output"  # the output head's parameter name
_EXCLUDED_MODULES = (Embedding, TokenRouter)  # their weights are not linear layers


def linear_layers(model: nn.Module) -> dict[str, tuple[nn.Module, str, int, int]]:
    """Layer name -> (owning module, attribute, out features, in features), this rank's
    (tensor-parallel) shapes."""
    out: dict[str, tuple[nn.Module, str, int, int]] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, _EXCLUDED_MODULES):
            continue
        for attr, p in module.named_parameters(recurse=False):
            if p.dim() == 2:
                name = f"{mod_name}.{attr}" if mod_name else attr
                out[name] = (module, attr, int(p.shape[0]), int(p.shape[1]))
    return out


def problem_of(model: nn.Module, tokens: int, dtype: str = "bf16") -> Fp8PlanProblem:
    layers = tuple((n, o, i) for n, (_, _, o, i) in linear_layers(model).items())
    return Fp8PlanProblem(layers, tokens, dtype)


def group_of(name: str) -> str:
    """The layer group a layer is measured in: its role with the block index dropped
    (``layers.3.mlp.w13`` -> ``mlp.w13``); every block's layer of a role has one shape."""
    return re.sub(r"(^|\.)layers\.\d+\.", r"\1", name)


def recipe_plan(model: nn.Module, recipe: str) -> dict[str, str]:
    """``train.fp8=<recipe>``: every linear layer but the output head in ``recipe``
    (a layer whose shape torch._scaled_mm cannot take stays bf16)."""
    return {n: recipe if n != HEAD and gemm_shape_ok(o, i) else BF16
            for n, (_, _, o, i) in linear_layers(model).items()}


def fp8_plan(model: nn.Module, fp8: str, cache: str | None, tokens: int) -> dict[str, str]:
    """``train.fp8``'s plan: every layer bf16 (``off``), the tuning cache's measured plan for
    ``tokens`` a micro-batch (``auto``; UserError where it has none) or :func:`recipe_plan`."""
    if fp8 == "off":
        return {n: BF16 for n in linear_layers(model)}
    if fp8 != "auto":
        return recipe_plan(model, fp8)
    from primus_perf.runtime.fp8 import find_plan

    return find_plan(cache, [(n, o, i) for n, (_, _, o, i) in linear_layers(model).items()], tokens).layers


def apply_plan(model: nn.Module, layers: dict[str, str], device: torch.device, *, compile: bool = False,
               fsdp_float8_all_gather: bool = False) -> dict[str, str]:
    """Tag the weights of ``layers`` (name -> recipe or bf16; layers not named go bf16) for
    FP8; returns the plan applied. Callable again between steps (the plan tuner switches
    plans this way). ``fsdp_float8_all_gather``: wrap tensorwise weights for FSDP2's FP8
    all-gather (before ``fully_shard``; the plan is then fixed)."""
    found = linear_layers(model)
    unknown = sorted(set(layers) - set(found))
    if unknown:
        raise ValueError(f"FP8 plan names layers this model does not have: {unknown[:3]}")
    fns: dict[str, Fp8Linear] = {}
    by_module: dict[nn.Module, dict[str, Any]] = {}
    for name, (module, attr, _, _) in found.items():
        recipe = layers.get(name, BF16)
        fn = None
        if recipe != BF16:
            if recipe not in fns:
                fns[recipe] = fp8_linear(recipe, device, compile=compile,
                                         fsdp_float8_all_gather=fsdp_float8_all_gather)
            fn = fns[recipe]
            if fsdp_float8_all_gather and fn.config.enable_fsdp_float8_all_gather:
                _wrap_for_fsdp(module, attr, fn)
        by_module.setdefault(module, {})[attr] = fn
    for module, weights in by_module.items():
        tag_weights(module, weights)
    return {n: layers.get(n, BF16) for n in found}


def _wrap_for_fsdp(module: nn.Module, attr: str, fn: Fp8Linear) -> None:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    weight = getattr(module, attr)
    if isinstance(weight.data, WeightWithDynamicFloat8CastTensor):
        return
    flags = {k: v for k, v in vars(weight).items() if not k.startswith("_")}
    wrapped = nn.Parameter(WeightWithDynamicFloat8CastTensor(weight.data, fn.mm_config,
                                                             fn.config.cast_config_weight.target_dtype),
                           requires_grad=weight.requires_grad)
    for k, v in flags.items():
        setattr(wrapped, k, v)
    setattr(module, attr, wrapped)
