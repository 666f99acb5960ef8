"""``primus-tune grouped-gemm``: the grouped-GEMM kind's CLI part (the command:
:mod:`.tune_kind`): race the grouped-GEMM backends and Triton configs per pass of the MoE
expert GEMMs, write the cache."""

from __future__ import annotations

from typing import Any

import typer

from primus_perf.base.errors import UserError
from primus_perf.cli.common import console
from primus_perf.cli.tune_kind import CliPart
from primus_perf.kinds import GROUPED

DEVICES = ("cuda", "cpu")
HELP = f"""Tune MoE grouped GEMMs: the per-expert loop (default), torch._grouped_mm, padded
        bmm and the Triton grouped GEMM's configs, each pass (fwd, dgrad, wgrad) its own
        problem, timed with the launches a step pays; the fastest per problem goes to the
        cache (written after each problem; a rerun resumes). Problems come from profiler
        traces (--trace: the grouped GEMMs a run profiled, `primus-profile run`), problems
        files (items {{"kind": "{GROUPED.name}", "problem": {{...}}}}, `primus-profile shapes`) or
        a short run of a config (--config PRESET [overrides]: --steps steps are trained and
        the grouped GEMMs they ran are tuned); that is --offline, the default. --online tunes
        during the run instead (--config PRESET [overrides], or a program after --), on a
        GPU. primus-train and primus_perf.enable() route them from the cache."""


def check(values: dict[str, Any]) -> None:
    """``--device`` one of :data:`DEVICES`; ``--device cpu`` tunes in this process (one worker)."""
    device, gpus = values["device"], values["gpus"]
    if device not in DEVICES:
        raise UserError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu" and gpus.strip() != "1":
        raise UserError(f"--gpus {gpus} tunes on GPUs; --device cpu tunes in this process")


def recorded(config: str, overrides: list[str], steps: int) -> list:
    """The grouped problems ``steps`` training steps of the config ran, each with its calls."""
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.grouped_problems import record_grouped_problems

    cfg = load_config(config, [*overrides, f"train.steps={max(steps, 1)}"])
    with console.status(f"recording the grouped GEMMs of {steps} steps of {config}"):
        return record_grouped_problems(cfg, steps)


CLI = CliPart(HELP, "primus_perf.tuner.grouped.plugin:GroupedGemmTuner", check=check, record=recorded, options={
    "triton": (bool, typer.Option(True, "--triton/--no-triton", help="Also search the Triton grouped GEMM")),
    "max_configs": (int, typer.Option(16, "--max-configs", min=0, help="Triton configs raced per problem")),
    "device": (str, typer.Option(
        "cuda", "--device", help="cuda: tune on the GPU (CUDA or ROCm); cpu: for runs on the CPU (Triton interpreted)")),
})
