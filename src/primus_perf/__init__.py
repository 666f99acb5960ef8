"""primus-perf: profile and autotune large-model training on NVIDIA and AMD GPUs.

``primus_perf.enable(cache=PATH, online=False)`` routes any PyTorch program's GEMMs and
SDPA calls to a tuning cache's choices (``primus_perf.runtime``); it is imported on first
use, so ``import primus_perf`` stays light."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "enable":
        from primus_perf.runtime import enable

        globals()["enable"] = enable  # also over the launcher module of the same name
        return enable
    raise AttributeError(f"module 'primus_perf' has no attribute {name!r}")
