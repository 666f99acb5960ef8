"""Tuned kernels in any PyTorch program: :func:`enable` (``handle``), the routing path every
routed call takes (``routes``), the dispatcher overrides that lead there (``intercept``) and,
under ``torch.compile`` with Inductor, the custom ops and graph passes that do (``compiled``).
Sits above ``kernels`` and ``cache``; imports the tuner only for online tuning."""

from __future__ import annotations

from primus_perf.runtime.handle import Handle, active, enable

__all__ = ["Handle", "active", "enable"]
