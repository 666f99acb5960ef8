"""Each kind's router part (``primus_perf.kinds.RouterPart``): the router built from a
tuning cache's entries, the running library versions those entries must match, and an
empty router. Importing this module attaches them to the kinds' records."""

from __future__ import annotations

from primus_perf import kinds
from primus_perf.kernels import gemm
from primus_perf.kernels.attention import router as attention
from primus_perf.kernels.grouped import router as grouped

kinds.attach(kinds.GEMM.name, router=kinds.RouterPart(
    gemm.GemmRouter.from_entries, gemm.library_versions, lambda: gemm.GemmRouter([])))
kinds.attach(kinds.GROUPED.name, router=kinds.RouterPart(
    grouped.GroupedGemmRouter.from_entries, grouped.library_versions, lambda: grouped.GroupedGemmRouter({})))
kinds.attach(kinds.ATTENTION.name, router=kinds.RouterPart(
    attention.AttentionRouter.from_entries, attention.library_versions, lambda: attention.AttentionRouter({})))
