"""The grouped-GEMM kind: MoE expert layers (``aten::_grouped_mm``), routed to a backend (the
per-expert loop, torch's grouped_mm, padded bmm, Triton with its tile config)."""

from primus_perf.kinds import Kind, RouterPart
from primus_perf.problems import GroupedGemmProblem

KIND = Kind(GroupedGemmProblem, "grouped GEMM", ("groups", "k", "n", "tokens", "skew", "skew_known"), parts={
    "router": RouterPart("primus_perf.kernels.grouped.router:GroupedGemmRouter.from_entries",
                         "primus_perf.kernels.grouped.router:library_versions"),
    "intercept": "primus_perf.runtime.grouped:GroupedDispatch",
    "tuner": "primus_perf.tuner.grouped.plugin:GroupedGemmTuner",
    "online": "primus_perf.tuner.grouped.online:adapter",
    "trace": "primus_perf.tracelens.perf_models:GROUPED_TRACE",
    "cli": "primus_perf.cli.tune_grouped:CLI",
})
