"""The GEMM kind: ``aten::mm``, ``addmm`` and ``bmm`` problems, routed to stored cuBLASLt or
hipBLASLt algorithms."""

from primus_perf.kinds import Kind, RouterPart
from primus_perf.problems import GemmProblem

KIND = Kind(GemmProblem, "GEMM", ("m", "n", "k"), parts={
    "router": RouterPart("primus_perf.kernels.gemm:GemmRouter.from_entries", "primus_perf.kernels.gemm:library_versions"),
    "intercept": "primus_perf.runtime.gemm:GemmDispatch",
    "tuner": "primus_perf.tuner.gemm.plugin:GemmTuner",
    "online": "primus_perf.tuner.gemm.online:adapter",
    "trace": "primus_perf.tracelens.perf_models:GEMM_TRACE",
    "cli": "primus_perf.cli.tune_gemm:CLI",
})
