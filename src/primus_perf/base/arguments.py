"""The public API checks its arguments' types: ``primus_perf.enable(123)`` or
``primus_perf.analyze(5)`` is one clear :class:`ArgumentTypeError` naming the function, the
parameter and what it takes, not a TypeError from deep inside. Every function
``primus_perf`` exports is wrapped once, when first used (``primus_perf.__getattr__``), by
:func:`checked`, which reads its annotations: a class is an ``isinstance`` check (an int
passes for a float, a bool never for an int), a union any of its members, a generic its
container (``Sequence[str]``: a sequence), a callable ``callable``; ``Any`` and what cannot
be resolved pass."""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

from primus_perf.base.errors import UserError


class ArgumentTypeError(UserError, TypeError):
    """An argument of the wrong type given to a public function (a TypeError, and a user
    error: one line at the command line)."""


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any or isinstance(hint, typing.TypeVar):
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is collections.abc.Callable or hint is collections.abc.Callable:
        return callable(value)
    if origin is not None:
        return not isinstance(origin, type) or isinstance(value, origin)
    if not isinstance(hint, type):
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _spell(hint: Any) -> str:
    if hint is None or hint is type(None):
        return "None"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_spell(h) for h in typing.get_args(hint))
    return getattr(hint, "__name__", None) or str(hint).replace("collections.abc.", "")


def checked(fn: Callable[..., Any], public: str) -> Callable[..., Any]:
    """``fn`` with its arguments checked against its annotations (``fn`` itself when they
    cannot be resolved)."""
    try:
        hints = typing.get_type_hints(fn)
        sig = inspect.signature(fn)
    except Exception:  # an annotation this module cannot resolve: unchecked
        return fn

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise ArgumentTypeError(f"{public}: {exc}") from None
        for name, value in bound.arguments.items():
            hint = hints.get(name)
            kind = sig.parameters[name].kind
            if hint is None or kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                continue
            if not _matches(value, hint):
                raise ArgumentTypeError(f"{public}: {name} must be {_spell(hint)}, got {type(value).__name__}"
                                        f" {repr(value)[:60]}")
        return fn(*args, **kwargs)

    return wrapper
