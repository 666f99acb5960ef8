"""Search logic of the attention tuner on the CPU (Triton interpreter, tiny problems)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; GPU runs set 0

import math

import pytest

pytest.importorskip("triton")

from primus_perf.kernels.attention.configs import AttnConfig, BwdConfig, FwdConfig, fwd_invalid
from primus_perf.problems import AttentionProblem
from primus_perf.tuner import measure
from primus_perf.tuner.attention import search
from primus_perf.tuner.attention.search import Evaluator, grid_search, tpe_search
from primus_perf.tuner.attention.space import SearchSpace, default_space, tiny_space

PROBLEM = AttentionProblem(1, 2, 1, 64, 64, 16, "f16", True)

# A space whose best is clear on the interpreter: bigger blocks mean far fewer programs.
SPACE = SearchSpace(
    fwd={"block_m": (16, 64), "block_n": (16, 64), "num_warps": (4,), "num_stages": (1,)},
    bwd={
        "block_m1": (16,),
        "block_n1": (16, 64),
        "block_m2": (16, 64),
        "block_n2": (16,),
        "num_warps": (4,),
        "num_stages": (1,),
    },
)


def _evaluator(seed: int = 0) -> Evaluator:
    return Evaluator(PROBLEM, arch="cpu", device="cpu", reps=3, short_reps=2, seed=seed)


def test_grid_measures_every_config_and_picks_the_fastest() -> None:
    ev = _evaluator()
    res = grid_search(ev, SPACE)
    assert res.measured == 8  # 4 forward + 4 backward configs
    assert res.trials == 16  # pairs covered
    assert all(m.status in ("ok", "slow") for m in res.measurements)
    assert all(m.error < 5e-3 for m in res.measurements)  # every config validated vs fp32
    # the fastest measured of each part is chosen (which one is fastest is the interpreter's
    # timing on a loaded 2-core machine: (64, 64) and (64, 16) forward tiles swap there)
    best_f = min((m for m in res.measurements if m.part == "fwd" and m.ok), key=lambda m: m.ms)
    best_b = min((m for m in res.measurements if m.part == "bwd" and m.ok), key=lambda m: m.ms)
    assert res.config is not None and res.config.fwd == best_f.config and res.config.bwd == best_b.config


def _program_count_timer(monkeypatch) -> measure.Timer:
    """A timer whose time is the timed config's program count (fewer, bigger blocks: faster):
    the search's logic is tested, not the load of the machine the interpreter runs on."""
    timed: list = []
    for name in ("flash_fwd", "flash_bwd"):
        real = getattr(search, name)
        monkeypatch.setattr(search, name, lambda *a, _real=real: (timed.append(a[-1]), _real(*a))[1])

    def cost() -> float:
        cfg = timed[-1]
        return 1e-3 / math.prod(getattr(cfg, f) for f in ("block_m", "block_n", "block_m1", "block_n1",
                                                             "block_m2", "block_n2") if hasattr(cfg, f))

    def timer(calls, n_sets, reps, seed=0):
        return {name: [(fn(i), cost())[1] for i in range(reps)] for name, fn in calls.items()}

    return timer


def test_tpe_finds_the_grid_best_and_resumes_from_sqlite(tmp_path, monkeypatch) -> None:
    timer = _program_count_timer(monkeypatch)
    grid = grid_search(Evaluator(PROBLEM, arch="cpu", device="cpu", reps=3, short_reps=2, timer=timer), SPACE)
    db = tmp_path / "studies.db"
    first = tpe_search(Evaluator(PROBLEM, arch="cpu", device="cpu", reps=3, short_reps=2, seed=1, timer=timer),
                       SPACE, trials=5, storage=db, seed=0)
    assert first.trials == 5
    res = tpe_search(Evaluator(PROBLEM, arch="cpu", device="cpu", reps=3, short_reps=2, seed=2, timer=timer),
                     SPACE, trials=14, storage=db, seed=0)
    assert res.trials == 14  # resumed: the first 5 trials were kept
    assert grid.config == AttnConfig(FwdConfig(64, 64, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1))
    assert res.config == grid.config


