"""Expert load: the tokens each routed expert of an MoE model received over the profiled
steps, from the run's manifest.

``primus-profile run`` records with every step of an MoE model its ``tokens_per_expert``:
one list per MoE layer (model layers ``moe.first_k_dense`` and on), the tokens each expert
received over the whole data-parallel batch (a token counts once per expert it is routed
to, so a layer's tokens per step are the batch's tokens times ``top_k``). The profiled
(``active``) steps are read; a manifest without step phases gives all of its steps.

Per MoE layer (:func:`expert_load`): experts, profiled steps, tokens per step, and over
the experts of each one's mean tokens per step: min, median and max, the imbalance
``max / mean`` (1.0 is perfect balance), the worst single step's imbalance, the idle
experts (no token in any profiled step), and ``load``, each expert's mean tokens per step.

A run without MoE layers gives an empty table and no note; steps whose counts are missing
or malformed are left out with one note saying which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

COLUMNS = ["layer", "experts", "steps", "tokens", "min", "median", "max", "imbalance", "worst_step_imbalance",
           "idle", "load"]
KEY = "tokens_per_expert"  # the step record's field (the trainer's StepMetrics and JSON log name it so)
_SHOWN_STEPS = 3  # step numbers named in a note


def _counts(value: Any) -> list[list[int]] | None:
    """Per-layer token counts, or None when ``value`` is not a non-empty list of non-empty
    lists of non-negative integers."""
    ok = isinstance(value, list) and value and all(
        isinstance(layer, list) and layer and all(type(c) is int and c >= 0 for c in layer) for layer in value)
    return value if ok else None


def _first_moe_layer(manifest: dict[str, Any]) -> int:
    """The model layer of the first MoE layer: the config's ``moe.first_k_dense`` (0 unknown)."""
    cfg = manifest.get("config")
    model = cfg.get("model") if isinstance(cfg, dict) else None
    moe = model.get("moe") if isinstance(model, dict) else None
    k = moe.get("first_k_dense") if isinstance(moe, dict) else None
    return k if type(k) is int and k >= 0 else 0


def _step_names(records: Sequence[dict[str, Any]]) -> str:
    """``steps 4, 5 and 9 more``: 1-based step numbers as ``primus-profile run`` prints them."""
    nums = [str(r["index"] + 1) if type(r.get("index")) is int else "?" for r in records]
    shown = ", ".join(nums[:_SHOWN_STEPS])
    more = f" and {len(nums) - _SHOWN_STEPS} more" if len(nums) > _SHOWN_STEPS else ""
    return f"step{'s' if len(nums) > 1 else ''} {shown}{more}"


def _profiled_steps(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    steps = manifest.get("steps")
    records = [s for s in steps if isinstance(s, dict)] if isinstance(steps, list) else []
    active = [s for s in records if s.get("phase") == "active"]
    return active if active or any("phase" in s for s in records) else records


def _imbalance(counts: np.ndarray) -> float:
    """max / mean of expert loads (nan when no token)."""
    mean = float(counts.mean())
    return float(counts.max()) / mean if mean > 0 else float("nan")


def expert_load(manifest: dict[str, Any]) -> tuple[pd.DataFrame, list[str]]:
    """Per MoE layer, the load of its experts over the profiled steps (see the module
    docstring), and notes on steps left out."""
    profiled = _profiled_steps(manifest)
    recorded = [s for s in profiled if KEY in s]
    empty = pd.DataFrame(columns=COLUMNS)
    if not recorded:
        return empty, []
    notes = []
    if len(recorded) < len(profiled):
        notes.append(f"expert load: {len(profiled) - len(recorded)} of {len(profiled)} profiled steps did not "
                     f"record {KEY}; the table is of the other {len(recorded)}")
    good: list[list[list[int]]] = []
    bad: list[dict[str, Any]] = []
    for s in recorded:
        c = _counts(s[KEY])
        if c is not None and (not good or [len(x) for x in c] == [len(x) for x in good[0]]):
            good.append(c)
        else:
            bad.append(s)
    if bad:
        left = f"{len(good)} step(s) remain" if good else "no expert load is shown"
        notes.append(f"expert load: {KEY} of {_step_names(bad)} is not a list per MoE layer of token counts "
                     f"(or has another number of layers or experts than the first step); left out, {left}")
    if not good:
        return empty, notes
    first = _first_moe_layer(manifest)
    rows = []
    for i in range(len(good[0])):
        a = np.array([step[i] for step in good], dtype=np.float64)  # steps x experts
        load = a.mean(axis=0)
        per_step = np.array([_imbalance(row) for row in a])
        worst = float(np.nanmax(per_step)) if np.isfinite(per_step).any() else float("nan")
        rows.append((first + i, a.shape[1], a.shape[0], float(a.sum(axis=1).mean()), float(load.min()),
                     float(np.median(load)), float(load.max()), _imbalance(load), worst,
                     int((a.sum(axis=0) == 0).sum()), [float(v) for v in load]))
    return pd.DataFrame(rows, columns=COLUMNS), notes


def summary_line(table: pd.DataFrame) -> str | None:
    """One line on the expert load of a run (None without MoE layers): the most imbalanced
    layer and the idle experts."""
    if table.empty:
        return None
    worst = table.loc[table["imbalance"].fillna(-1.0).idxmax()]
    experts = sorted(set(table["experts"]))
    per_layer = f"{experts[0]} experts" if len(experts) == 1 else f"{experts[0]}-{experts[-1]} experts"
    idle = int(table["idle"].sum())
    return (f"Expert load over {int(table['steps'].iloc[0])} profiled step(s), {len(table)} MoE layer(s) of "
            f"{per_layer}: most imbalanced layer {int(worst['layer'])}, max/mean {_ratio(worst['imbalance'])} "
            f"(worst step {_ratio(worst['worst_step_imbalance'])}); {idle} idle expert(s)")


def _ratio(v: float) -> str:
    return "–" if np.isnan(v) else f"{v:.2f}"
