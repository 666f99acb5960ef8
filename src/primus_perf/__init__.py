"""primus-perf: profile and autotune large-model training on NVIDIA and AMD GPUs."""

from __future__ import annotations

__version__ = "0.1.0"
