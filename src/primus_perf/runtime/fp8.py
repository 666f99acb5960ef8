"""FP8 plans from the tuning cache, put in place: :func:`find_plan` (the identity-checked
``fp8_plan`` entry of a model's layer set) and :func:`apply` for the ``nn.Linear`` modules of
any PyTorch program (an HF transformers model, say): the layers the plan runs in FP8
become torchao ``Float8Linear`` modules, the others stay as they are."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from primus_perf.base.devices import current_device
from primus_perf.base.errors import UserError
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.fp8.linear import convert_linears
from primus_perf.kernels.fp8.plan import (
    KIND,
    Fp8Plan,
    Fp8PlanProblem,
    library_versions,
    matching,
    plan_from_entry,
)


def find_plan(cache: str | os.PathLike | TuningCache, layers: Sequence[tuple[str, int, int]],
              tokens: int | None = None) -> Fp8Plan:
    """The cache's FP8 plan for these layers (name, out, in) on the running device and
    library versions; ``tokens`` picks among plans tuned for several batch sizes. UserError
    (one line) when there is none or the choice is ambiguous."""
    store = cache if isinstance(cache, TuningCache) else TuningCache(cache)
    entries = store.entries(KIND)
    problems = {e.problem_key: Fp8PlanProblem.from_dict(e.problem) for e in entries}
    wanted = {p.key() for p in matching(list(problems.values()), layers, tokens)}
    usable = store.select((e for e in entries if e.problem_key in wanted), current_device(), library_versions())
    if not usable:
        stale = f" ({len(wanted)} for other hardware or library versions)" if wanted else ""
        raise UserError(f"tuning cache {store.given} has no FP8 plan for this model's {len(layers)} linear"
                        f" layers{' at ' + str(tokens) + ' tokens' if tokens else ''}{stale}; tune one first")
    if len(usable) > 1:
        sizes = sorted(problems[k].tokens for k in usable)
        raise UserError(f"tuning cache {store.given} has FP8 plans for {sizes} tokens a step; pass tokens=")
    entry = next(iter(usable.values()))
    return plan_from_entry(problems[entry.problem_key], entry.solution.get("config", {}))


def linear_layers(model: nn.Module) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of every ``nn.Linear`` of ``model``."""
    return [(n, m.out_features, m.in_features) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def apply(model: nn.Module, cache: str | os.PathLike | TuningCache | Fp8Plan, *,
          tokens: int | None = None) -> Fp8Plan:
    """Run the ``nn.Linear`` layers of ``model`` that the plan (from the cache, or given)
    runs in FP8 as torchao ``Float8Linear`` modules; returns the plan. Call it before
    ``torch.compile`` and before FSDP2 wraps the model."""
    plan = cache if isinstance(cache, Fp8Plan) else find_plan(cache, linear_layers(model), tokens)
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    convert_linears(model, plan.fp8_layers, device)
    return plan
