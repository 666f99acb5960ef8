"""What every problem type shares: its kind name (given where the type is defined, which
also registers it), a reader of one problems-file item, and a dataclass reader that names
unknown fields."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

_TYPES: dict[str, type[ProblemType]] = {}  # kind name -> problem type, in definition order


class ProblemType:
    """Base of the problem dataclasses: ``class GemmProblem(ProblemType, kind="gemm")``
    names the kind whose problems the type holds (``primus_perf.kinds`` registers one Kind
    record per problem type)."""

    kind: ClassVar[str]

    def __init_subclass__(cls, kind: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind in _TYPES:
            raise ValueError(f"two problem types for kind {kind!r}: {_TYPES[kind].__name__}, {cls.__name__}")
        cls.kind = kind
        _TYPES[kind] = cls

    @classmethod
    def from_item(cls, data: dict[str, Any]) -> ProblemType:
        """The problem of one problems-file item's fields (types may accept other spellings)."""
        return cls.from_dict(data)  # type: ignore[attr-defined]


def problem_types() -> dict[str, type[ProblemType]]:
    """Kind name -> problem type, for every problem type defined."""
    return dict(_TYPES)


def forget_problem_type(kind: str) -> None:
    """Remove a problem type defined outside the package (a test's toy kind) from the registry."""
    _TYPES.pop(kind, None)


def problem_type(kind: str) -> type[ProblemType]:
    """The problem type of ``kind``; ValueError naming the known kinds for any other name."""
    try:
        return _TYPES[kind]
    except KeyError:
        raise ValueError(f"unknown kind {kind!r} ({', '.join(_TYPES)})") from None


def dataclass_from_dict(cls: Any, data: dict[str, Any]) -> Any:
    """``cls(**data)`` for a dataclass; ValueError naming any field ``cls`` does not have."""
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s): {sorted(unknown)}")
    return cls(**data)
