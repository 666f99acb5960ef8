"""The problem of an FP8 plan (``kernels.fp8.plan``): the model's identity as its GEMMs see
it, the linear layers (name, out features, in features), the rows of their forward GEMM per
step (``tokens``: micro-batch x sequence on one rank) and the high-precision dtype."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from primus_perf.problems.base import ProblemType

KIND = "fp8_plan"


@dataclass(frozen=True)
class Fp8PlanProblem(ProblemType, kind=KIND):
    layers: tuple[tuple[str, int, int], ...]  # (name, out_features, in_features), sorted by name
    tokens: int  # rows of each forward GEMM per step on one rank
    dtype: str = "bf16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(sorted((str(n), int(o), int(i)) for n, o, i in self.layers)))

    @property
    def layers_digest(self) -> str:
        return hashlib.sha1(json.dumps(self.layers).encode()).hexdigest()[:16]

    def key(self) -> str:
        return f"{KIND}:{len(self.layers)}x{self.layers_digest}:t{self.tokens}:{self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {"layers": [list(x) for x in self.layers], "tokens": self.tokens, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fp8PlanProblem:
        layers = data["layers"]
        if not isinstance(layers, list) or not all(isinstance(x, list) and len(x) == 3 for x in layers):
            raise ValueError("layers must be a list of [name, out_features, in_features]")
        return cls(tuple(tuple(x) for x in layers), int(data["tokens"]), str(data.get("dtype", "bf16")))

    def label(self) -> str:
        return f"{len(self.layers)} linear layers, {self.tokens} tokens, {self.dtype}"
