"""The plan tuner's choice per layer group, from step times measured in the step.

A group (the layers of one role, one shape: every block's ``mlp.w13``, say) is measured
with each candidate recipe against bf16 in interleaved blocks of training steps (the rest
of the model in bf16): :class:`GroupMeasurement` holds the per-block median step times of
both sides, paired block by block. A recipe wins a group when its saving (median bf16 step
minus median FP8 step) exceeds both the noise (the half range of the paired blocks'
differences) and ``min_gain`` of the step; the largest winning saving is chosen, and a
group with no winner stays bf16 (small GEMMs, where the quantization costs more than the
FP8 GEMM saves).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from primus_perf.kernels.fp8.recipes import BF16

MIN_GAIN = 0.002  # a recipe must save at least this fraction of the step


@dataclass
class GroupMeasurement:
    group: str
    recipe: str
    bf16_s: list[float]  # per block: median step time with the group in bf16
    fp8_s: list[float]  # per block: median step time with the group in ``recipe``

    @property
    def saving_s(self) -> float:
        return statistics.median(self.bf16_s) - statistics.median(self.fp8_s)

    @property
    def noise_s(self) -> float:
        diffs = [b - f for b, f in zip(self.bf16_s, self.fp8_s)]
        return (max(diffs) - min(diffs)) / 2 if len(diffs) > 1 else 0.0

    @property
    def speedup(self) -> float:
        return statistics.median(self.bf16_s) / statistics.median(self.fp8_s)

    def wins(self, min_gain: float = MIN_GAIN) -> bool:
        return self.saving_s > max(self.noise_s, min_gain * statistics.median(self.bf16_s))

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "bf16_ms": statistics.median(self.bf16_s) * 1e3,
                "fp8_ms": statistics.median(self.fp8_s) * 1e3, "saving_ms": self.saving_s * 1e3,
                "noise_ms": self.noise_s * 1e3, "speedup": self.speedup}


def choose(groups: Mapping[str, Iterable[str]], measured: Iterable[GroupMeasurement],
           *, min_gain: float = MIN_GAIN) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """(layer -> recipe or bf16, group -> its choice and every candidate's figures)."""
    by_group: dict[str, list[GroupMeasurement]] = {}
    for m in measured:
        by_group.setdefault(m.group, []).append(m)
    layers: dict[str, str] = {}
    summary: dict[str, dict[str, Any]] = {}
    for group, names in groups.items():
        cands = by_group.get(group, [])
        winners = [m for m in cands if m.wins(min_gain)]
        best = max(winners, key=lambda m: m.saving_s) if winners else None
        choice = best.recipe if best else BF16
        names = list(names)
        for n in names:
            layers[n] = choice
        summary[group] = {"choice": choice, "layers": len(names),
                          "candidates": [m.to_dict() for m in cands]}
    return layers, summary
