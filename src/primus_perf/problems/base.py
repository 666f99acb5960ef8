"""What every problem type shares: its kind name (given where the type is defined, which
also registers it), the check of its fields' types and sizes (run before the type's own
``__post_init__``), a reader of one problems-file item, and a dataclass reader that names
unknown fields."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, fields
from typing import Any, ClassVar, TypeVar

MAX_SIZE = 2**31 - 1  # a size GPU kernels and BLAS libraries take (int32)
MAX_STRIDE = 2**62  # a batch stride (elements), products of sizes

_TYPES: dict[str, type[ProblemType]] = {}  # kind name -> problem type, in definition order
_P = TypeVar("_P", bound="ProblemType")


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
        own = cls.__dict__.get("__post_init__")

        def __post_init__(self: Any) -> None:
            check_fields(self)
            if own is not None:
                own(self)

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]

    def to_dict(self) -> dict[str, Any]:
        """The problem's fields (a dataclass's, unless the type has its own spelling)."""
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_P], data: dict[str, Any]) -> _P:
        """The problem of :meth:`to_dict`'s fields (:func:`dataclass_from_dict` by default)."""
        return dataclass_from_dict(cls, data)

    @classmethod
    def from_item(cls, data: dict[str, Any]) -> ProblemType:
        """The problem of one problems-file item's fields (types may accept other spellings)."""
        return cls.from_dict(data)


def check_fields(problem: Any) -> None:
    """ValueError naming the field for a value of the wrong type or size: an ``int`` field
    holds an integer (not a bool; numpy's are taken as ints) of at most :data:`MAX_SIZE`
    (a ``stride`` :data:`MAX_STRIDE`), a ``bool`` field true or false (``"maybe"`` is
    neither), a ``float`` field a finite number. The type's own ``__post_init__`` checks
    what the values mean (positive sizes, known dtypes)."""
    name = type(problem).__name__
    for f in fields(problem):
        value = getattr(problem, f.name)
        if f.type == "int":
            if isinstance(value, bool) or type(value).__name__ == "bool_" or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}.{f.name} must be an int, got {value!r}")
            bound = MAX_STRIDE if f.name.startswith("stride") else MAX_SIZE
            if value > bound:
                raise ValueError(f"{name}.{f.name} is {value}, more than {bound} (no kernel takes it)")
            object.__setattr__(problem, f.name, int(value))
        elif f.type == "bool":
            if not isinstance(value, bool) and type(value).__name__ != "bool_":
                raise ValueError(f"{name}.{f.name} must be true or false, got {value!r}")
            object.__setattr__(problem, f.name, bool(value))
        elif f.type == "float" and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                    or not math.isfinite(value)):
            raise ValueError(f"{name}.{f.name} must be a finite number, got {value!r}")


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
