"""The kinds the tuner knows: kind -> its plugin class (the one line a new kind adds)."""

from __future__ import annotations

from primus_perf.tuner.attention.plugin import AttentionTuner
from primus_perf.tuner.core import Tuner
from primus_perf.tuner.gemm.plugin import GemmTuner

KINDS: dict[str, type] = {
    "gemm": GemmTuner,
    "attention": AttentionTuner,
}


def default_tuners() -> list[Tuner]:
    """One tuner per kind, with its default settings."""
    return [cls() for cls in KINDS.values()]
