"""Search over Triton tile configs: measurements, the ``grid`` and ``tpe`` strategies.

The forward and the backward kernels are separate launches, so a config pair's cost is
``fwd_ms + bwd_ms`` (the trainer runs both, the choice is made on the sum). The
``Evaluator`` measures one forward or one backward config at a time and remembers it:

1. configs that cannot run are pruned before launch (``configs.fwd_invalid``);
2. the config is checked against the fp32 reference on fresh random inputs (output for a
   forward config; dQ/dK/dV for a backward config) and rejected if it fails;
3. a short measurement; configs slower than the best so far by ``decide.DROP_RATIO``
   stop there; the others get the full measurement (median of ``reps`` calls). Every
   measurement goes through the tuner's timer (``tuner.measure``); times here are in ms.

``grid`` evaluates every forward and every backward config of the space, which covers
every pair; ``tpe`` runs an optuna study over the pair (one categorical per parameter),
seeded with known-good configs, pruning slow trials after the short measurement, stored
in SQLite when given a path so that an interrupted search resumes. Both return the best
forward with the best backward config measured (the cost is separable).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from primus_perf.base.errors import one_line
from primus_perf.kernels.attention.configs import (
    AttnConfig,
    BwdConfig,
    FwdConfig,
    bwd_invalid,
    fwd_invalid,
)
from primus_perf.kernels.attention.function import triton_attention
from primus_perf.kernels.attention.kernels import flash_bwd, flash_fwd
from primus_perf.kernels.attention.reference import (
    check_numerics,
    random_qkv,
    reference_attention,
    relative_error,
    tolerance,
    validation_shape,
)
from primus_perf.problems import AttentionProblem, torch_dtype
from primus_perf.tuner import measure
from primus_perf.tuner.attention.space import STRATEGIES, SearchSpace, grid_size, known_good
from primus_perf.tuner.decide import DROP_RATIO
from primus_perf.tuner.measure import Timer

Progress = Callable[[str], None]


@dataclass
class Measurement:
    """One forward or backward config on one problem."""

    part: str  # "fwd" or "bwd"
    config: FwdConfig | BwdConfig
    status: str  # "ok", "slow" (pruned after the short measurement), "invalid", "failed", "numerics"
    ms: float = math.inf
    error: float = math.nan  # worst relative error vs fp32 reference
    reason: str = ""
    samples_s: list[float] = field(default_factory=list)  # the full measurement's timed calls (seconds)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class SearchResult:
    strategy: str
    config: AttnConfig | None
    fwd_ms: float
    bwd_ms: float
    trials: int  # pairs proposed (tpe) or covered (grid: |fwd| x |bwd|)
    measured: int  # distinct configs measured (forward + backward), the search's cost
    measurements: list[Measurement] = field(default_factory=list)


class Evaluator:
    """Measures forward and backward configs on one problem; remembers every result."""

    def __init__(
        self,
        problem: AttentionProblem,
        *,
        arch: str,
        device: str = "cuda",
        reps: int = 20,
        short_reps: int = 3,
        validate: bool = True,
        seed: int = 0,
        timer: Timer | None = None,
        inputs: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        """``inputs``: the problem's real-size ``(q, k, v, do)`` to time on (a caller
        that already holds them shares them); None: fresh random ones from ``seed``."""
        if problem.causal and problem.seq_q != problem.seq_kv:
            raise ValueError("causal problems need seq_q == seq_kv")
        self.problem = problem
        self.arch = arch
        self.device = device
        self.reps = reps
        self.short_reps = short_reps
        self.validate = validate
        self._seed = seed
        self.timer = timer or measure.default_timer()
        self.dtype = torch_dtype(problem.dtype)
        if inputs is None:
            p = problem
            q, k, v = random_qkv(p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_kv, p.head_dim, self.dtype,
                                 device, seed)
            inputs = (q, k, v, torch.randn_like(q))
        self.q, self.k, self.v, self.do = inputs
        self._o: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        self._good_fwd: FwdConfig | None = None
        self.fwd_results: dict[FwdConfig, Measurement] = {}
        self.bwd_results: dict[BwdConfig, Measurement] = {}

    # ---- bookkeeping ------------------------------------------------------------------

    @property
    def measured(self) -> int:
        return sum(
            m.status in ("ok", "slow", "numerics", "failed")
            for m in [*self.fwd_results.values(), *self.bwd_results.values()]
        )

    def best_fwd(self) -> Measurement | None:
        ok = [m for m in self.fwd_results.values() if m.ok]
        return min(ok, key=lambda m: m.ms) if ok else None

    def best_bwd(self) -> Measurement | None:
        ok = [m for m in self.bwd_results.values() if m.ok]
        return min(ok, key=lambda m: m.ms) if ok else None

    def _fresh_seed(self) -> int:
        self._seed += 1
        return self._seed

    def _validation_inputs(self) -> tuple[torch.Tensor, ...]:
        b, hq, hkv, s = validation_shape(self.problem)
        return random_qkv(b, hq, hkv, s, s, self.problem.head_dim, self.dtype, self.device, self._fresh_seed())

    def _samples(self, fn: Callable[[], object], reps: int) -> list[float]:
        return list(self.timer({"config": lambda _i: fn()}, 1, reps)["config"])

    def _timed(self, fn: Callable[[], object], best: Measurement | None) -> tuple[str, float, list[float]]:
        """Status, median ms and (for a full measurement) the timed calls in seconds."""
        short = statistics.median(self._samples(fn, self.short_reps)) * 1e3
        if best is not None and short > DROP_RATIO * best.ms:
            return "slow", short, []
        samples = self._samples(fn, self.reps)
        return "ok", statistics.median(samples) * 1e3, samples

    # ---- forward ----------------------------------------------------------------------

    def fwd(self, cfg: FwdConfig) -> Measurement:
        if cfg not in self.fwd_results:
            self.fwd_results[cfg] = self._fwd(cfg)
        return self.fwd_results[cfg]

    def _fwd(self, cfg: FwdConfig) -> Measurement:
        why = fwd_invalid(cfg, self.problem, self.arch)
        if why:
            return Measurement("fwd", cfg, "invalid", reason=why)
        causal = self.problem.causal
        try:
            error = math.nan
            if self.validate:
                q, k, v = self._validation_inputs()
                out, _ = flash_fwd(q, k, v, causal, cfg)
                ref = reference_attention(q, k, v, causal=causal)
                error = relative_error(out, ref)
                tol = tolerance(self.dtype)
                if not (error <= tol):
                    return Measurement("fwd", cfg, "numerics", error=error, reason=f"error {error:.3g} > {tol}")
            status, ms, samples = self._timed(lambda: flash_fwd(self.q, self.k, self.v, causal, cfg), self.best_fwd())
        except Exception as exc:  # compile failures (out of resources) of one config
            return Measurement("fwd", cfg, "failed", reason=one_line(exc))
        if status == "ok" and self._good_fwd is None:
            self._good_fwd = cfg
        return Measurement("fwd", cfg, status, ms=ms, error=error, samples_s=samples)

    # ---- backward ---------------------------------------------------------------------

    def _forward_state(self) -> tuple[FwdConfig, torch.Tensor, torch.Tensor]:
        """A validated forward config and the real-size output/lse the backward reads."""
        if self._good_fwd is None:
            self._good_fwd = FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
        if self._o is None:
            self._o, self._lse = flash_fwd(self.q, self.k, self.v, self.problem.causal, self._good_fwd)
        assert self._lse is not None
        return self._good_fwd, self._o, self._lse

    def bwd(self, cfg: BwdConfig) -> Measurement:
        if cfg not in self.bwd_results:
            self.bwd_results[cfg] = self._bwd(cfg)
        return self.bwd_results[cfg]

    def _bwd(self, cfg: BwdConfig) -> Measurement:
        why = bwd_invalid(cfg, self.problem, self.arch)
        if why:
            return Measurement("bwd", cfg, "invalid", reason=why)
        causal = self.problem.causal
        try:
            fwd_cfg, o, lse = self._forward_state()
            error = math.nan
            if self.validate:
                q, k, v = self._validation_inputs()
                pair = AttnConfig(fwd_cfg, cfg)
                report = check_numerics(
                    lambda a, b, c, m: triton_attention(a, b, c, causal=m, config=pair),
                    q, k, v, causal=causal, seed=self._fresh_seed(),
                )
                error = max(report.dq, report.dk, report.dv)
                if not report.ok:
                    return Measurement("bwd", cfg, "numerics", error=error, reason=f"error {report.worst:.3g}")
            status, ms, samples = self._timed(
                lambda: flash_bwd(self.do, self.q, self.k, self.v, o, lse, causal, cfg), self.best_bwd()
            )
        except Exception as exc:
            return Measurement("bwd", cfg, "failed", reason=one_line(exc))
        return Measurement("bwd", cfg, status, ms=ms, error=error, samples_s=samples)


# ---- strategies -----------------------------------------------------------------------


def _result(ev: Evaluator, strategy: str, trials: int) -> SearchResult:
    """The best forward with the best backward config ``ev`` measured, and every measurement."""
    bf, bb = ev.best_fwd(), ev.best_bwd()
    config = AttnConfig(bf.config, bb.config) if bf and bb else None  # type: ignore[arg-type]
    return SearchResult(
        strategy=strategy,
        config=config,
        fwd_ms=bf.ms if bf else math.inf,
        bwd_ms=bb.ms if bb else math.inf,
        trials=trials,
        measured=ev.measured,
        measurements=[*ev.fwd_results.values(), *ev.bwd_results.values()],
    )


def grid_search(ev: Evaluator, space: SearchSpace, progress: Progress | None = None) -> SearchResult:
    """Every forward and every backward config of the space (so every pair)."""
    fwds = space.fwd_configs(ev.problem, ev.arch)
    bwds = space.bwd_configs(ev.problem, ev.arch)
    for part, configs, run in (("fwd", fwds, ev.fwd), ("bwd", bwds, ev.bwd)):
        for cfg in configs:
            run(cfg)
            if progress:
                progress(f"{part} {cfg.label()}")
    return _result(ev, "grid", len(fwds) * len(bwds))


def tpe_search(
    ev: Evaluator,
    space: SearchSpace,
    trials: int,
    *,
    storage: str | Path | None = None,
    study_name: str | None = None,
    seeds: list[AttnConfig] | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    max_measured: int | None = None,
) -> SearchResult:
    """optuna TPE over the forward and the backward configs; objective ``fwd_ms + bwd_ms``.

    The forward and backward kernels are separate, so the sum is separable: its minimum is
    the fastest forward plus the fastest backward. One TPE study per part (objective: that
    part's time), asked in turn, the part with the smaller share of its space measured
    first; a trial costs one measurement, not two as a study over pairs would.

    With ``storage`` (a SQLite file path) the studies are kept on disk and a second call with
    the same ``study_name`` resumes them: finished trials count towards ``trials`` (both
    parts together). ``max_measured`` stops the search once that many distinct configs
    have been measured.
    """
    try:
        import optuna
    except ImportError:  # pragma: no cover - optuna is in the "tune" extra
        from primus_perf.base.errors import UserError

        raise UserError("the tpe strategy needs optuna: pip install 'primus-perf[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = None
    if storage is not None:
        Path(storage).parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{Path(storage).resolve()}"
    base = study_name or ev.problem.key()
    sizes = grid_size(space, ev.problem, ev.arch)
    parts = {}
    for i, (part, axes) in enumerate((("fwd", space.fwd), ("bwd", space.bwd))):
        sampler = optuna.samplers.TPESampler(seed=seed + i, n_startup_trials=max(2, min(8, trials // 8)))
        study = optuna.create_study(study_name=f"{base}:{part}", storage=url, sampler=sampler,
                                    direction="minimize", load_if_exists=True)
        if not study.trials:
            for cfg in seeds or []:
                params = {n: getattr(getattr(cfg, part), n) for n in axes}
                if all(params[n] in axes[n] for n in params):
                    study.enqueue_trial(params)
        parts[part] = (study, axes, sizes[i])

    def finished() -> int:
        return sum(t.state.is_finished() for st, _, _ in parts.values() for t in st.trials)

    def coverage(part: str) -> float:
        results = ev.fwd_results if part == "fwd" else ev.bwd_results
        return sum(m.status != "invalid" for m in results.values()) / max(1, parts[part][2])

    while finished() < trials and (max_measured is None or ev.measured < max_measured):
        part = min(parts, key=coverage)
        study, axes, _ = parts[part]
        trial = study.ask()
        params = {n: trial.suggest_categorical(n, list(v)) for n, v in axes.items()}
        cfg = (FwdConfig if part == "fwd" else BwdConfig)(**{n: int(v) for n, v in params.items()})
        known = cfg in (ev.fwd_results if part == "fwd" else ev.bwd_results)
        if not known and max_measured is not None and ev.measured + 1 > max_measured:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            break
        m = (ev.fwd if part == "fwd" else ev.bwd)(cfg)
        if progress:
            progress(f"tpe {part} {cfg.label()}")
        if m.status in ("ok", "slow"):  # a slow config's short measurement still informs TPE
            study.tell(trial, m.ms)
        else:
            trial.set_user_attr("status", m.status)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    # a resumed study's best was measured in an earlier run: measure it here too
    for part, (study, axes, _) in parts.items():
        done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if done:
            best = min(done, key=lambda t: t.value)
            cfg = (FwdConfig if part == "fwd" else BwdConfig)(**{n: int(best.params[n]) for n in axes})
            (ev.fwd if part == "fwd" else ev.bwd)(cfg)
    if ev.best_fwd() is None or ev.best_bwd() is None:
        return SearchResult("tpe", None, math.inf, math.inf, finished(), ev.measured)
    return _result(ev, "tpe", finished())


def search(
    ev: Evaluator,
    space: SearchSpace,
    *,
    strategy: str = "grid",
    trials: int | None = None,
    storage: str | Path | None = None,
    vendor: str = "nvidia",
    seed: int = 0,
    progress: Progress | None = None,
) -> SearchResult:
    """The ``grid`` or ``tpe`` search of one problem; ``tpe`` defaults to 20% of the grid's
    trials, seeded with the vendor's known-good configs, its study named after the problem
    and the architecture (so that ``storage`` resumes it)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if strategy == "grid":
        return grid_search(ev, space, progress)
    n = trials if trials is not None else default_trials(space, ev.problem, ev.arch)
    return tpe_search(
        ev, space, n, storage=storage, seeds=known_good(vendor, ev.problem.head_dim), seed=seed,
        study_name=f"{ev.problem.key()}|{ev.arch}", progress=progress,
    )


def default_trials(space: SearchSpace, problem: AttentionProblem, arch: str) -> int:
    """TPE trials when none are given: 20% of the grid (forward + backward configs), at least 4."""
    n_f, n_b = grid_size(space, problem, arch)
    return max(4, int(0.2 * (n_f + n_b)))
