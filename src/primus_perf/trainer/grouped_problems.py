"""The grouped-GEMM problems a training run really meets, for the tuner.

:func:`record_grouped_problems` builds the trainer for a config, runs a few optimizer
steps with a recording router in the grouped dispatch (it sees every pass of every MoE layer,
with the exact operands, dtype and tokens per local expert of that step, so expert
parallelism's local counts too) and returns the unique problems, each with how many calls it
had. The routing of the first steps decides the
token-distribution buckets; a run whose routing settles later (a bias-balanced router)
meets the same problems when its buckets hold, and new ones otherwise.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from primus_perf.base.errors import ConfigError
from primus_perf.kernels.grouped import problem_of
from primus_perf.kinds import GROUPED
from primus_perf.problems import GroupedGemmProblem
from primus_perf.runtime import dispatch
from primus_perf.trainer.config import TrainerConfig
from primus_perf.trainer.flops import is_moe_layer
from primus_perf.trainer.loop import Trainer


def record_grouped_problems(
    cfg: TrainerConfig, steps: int = 3, on_step: Callable[[int], None] | None = None
) -> list[tuple[GroupedGemmProblem, int]]:
    """``(problem, calls)`` of every grouped GEMM ``steps`` training steps of ``cfg`` ran,
    in first-seen order (``on_step(i)`` after each step). ConfigError for a config without
    routed experts."""
    if not any(is_moe_layer(cfg.model, i) for i in range(cfg.model.n_layers)):
        raise ConfigError("the config has no MoE layer (model.moe.n_experts, first_k_dense): it runs no grouped GEMM")
    seen: dict[str, GroupedGemmProblem] = {}
    calls: Counter[str] = Counter()
    trainer = Trainer(cfg)
    previous = dispatch.of(GROUPED.name).router  # a cache's router, when the config enables one

    class Recorder:
        def route(self, phase, a, b, offsets, baseline):
            p = problem_of(phase, a, b, offsets.counts())
            seen.setdefault(p.key(), p)
            calls[p.key()] += 1
            return previous.route(phase, a, b, offsets, baseline) if previous is not None else (p.key(), None)

    try:
        with dispatch.routing({GROUPED.name: Recorder()}, trainer.device.type):
            for i in range(steps):
                trainer.train_step()
                if on_step is not None:
                    on_step(i)
    finally:
        trainer.close()
    return [(p, calls[key]) for key, p in seen.items()]
