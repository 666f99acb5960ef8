"""Reading GEMM problems from a hand-written or generated problems file (JSON or YAML)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from primus_perf.errors import ConfigError
from primus_perf.problems import GemmProblem


def _problem(item: Any, where: str) -> GemmProblem | None:
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(item).__name__}")
    if item.get("kind", "gemm") != "gemm":
        return None
    data = item.get("problem", item)
    data = {k: v for k, v in data.items() if k not in ("kind", "count", "name")}
    try:
        if "M" in data:  # row-major spelling: M, N, K, a_transposed, b_transposed, dtype
            return GemmProblem.from_row_major(**data)
        return GemmProblem.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_problems(path: str | Path) -> list[GemmProblem]:
    """The GEMM problems of a file: a list, or ``{"problems": [...]}``; each item a
    ``GemmProblem`` dict, ``{"kind": "gemm", "problem": {...}}``, or the row-major spelling
    ``{"M":..., "N":..., "K":..., "b_transposed": true, "dtype": "bf16"}``. Other kinds are skipped."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"problems file not found: {p}")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:
        raise ConfigError(f"{p}: cannot parse: {str(exc).splitlines()[0]}") from None
    items = data.get("problems") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(f"{p}: expected a list of problems or {{'problems': [...]}}")
    out = []
    for i, item in enumerate(items):
        prob = _problem(item, f"{p} item {i}")
        if prob is not None:
            out.append(prob)
    return out
