"""The kinds the tuner knows: kind -> its plugin class (whose ``problem_type`` says which
problems it takes). A new kind is one plugin module and one line here."""

from __future__ import annotations

from primus_perf.tuner.attention.plugin import AttentionTuner
from primus_perf.tuner.gemm.plugin import GemmTuner

KINDS: dict[str, type] = {
    "gemm": GemmTuner,
    "attention": AttentionTuner,
}
