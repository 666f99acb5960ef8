"""Where each group's rows are, on the device and on the host: :class:`Offsets`.

``aten::_grouped_mm`` takes the groups as ``offs``, an int32 device tensor of cumulative row
ends (group g owns rows ``[offs[g-1], offs[g])``, ``offs[-1]`` counting as 0). Reading it on
the host (``offs.tolist()``) waits for the GPU: one device sync, which stalls the CPU's
launches for the rest of the step. The kernels that need only the boundaries on the device
(``torch._grouped_mm`` itself, the Triton grouped kernels) take ``offs`` as it is; the host
counts are read only for what cannot do without them (the per-expert loop and padded bmm
size their work from them, a choice that depends on the token skew, the profiler's
annotation). A tensor's host counts are read once per tensor and version: the forward,
input- and weight-gradient calls of one layer share one ``offs``. :meth:`Offsets.peek`
reads them without waiting: it starts a non-blocking copy into pinned memory and gives the
counts once that copy has landed (a layer's backward finds the copy its forward started
done).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

# (id(tensor), tag) -> (weakref, version, value): what was derived from a tensor, kept while it
# lives and until it is modified in place; shared by the forward and the backward (autograd's
# device thread)
_derived: dict[tuple[int, str], tuple[Any, int, Any]] = {}


def derived(t: torch.Tensor, tag: str, make: Callable[[torch.Tensor], Any]) -> Any:
    """``make(t)``, computed once per tensor, version and ``tag``."""
    key = (id(t), tag)
    hit = _derived.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    value = make(t)
    _derived[key] = (weakref.ref(t, lambda _r, k=key, d=_derived: d.pop(k, None)), t._version, value)
    return value


def known_counts(ends: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """``ends`` (made from the host ``counts``), marked as known on the host: a backend that
    needs the counts takes these instead of reading the device."""
    derived(ends, "counts", lambda _e: [int(c) for c in counts])
    return ends


def _counts_of(host: list[int]) -> list[int]:
    return [int(e) - int(s) for s, e in zip([0, *host[:-1]], host)]


def _host_counts(ends: torch.Tensor) -> list[int]:
    return _counts_of(ends.tolist())  # the one device sync


def _start_copy(ends: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A non-blocking copy of ``ends`` into pinned host memory, and the event it lands by."""
    host = torch.empty(ends.shape, dtype=ends.dtype, pin_memory=True)
    host.copy_(ends, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(ends.device))
    return host, event


class Offsets:
    """The groups of a grouped GEMM's ``rows`` rows: ``ends`` (the device int32 tensor of
    cumulative row ends, as the program passed it to ``aten::_grouped_mm``; None when only
    host counts exist) and/or host ``counts``. :meth:`counts` reads ``ends`` on the host when
    no counts were given (:attr:`read` then says this object's call waited for the device;
    a read another call of the same tensor made already costs nothing)."""

    __slots__ = ("_counts", "ends", "read", "rows")

    def __init__(self, rows: int, ends: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        if ends is None and counts is None:
            raise ValueError("Offsets need the device ends or the host counts")
        self.rows = int(rows)
        self.ends = ends
        self._counts = None if counts is None else [int(c) for c in counts]
        self.read = False

    @property
    def groups(self) -> int:
        return len(self._counts) if self._counts is not None else int(self.ends.shape[0])

    @property
    def known(self) -> bool:
        """Whether the host counts are at hand without waiting for the device."""
        if self._counts is not None:
            return True
        hit = _derived.get((id(self.ends), "counts"))
        return hit is not None and hit[0]() is self.ends and hit[1] == self.ends._version

    def counts(self) -> list[int]:
        """Tokens per group on the host (waiting for the device where no earlier read or copy
        has them); ValueError when ``ends`` decrease or pass ``rows``."""
        if self._counts is None:
            if not self.known:
                self.read = True
            return self._checked(derived(self.ends, "counts", _host_counts))
        return self._counts

    def peek(self) -> list[int] | None:
        """The host counts where they are at hand without waiting for the device, else None
        (a non-blocking copy is then under way: a later call of the same tensor finds it).
        ``ends`` on the CPU: :meth:`counts`."""
        if self._counts is not None or self.known or self.ends.device.type != "cuda":
            return self.counts()
        host, event = derived(self.ends, "copy", _start_copy)
        if not event.query():
            return None
        return self._checked(derived(self.ends, "counts", lambda _e: _counts_of(host.tolist())))

    def _checked(self, counts: list[int]) -> list[int]:
        if any(c < 0 for c in counts) or sum(counts) > self.rows:
            raise ValueError(f"offs {[*counts]} do not split {self.rows} rows into groups")
        self._counts = counts
        return counts