def test_tpe_stops_at_the_measurement_budget() -> None:
    seeds = [AttnConfig(FwdConfig(64, 64, 4, 1), BwdConfig(16, 64, 64, 16, 4, 1))]
    res = tpe_search(_evaluator(), SPACE, trials=50, seeds=seeds, max_measured=3)
    assert res.measured <= 3
    assert res.config == seeds[0]  # the seed is tried first


def test_invalid_configs_are_pruned_before_launch() -> None:
    p = AttentionProblem(1, 8, 8, 4096, 4096, 256, "bf16", True)
    assert fwd_invalid(FwdConfig(128, 128, 8, 4), p, "sm_90") == "shared memory"
    assert fwd_invalid(FwdConfig(128, 128, 4, 2), p, "sm_90") == "registers"
    assert fwd_invalid(FwdConfig(64, 32, 4, 2), p, "sm_90") is None
    small = AttentionProblem(1, 2, 2, 20, 20, 64, "bf16", True)
    assert fwd_invalid(FwdConfig(128, 64, 4, 2), small, "sm_90") is not None
    ev = Evaluator(small, arch="sm_90", device="cpu", validate=False)
    m = ev.fwd(FwdConfig(128, 64, 4, 2))
    assert m.status == "invalid" and ev.measured == 0
    # every config of the GPU spaces fits the H100's shared memory
    for d in (64, 128):
        prob = AttentionProblem(4, 32, 32, 4096, 4096, d, "bf16", True)
        space = default_space("nvidia", d)
        assert 10 <= len(space.fwd_configs(prob, "sm_90")) <= len(list(_product_size(space.fwd)))


def _product_size(axes: dict) -> range:
    return range(math.prod(len(v) for v in axes.values()))


def test_rocm_space_carries_vendor_options() -> None:
    space = default_space("amd", 128)
    assert "waves_per_eu" in space.fwd and "matrix_instr_nonkdim" in space.bwd
    assert "waves_per_eu" not in default_space("nvidia", 128).fwd
    assert len(tiny_space().fwd_configs(PROBLEM, "cpu")) == 4


def test_the_search_times_on_the_sessions_inputs(monkeypatch) -> None:
    """A tuning session's Triton search measures on the session's own real-size inputs (no
    second set), and the leaves its backward timing differentiates share their storage."""
    from primus_perf.tuner import measure
    from primus_perf.tuner.attention import search
    from primus_perf.tuner.attention.plugin import AttentionTuner

    made: list[Evaluator] = []

    class Recorded(Evaluator):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(search, "Evaluator", Recorded)
    one_pair = SearchSpace(fwd={"block_m": (16,), "block_n": (16,), "num_warps": (4,), "num_stages": (1,)},
                           bwd={"block_m1": (16,), "block_n1": (16,), "block_m2": (16,), "block_n2": (16,),
                                "num_warps": (4,), "num_stages": (1,)})
    tuner = AttentionTuner(strategy="grid", space=one_pair, backends=(), device="cpu")
    session = tuner.open(PROBLEM, measure.time_cpu, lambda _label: None)
    try:
        pool = session.candidates()
        (ev,) = made
        assert all(a is b for a, b in zip((ev.q, ev.k, ev.v, ev.do), (session.q, session.k, session.v, session.do)))
        assert [t.data_ptr() for t in session.grad_inputs] == [t.data_ptr() for t in (session.q, session.k, session.v)]
        assert [c.name for c in pool] == ["sdpa:default", "triton"]
        assert session.details["search"]["measured"] == 2
        triton = pool[1]
        assert session.error(triton) <= session.tolerance
        calls = session.calls(triton)
        calls["fwd"](0)
        calls["bwd"](0)
    finally:
        session.close()


