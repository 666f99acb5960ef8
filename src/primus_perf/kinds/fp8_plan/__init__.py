"""The FP8 plan kind: which linear layers of a model run in FP8. Tuned and applied as a whole
(``tuner.fp8``, ``runtime.fp8.apply``, ``train.fp8``): no router and no intercept."""

from primus_perf.kinds import Kind
from primus_perf.problems import Fp8PlanProblem

KIND = Kind(Fp8PlanProblem, "FP8 plan", ("layers", "tokens"), label=Fp8PlanProblem.label)
