"""Tuned kernels in a running program, in one place:

- ``activate``: a tuning cache's entries -> one router per kind (usable on this device);
- ``routes``: the routers in use and the one path a routed call takes;
- ``seams``: the routing points code calls directly (the trainer's linear and attention,
  and every MoE expert GEMM through ``grouped_mm``);
- ``intercept``: the dispatcher overrides that send an unmodified program's aten calls to
  the routes, and ``compiled``: the custom ops and Inductor passes that do so under
  ``torch.compile``;
- ``handle``: :func:`enable` (activate, install, intercept) and the :class:`Handle` that
  turns it off.

Sits above ``kernels`` and ``cache``; never imports the tuner: online tuning is handed to
:func:`enable` from above (``handle.OnlineTuning``). Programs use ``primus_perf.enable``.
"""

from __future__ import annotations

from primus_perf.runtime.handle import Handle, OnlineTuning, active, enable

__all__ = ["Handle", "OnlineTuning", "active", "enable"]
