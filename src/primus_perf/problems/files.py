"""Problems files: the JSON/YAML lists of problems ``primus-profile shapes`` writes and the
tuners read (``--problems``), one item per problem with its kind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from primus_perf.problems.base import problem_type

PROBLEMS_SCHEMA = "primus-perf-problems/1"
MAX_PROBLEMS_BYTES = 256 << 20

Problem = Any  # an instance of a problem type: GemmProblem | GroupedGemmProblem | AttentionProblem


def problem_from_item(item: Any) -> Problem:
    """One item of a problems file: ``{"kind": <kind>, "problem": {...}}`` (what
    ``primus-profile shapes`` writes; ``kind`` defaults to ``gemm``), read by the kind's
    problem type (``from_item``): a grouped GEMM's fields are those of
    :class:`GroupedGemmProblem`, e.g. ``{"groups": 32, "k": 7168, "n": 4096, "tokens":
    8192, "skew": 2, "phase": "fwd"}``, or ``counts`` (tokens per group) in place of
    ``groups``/``tokens``/``skew``; a bare ``GemmProblem`` dict, or the row-major GEMM
    spelling ``{"M": 4096, "N": 6144, "K": 4096, "b_transposed": true, "dtype": "bf16"}``.
    ValueError (naming the field) for anything else."""
    if not isinstance(item, dict):
        raise ValueError(f"expected a mapping, got {type(item).__name__}")
    kind = item.get("kind", "gemm")
    data = item.get("problem", item)
    if not isinstance(data, dict):
        raise ValueError(f"'problem' must be a mapping, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in ("kind", "count", "label", "time_s", "name")}
    cls = problem_type(kind)
    try:
        return cls.from_item(data)
    except TypeError as exc:  # missing or unexpected keyword
        raise ValueError(str(exc).replace("__init__() ", "").replace("from_row_major() ", "")) from None


def load_problems(path: str | os.PathLike) -> list[Problem]:
    """The problems of a JSON or YAML problems file, in file order: a list, or a mapping with
    a ``problems`` list (``primus-profile shapes`` output, ranked by time); each item as
    :func:`problem_from_item` reads it. A problem listed twice is kept once. The one reader
    of problems files: every error is a one-line :class:`~primus_perf.base.errors.ConfigError`
    naming the file and the item."""
    from primus_perf.base.errors import ConfigError, UserError
    from primus_perf.base.files import load_json, load_yaml, read_input

    p = Path(path)
    try:
        text = read_input(p, what="problems file", max_bytes=MAX_PROBLEMS_BYTES, text=True).decode("utf-8")
        data = load_yaml(text) if p.suffix in (".yaml", ".yml") else load_json(text)
    except UserError as exc:
        raise ConfigError(str(exc)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{p}: cannot read the problems file: {str(exc).splitlines()[0]}") from None
    items = data.get("problems") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ConfigError(f"{p}: expected a list of problems or {{'problems': [...]}}")
    if not items:
        raise ConfigError(f"{p}: the problems file lists no problem")
    out: dict[str, Problem] = {}
    for i, item in enumerate(items):
        try:
            prob = problem_from_item(item)
        except ValueError as exc:
            raise ConfigError(f"{p} item {i}: {exc}") from None
        out.setdefault(prob.key(), prob)
    return list(out.values())
