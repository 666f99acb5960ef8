"""The attention kind: ``scaled_dot_product_attention`` problems, routed to an SDPA backend or
the Triton kernel with its tile config."""

from primus_perf.kinds import Kind, RouterPart
from primus_perf.problems import AttentionProblem

KIND = Kind(AttentionProblem, "attention", parts={
    "router": RouterPart("primus_perf.kernels.attention.router:AttentionRouter.from_entries",
                         "primus_perf.kernels.attention.router:library_versions"),
    "intercept": "primus_perf.runtime.attention:AttentionDispatch",
    "tuner": "primus_perf.tuner.attention.plugin:AttentionTuner",
    "online": "primus_perf.tuner.attention.online:adapter",
    "trace": "primus_perf.tracelens.perf_models:ATTENTION_TRACE",
    "cli": "primus_perf.cli.tune_attention:CLI",
})
