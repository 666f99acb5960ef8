"""One colour per category (and per part of the temporal breakdown), the same in every report
and comparison: a fixed table, and for a category the table does not know, a colour picked
by a hash of its name (stable across runs and machines)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from primus_perf.tracelens import categories as C

# the temporal breakdown's parts (analyses.breakdown), then every category: one colour each
TEMPORAL_PARTS = ("compute", "exposed_comm", "exposed_memcpy", "idle")
CATEGORY_COLORS = {
    "compute": "#3a9d8f", "exposed_comm": "#d9534f", "exposed_memcpy": "#d4b21f", "idle": "#b8bec9",
    C.GEMM: "#3b6fd8", C.ATTENTION_FWD: "#e8793a", C.ATTENTION_BWD: "#a05a2c", C.COMMUNICATION: "#d9534f",
    C.MEMCPY: "#d4b21f", C.MEMSET: "#e6d36a", C.ELEMENTWISE: "#2fa36b", C.NORMALIZATION: "#20a3b5",
    C.REDUCTION: "#8a63d2", C.OPTIMIZER: "#c9458f", C.OTHER: "#7a8699",
}
# categories without an entry take one of these, chosen by a hash of the name (stable everywhere)
SPARE_COLORS = ("#4a4f9c", "#5fbf3a", "#e0475b", "#1f7a8c", "#b07cc6", "#8c6d1f", "#ff9f1c", "#2e4057")


def category_colors(names: Sequence[str]) -> dict[str, str]:
    """Category (or temporal part) -> colour: the fixed table, else a hash of the name."""
    return {n: CATEGORY_COLORS.get(n) or SPARE_COLORS[zlib.crc32(n.encode()) % len(SPARE_COLORS)] for n in names}
