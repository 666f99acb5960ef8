"""Whether torch.profiler is recording, checked per call at the cost of one attribute read.

The kernels call their work differently while the profiler records, so that a trace names
it: the GEMM router through the ``primus_perf::gemm`` operator (:mod:`.gemm`), each pass
of a grouped GEMM inside an annotation that names its problem (``runtime.grouped``).
Outside the profiler they pay only this check (a path that reads it per call and wants no
function call for it holds :func:`autograd_profiler` and reads ``_is_profiler_enabled``).
"""

from __future__ import annotations

import functools
from typing import Any


def profiler_on() -> bool:
    """True while torch.profiler records (torch keeps the flag in a Python global)."""
    return bool(autograd_profiler()._is_profiler_enabled)


@functools.cache
def autograd_profiler() -> Any:
    """``torch.autograd.profiler``, imported once (callers may import torch lazily)."""
    import torch.autograd.profiler

    return torch.autograd.profiler