def test_the_core_does_not_validate_or_rough_time_the_searched_candidate_again(monkeypatch) -> None:
    """The search checked and timed the found configs on this problem: the core takes its
    error and timed calls, and runs only the other candidates against the reference and in
    the rough pass."""
    from primus_perf.tuner import core, measure
    from primus_perf.tuner.attention import plugin

    one_pair = SearchSpace(fwd={"block_m": (16,), "block_n": (16,), "num_warps": (4,), "num_stages": (1,)},
                           bwd={"block_m1": (16,), "block_n1": (16,), "block_m2": (16,), "block_n2": (16,),
                                "num_warps": (4,), "num_stages": (1,)})
    checked: list[str] = []
    real_error = plugin.AttentionSession.error
    monkeypatch.setattr(plugin.AttentionSession, "error", lambda self, c: checked.append(c.name) or real_error(self, c))
    passes: list[set[str]] = []

    def timer(calls, n_sets, reps, seed=0):
        passes.append({key[0] if isinstance(key, tuple) else "search" for key in calls})
        return measure.time_cpu(calls, n_sets, reps, seed)

    tuner = plugin.AttentionTuner(strategy="grid", space=one_pair, backends=(), device="cpu")
    tuner.reps = core.Reps(rough=2, final_min=2, final_max=2)
    res = core.tune_problem(tuner, PROBLEM, timer=timer, budget_s=0.1)
    stats = {c.name: c for c in res.candidates}
    assert checked == ["sdpa:default"]  # the search's check stands for the Triton candidate's
    assert stats["triton"].error is not None and stats["triton"].error <= 5e-3
    # the search's own timed calls, then the core's rough pass without the Triton candidate
    # (its rough figures are the search's), which drops it: the interpreter is far slower
    # than torch's CPU kernels; the final pass races the rest
    assert set().union(*passes[:-2]) == {"search"}
    assert passes[-2] == passes[-1] == {"sdpa:default"}
    assert stats["triton"].status == "dropped" and set(stats["triton"].parts) == {"fwd", "bwd"}


def test_backend_race_times_what_runs_and_reports_what_cannot(tmp_path) -> None:
    """The attention kind through the real core on the CPU: wall-clock timing, SDPA
    backends that cannot run are rejected with a reason, the rest raced forward + backward."""
    from primus_perf.tuner import core, measure
    from primus_perf.tuner.attention.plugin import AttentionTuner, triton_candidate

    prob = AttentionProblem(1, 4, 2, 48, 48, 16, "f16", True)
    cfg = AttnConfig(FwdConfig(16, 16, 4, 1), BwdConfig(16, 16, 16, 16, 4, 1))
    tuner = AttentionTuner(strategy=None, backends=("flash", "cudnn"), extra=[triton_candidate(cfg)], device="cpu")
    tuner.reps = core.Reps(rough=2, final_min=2, final_max=2)
    res = core.tune_problem(tuner, prob, timer=measure.time_cpu)
    stats = {c.name: c for c in res.candidates}
    assert set(stats) == {"sdpa:default", "sdpa:flash", "sdpa:cudnn", "triton"}
    assert stats["sdpa:cudnn"].status == "rejected" and stats["sdpa:cudnn"].reason  # no cuDNN on CPU
    assert stats["sdpa:default"].status in ("measured", "chosen")
    for n in ("sdpa:default", "sdpa:flash", "triton"):
        c = stats[n]
        assert set(c.parts) == {"fwd", "bwd"} and c.error is not None and c.error < 5e-3
        assert 0 < c.parts["fwd"]["median_s"] < math.inf and 0 < c.parts["bwd"]["median_s"] < math.inf
    # the interpreter is orders of magnitude slower than torch's CPU kernels
    assert stats["triton"].status == "dropped"
    assert res.chosen in ("sdpa:default", "sdpa:flash")
    assert res.entry.kind == "attention" and res.entry.solution["config"]["backend"] == res.chosen
