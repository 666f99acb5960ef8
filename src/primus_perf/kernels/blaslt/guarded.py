"""Matrices laid out exactly as a BLAS-Lt call describes them, over guarded storage.

A :class:`GuardedMatrix` owns one byte buffer: the matrix's extent (``blaslt.layout``) and
``guard_bytes`` after it, every byte not covered by the matrix's elements (the guard, and
the gaps a leading dimension or a batch stride leaves) holding :data:`SENTINEL`. After a
kernel ran, :meth:`GuardedMatrix.touched` names the first byte outside the elements that
no longer holds what it held: a kernel that wrote past (or between) its matrices is
caught, and the tuner rejects it. Reads outside the extent are caught by
compute-sanitizer's memcheck with ``guard_bytes=0`` (each buffer its own allocation, with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1``).

:meth:`GuardedMatrix.torch_view` is the matrix as torch holds it (row-major: the BLAS
column-major ``rows x cols`` matrix with leading dimension ``ld`` is torch's ``cols x rows``
with strides ``(ld, 1)``, batched as ``(batch, cols, rows)`` with strides ``(stride, ld, 1)``).
"""

from __future__ import annotations

from typing import Any

from primus_perf.kernels.blaslt.layout import MatrixLayout
from primus_perf.problems import torch_dtype

SENTINEL = 0xA5  # the byte every guard and gap holds
GUARD_BYTES = 4096
_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class GuardError(RuntimeError):
    """A kernel wrote outside the elements of a matrix."""


class GuardedMatrix:
    """One matrix of ``layout`` over a buffer of its extent plus ``guard_bytes``."""

    def __init__(self, layout: MatrixLayout, device: Any, guard_bytes: int = GUARD_BYTES) -> None:
        import torch

        self.layout = layout
        self.extent_bytes = layout.extent_bytes()
        self.storage = torch.full((self.extent_bytes + guard_bytes,), SENTINEL, dtype=torch.uint8, device=device)
        self.dtype = torch_dtype(layout.dtype)
        self.view = self._shaped(self.storage[: self.extent_bytes].view(self.dtype))
        self._owned: Any = None  # bytes of the elements (0xFF) and of the rest (0)
        self._saved: Any = None

    def _shaped(self, flat: Any) -> Any:
        m = self.layout
        if m.batch > 1:
            return flat.as_strided((m.batch, m.cols, m.rows), (m.stride, m.ld, 1))
        return flat.as_strided((m.cols, m.rows), (m.ld, 1))

    def torch_view(self, transposed: bool) -> Any:
        """The matrix as torch holds it; ``transposed``: its transposed view (``.mT``)."""
        return self.view.mT if transposed else self.view

    def fill_random(self, generator: Any) -> None:
        import torch

        values = torch.randn(self.view.shape, generator=generator, device=self.storage.device)
        self.view.copy_(values.to(self.dtype))

    def reset(self, value: float) -> None:
        """Every element ``value``, every other byte the sentinel (an output before a call)."""
        self.storage.fill_(SENTINEL)
        self.view.fill_(value)

    def save(self) -> None:
        """Remember the whole buffer (an input: :meth:`touched` then also catches writes to
        its elements)."""
        self._saved = self.storage.clone()

    def touched(self) -> str | None:
        """Where a kernel wrote outside the elements (or into a saved input), or None."""
        import torch

        if self._saved is not None:
            changed = self.storage != self._saved
        else:
            if self._owned is None:
                owned = torch.zeros_like(self.storage)
                ints = owned[: self.extent_bytes].view(getattr(torch, _INT_OF_SIZE[self.layout.itemsize]))
                self._shaped(ints).fill_(-1)
                self._owned = owned == 0
            changed = (self.storage != SENTINEL) & self._owned
        hits = changed.nonzero()
        if hits.numel() == 0:
            return None
        first = int(hits[0, 0])
        name = self.layout.name.upper()
        if first >= self.extent_bytes:
            where = "the guard after it"
        elif self._saved is not None:
            where = "its elements"
        else:
            where = "a gap between its elements"
        what = f"{name} (an input) was written" if self._saved is not None else f"{name} was written outside its elements"
        return f"{what}: {hits.shape[0]} bytes, the first at byte {first} ({where}; extent {self.extent_bytes} bytes)"
