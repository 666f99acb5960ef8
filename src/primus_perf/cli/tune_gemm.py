"""``primus-tune gemm``: the GEMM kind's CLI part (the command: :mod:`.tune_kind`)."""

from __future__ import annotations

import typer

from primus_perf.cli.tune_kind import CliPart
from primus_perf.problems import GemmProblem

HELP = """Tune GEMM problems with cuBLASLt/hipBLASLt and write the cache after each problem
        (resumes: problems already in the cache for this GPU and library are skipped).

        This is offline tuning (--offline, the default), before a run. To tune inside a run
        instead (the first steps time each new problem's candidates on the GPU, then write
        the cache): --online --config PRESET [overrides] (the trainer, --steps steps) or
        --online -- script.py args (any program, under primus_perf.enable)."""


CLI = CliPart(
    HELP, "primus_perf.tuner.gemm.plugin:GemmTuner", spec=lambda text, values: GemmProblem.from_spec(text),
    spec_help="A problem M,N,K[,layout,dtype] (torch's [M,K] @ [K,N]; layout TN, dtype bf16 by default) or its label"
              " as analyze prints it, e.g. '8192x4096x14336 bf16 TN' (repeatable)",
    options={"widen": (bool, typer.Option(False, "--widen", help="Also try split-K variants of the top heuristics"))})
