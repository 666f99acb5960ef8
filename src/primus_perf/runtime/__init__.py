"""Tuned kernels in a running program: ``activate`` (a tuning cache's entries -> one router
per kind), ``dispatch`` (one owner per kind of its routing: router, counts, failures, the aten
overrides and Inductor pass, the only routing path), the kinds' dispatches (``gemm``,
``grouped``, ``attention``; ``native``: the GEMM overrides in C++), ``handle`` (:func:`enable`
and the :class:`Handle` that turns it off), ``fp8`` (FP8 plans applied to ``nn.Linear``
programs).

Sits above ``kernels`` and ``cache``; never imports the tuner: online tuning is handed to
:func:`enable` from above (``handle.OnlineTuning``). Programs use ``primus_perf.enable``.
"""

from __future__ import annotations

from primus_perf.runtime.handle import Handle, OnlineTuning, active, enable

__all__ = ["Handle", "OnlineTuning", "active", "enable"]
