"""Confirmation of cached choices inside real steps, on the CPU with the host clock: a
choice that does extra work is dropped and its cache entry corrected to the baseline, a
choice whose baseline does extra work is kept, `primus-tune confirm` on the tiny MoE preset
writes in-step figures, and `primus-tune cache show` says how each speedup was measured."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from enable_fakes import slow_backward_kinds
from primus_perf.base.devices import current_device
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.cli.tune import app
from primus_perf.kernels.gemm import GemmRouter, problem_of, torch_mm
from primus_perf.kernels.grouped.backends import BACKENDS, Backend
from primus_perf.kernels.grouped.passes import problem_of as grouped_problem_of
from primus_perf.kernels.grouped.passes import run_backend, shape_problem_of
from primus_perf.kernels.grouped.router import (
    BY_SKEW,
    GroupedChoice,
    GroupedGemmRouter,
    library_versions,
)
from primus_perf.kinds import RouterPart
from primus_perf.problems import AttentionProblem
from primus_perf.runtime import dispatch
from primus_perf.runtime.grouped import GroupedDispatch
from primus_perf.tuner.confirm import Confirmer, ConfirmPolicy, confirm_run
from primus_perf.tuner.decide import DROPPED, KEPT, Verdict
from primus_perf.tuner.measure import HostClock, Sample

REPEAT = 16  # the extra work of the slow side: the same product this many times
VERSIONS = {"fakeblas": "1.0"}
POLICY = ConfirmPolicy(samples=12, warmup=2)  # the host clock on a busy 2-core machine: more pairs


class RepeatedKernel:
    """A "tuned" GEMM that computes the product ``REPEAT`` times: really slower."""

    def __call__(self, a, b):
        for _ in range(REPEAT - 1):
            torch_mm(a, b)
        return torch_mm(a, b)

    def close(self) -> None:
        pass


SLOW_KINDS = {"gemm": RouterPart(
    lambda es: GemmRouter.from_entries(list(es), {"slowblas": lambda p, s, d: RepeatedKernel()}),
    lambda: dict(VERSIONS))}


def _entry(kind: str, problem, solution: dict, versions: dict, **extra) -> CacheEntry:
    return CacheEntry(kind=kind, problem_key=problem.key(), problem=problem.to_dict(),
                      device=current_device().to_dict(), versions=dict(versions), solution=solution,
                      times={"tuned_ms": 1.0, "default_ms": 2.0}, tuner_version="test", **extra)


def test_abba_order_warmup_and_verdict_margin() -> None:
    clock = HostClock()
    policy = ConfirmPolicy(samples=4, warmup=1, margin=0.01)
    state = policy.pairs(clock)
    sides = []
    for _ in range(10):
        side = state.next_side()
        sides.append(side)
        state.add(side, Sample([(0.0, 1.0 if side == "baseline" else 0.5)]))  # choice 2x faster
    state.poll()
    assert sides[:8] == ["choice", "baseline", "baseline", "choice"] * 2
    assert state.ready() and len(state.counted()) == 4  # pair 0 is the warm-up
    v = state.verdict(policy.rule(), kind="gemm", key="k", choice="heur2", baseline="torch")
    assert v.status == KEPT and v.speedup == pytest.approx(2.0) and v.pairs == 4
    # equal times: inside the margin, the baseline stays
    policy = ConfirmPolicy(samples=4, warmup=0)
    same = policy.pairs(clock)
    for _ in range(8):
        same.add(same.next_side(), Sample([(0.0, 1.0)]))
    same.poll()
    v = same.verdict(policy.rule(), kind="gemm", key="k", choice="heur2", baseline="torch")
    assert v.status == DROPPED and v.speedup == pytest.approx(1.0)
    assert "heur2 not confirmed in the step (1.000x [1.000-1.000], 8 calls" in v.text()


def test_a_slow_choice_is_dropped_and_its_entry_corrected(tmp_path: Path) -> None:
    a, b = torch.randn(96, 128), torch.randn(128, 96)
    cache = tmp_path / "cache.json"
    slow = {"config": {"name": "slow", "source": "slowblas"}, "blob": b""}
    TuningCache(cache).put(_entry("gemm", problem_of(a, b), slow, VERSIONS))

    def run(confirmer) -> int:
        for _ in range(60):
            torch.testing.assert_close(torch.mm(a, b), a @ b)  # the aten override: the GEMM dispatch
        return 0

    out = confirm_run(cache, run, policy=POLICY, clock=HostClock(), kinds_=("gemm",), device_type="cpu",
                      router_kinds=SLOW_KINDS)
    (row,) = out.rows
    v = row.verdict
    assert v.status == DROPPED and v.speedup < 0.5, v.text()
    assert v.baseline == "torch" and v.choice == "slow" and v.pairs >= 12 and v.low <= v.speedup <= v.high
    (e,) = TuningCache(cache).entries()
    assert e.solution["config"] == {"name": "torch", "source": "torch"}  # not routed from now on
    assert e.times == {"tuned_ms": 1.0, "default_ms": 2.0}  # the isolated claim, kept as such
    assert e.in_step["verdict"] == "dropped" and e.in_step["choice"] == "slow" and "host clock" in e.in_step["method"]
    assert e.claim().startswith("torch kept: slow 0.") and e.claim().endswith("(isolated 2.000x)")
    # the corrected cache routes nothing: a GEMM router of torch's own choices is not installed
    assert GemmRouter.from_entries([e], {}).idle()


def _repeated(backend: Backend, name: str) -> Backend:
    """``backend`` doing its work ``REPEAT`` times: really slower."""

    def repeat(fn):
        def run(*args):
            for _ in range(REPEAT - 1):
                fn(*args)
            return fn(*args)
        return run

    return Backend(name, repeat(backend.mm), repeat(backend.wgrad), backend.unsupported)


def test_a_real_winner_over_the_callers_fallback_is_kept(tmp_path: Path, monkeypatch) -> None:
    """The trainer's MoE call (``trainer.moe.grouped_mm``) with the grouped dispatch's backend
    set by its caller to one doing the work REPEAT times: the cached loop is kept."""
    from primus_perf.trainer.moe import grouped_mm

    torch.manual_seed(0)
    counts = [40, 8, 0, 16]
    x, w = torch.randn(sum(counts), 64), torch.randn(len(counts), 64, 48)
    problem = grouped_problem_of("fwd", x, w, counts)
    cache = tmp_path / "cache.json"
    choice = GroupedChoice("loop")
    TuningCache(cache).put(_entry("grouped_gemm", problem, {"config": {"name": "loop", **choice.to_solution()},
                                                            "blob": b""}, library_versions()))
    monkeypatch.setitem(BACKENDS, "slow_loop", _repeated(BACKENDS["loop"], "slow_loop"))  # the caller's backend
    ref = run_backend(BACKENDS["loop"], "fwd", x, w, counts)
    grouped = dispatch.of("grouped_gemm")

    def run(confirmer) -> int:
        grouped.set_backend("slow_loop")  # as the Trainer sets its configured backend
        try:
            for _ in range(60):
                torch.testing.assert_close(grouped_mm(x, w, counts), ref)
        finally:
            grouped.set_backend("grouped_mm")
        return 0

    out = confirm_run(cache, run, policy=POLICY, clock=HostClock(), kinds_=("grouped_gemm",), device_type="cpu")
    (row,) = out.rows
    assert row.verdict.status == KEPT and row.verdict.speedup > 2, row.verdict.text()
    assert row.verdict.baseline == "slow_loop"
    (e,) = TuningCache(cache).entries()
    assert e.solution["config"]["backend"] == "loop" and e.in_step["verdict"] == "kept"
    assert e.claim().startswith(f"{e.in_step['speedup']:.3f}x slow_loop in the step [")


_COUNTS = [40, 8, 0, 16]
_X, _W = torch.randn(sum(_COUNTS), 64), torch.randn(len(_COUNTS), 64, 48)
_SHAPE = shape_problem_of("fwd", _X, _W, len(_COUNTS)).key()


class _VirtualClock(HostClock):
    """Time that passes only by the work a call says it did (:func:`_tick`): verdicts that
    do not depend on the machine's load."""

    t = 0.0

    def mark(self) -> float:
        return _VirtualClock.t


def _tick(times: int) -> None:
    _VirtualClock.t += times * 1e-3


class _TimedRouter(GroupedGemmRouter):
    """The grouped router over ``choices``, each choice's kernel taking ``units`` of virtual time."""

    units = 1

    def implementation(self, choice: GroupedChoice) -> Backend:
        real = super().implementation(choice)

        def timed(fn):
            def run(*args):
                _tick(self.units)
                return fn(*args)
            return run

        return Backend(real.name, timed(real.mm), timed(real.wgrad), real.unsupported,
                       None if real.mm_offs is None else timed(real.mm_offs),
                       None if real.wgrad_offs is None else timed(real.wgrad_offs))


class _TorchKernel:
    """torch's ``_grouped_mm`` kernel as the override receives it, taking ``units`` of virtual time."""

    def __init__(self, units: int) -> None:
        self.units = units

    def call_boxed(self, keyset, a, b, offs, bias, out_dtype):
        _tick(self.units)
        return torch._grouped_mm(a, b, offs=offs)


def _offs(counts) -> torch.Tensor:
    """A program's ``offs`` for ``counts``: a new tensor each call, its counts not known on the host."""
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _confirm_grouped(choices: dict, choice_units: int, torch_units: int, calls) -> tuple[Verdict, GroupedDispatch]:
    """``calls`` (lists of counts) of the shape through the grouped dispatch's one path (its
    ``aten::_grouped_mm`` override's body), its router over ``choices`` (counts -> backend),
    a confirmation interposed; the baseline is torch's kernel. Each answer is checked; the
    shape's verdict, and the dispatch."""
    router = _TimedRouter({grouped_problem_of("fwd", _X, _W, c).key(): GroupedChoice(b) for c, b in choices.items()})
    router.units = choice_units
    owner = GroupedDispatch("grouped_gemm")  # a dispatch of its own: no override installed, nothing global
    owner.install(router)
    confirmer = Confirmer(POLICY, _VirtualClock())
    owner.interpose(confirmer)
    kernel = _TorchKernel(torch_units)
    for counts in calls:
        ref = run_backend(BACKENDS["loop"], "fwd", _X, _W, counts)
        torch.testing.assert_close(owner.call(kernel, None, _X, _W, _offs(counts)), ref)
    (v,) = confirmer.finish()
    return v, owner


def test_a_grouped_choice_that_reads_device_offs_on_the_host_is_dropped_though_it_wins() -> None:
    """Where a program's ``offs`` are on the device, a choice that reads them on the host
    (the loop, the padded bmm) makes the program's host wait for the device: a cost the
    call's own timing does not see, so it is dropped even where its calls win."""
    from primus_perf.tuner.confirm import WAITED

    # the loop, 1 unit a call, against torch's kernel taking REPEAT: it wins its calls
    v, _ = _confirm_grouped({tuple(_COUNTS): "loop"}, 1, REPEAT, [_COUNTS] * 60)
    assert v.key == _SHAPE and v.choice == "loop" and v.baseline == "grouped_mm"
    assert v.status == DROPPED and v.speedup > 2 and v.reason == WAITED, v.text()
    assert "reads the call's offs on the host" in v.text()


def test_a_shape_whose_entries_differ_by_skew_is_confirmed_as_one() -> None:
    """The router's answer for a shape of choices by skew bucket, whichever bucket each call
    falls in, against the baseline: slower, it is dropped (every entry of the shape)."""
    skewed, balanced, other = [40, 8, 0, 16], [16, 16, 16, 16], [64, 0, 0, 0]
    keys = {grouped_problem_of("fwd", _X, _W, c).key() for c in (skewed, balanced, other)}
    assert len(keys) == 3  # three skew buckets of one shape
    choices = {tuple(skewed): "loop", tuple(balanced): "padded_bmm"}
    # every third call in a skew bucket with no entry: torch's kernel runs it
    calls = [skewed, balanced, other] * 20
    v, owner = _confirm_grouped(choices, REPEAT, 1, calls)
    assert v.status == DROPPED and v.choice == BY_SKEW and v.key == _SHAPE and v.speedup < 0.5, v.text()
    entries = {grouped_problem_of("fwd", _X, _W, c).key() for c in (skewed, balanced)}
    assert set(owner.entry_keys(v.key)) == entries  # the verdict is written to every entry of the shape
    # faster, it is kept, though each call site's first call reads its counts to pick the
    # bucket (here every call: a model of many layers), which is no wait the backend makes
    v, _ = _confirm_grouped(choices, 1, REPEAT, calls)
    assert v.status == KEPT and v.choice == BY_SKEW and v.key == _SHAPE and not v.reason, v.text()


@contextlib.contextmanager
def _gemm_dispatch(router, confirmer):
    """The GEMM dispatch routing to ``router`` with ``confirmer`` interposed (no override
    held: its Python route is called directly), put back as it was after."""
    gemm = dispatch.of("gemm")
    assert gemm.router is None and gemm.interposer is None
    gemm.reset()
    gemm.install(router)
    gemm.interpose(confirmer)
    try:
        yield gemm
    finally:
        gemm.interpose(None)
        gemm.install(None)
        gemm.reset()


def test_no_device_sync_and_events_read_only_when_complete() -> None:
    """Marks are read only once complete; nothing waits before finish()."""

    class LazyClock(HostClock):
        def __init__(self) -> None:
            self.ready = False
            self.settled = 0

        def elapsed(self, start, end):
            return (end - start) if self.ready else None

        def settle(self) -> None:
            self.settled += 1
            self.ready = True

    clock = LazyClock()
    confirmer = Confirmer(ConfirmPolicy(samples=2, warmup=0), clock)
    router = GemmRouter.from_entries([_entry("gemm", problem_of(torch.randn(8, 16), torch.randn(16, 8)),
                                             {"config": {"name": "slow", "source": "slowblas"}, "blob": b""},
                                             VERSIONS)], {"slowblas": lambda p, s, d: RepeatedKernel()})
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    with _gemm_dispatch(router, confirmer) as gemm:
        for _ in range(10):
            torch.testing.assert_close(gemm.gemm(a, b), a @ b)
    assert clock.settled == 0 and confirmer.confirming == 1 and not confirmer.verdicts
    (v,) = confirmer.finish()
    assert clock.settled == 1 and v.status in (KEPT, DROPPED) and v.pairs == 5


@pytest.fixture(scope="module")
def moe_cache(tmp_path_factory) -> Path:
    """A cache for the tiny MoE preset's grouped problems (2 layers, small batch): the
    padded-bmm backend for each, as a tuner might have chosen it from isolated timings."""
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.grouped_problems import record_grouped_problems

    cfg = load_config("tiny-moe", MOE_OVERRIDES)
    found = record_grouped_problems(cfg, steps=STEPS)  # every token-skew bucket the steps visit
    choice = GroupedChoice("padded_bmm")
    path = tmp_path_factory.mktemp("confirm") / "cache.json"
    TuningCache(path).put_many(_entry("grouped_gemm", p, {"config": {"name": "padded_bmm", **choice.to_solution()},
                                                          "blob": b""}, library_versions()) for p, _ in found)
    return path


MOE_OVERRIDES = ["model.n_layers=2", "train.micro_batch=2", "train.seq_len=64"]
STEPS = 12


def test_cli_confirm_on_the_tiny_moe_preset_writes_in_step_figures(moe_cache: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    cache.write_bytes(moe_cache.read_bytes())
    res = CliRunner().invoke(app, ["confirm", "--cache", str(cache), "--config", "tiny-moe", "--steps", str(STEPS),
                                   "--samples", "2", "--warmup", "0", *MOE_OVERRIDES], terminal_width=300)
    assert res.exit_code == 0, res.output
    assert "in the step [q1-q3]" in res.output and "confirmed in the step:" in res.output
    # the problems of the token-skew bucket most steps visit have their verdicts (rarer
    # buckets may stay unconfirmed: too few calls in a short run)
    entries = [e for e in TuningCache(cache).entries() if e.in_step is not None]
    assert len(entries) >= 3, res.output
    for e in entries:
        s = e.in_step
        assert s["verdict"] in ("kept", "dropped") and s["baseline"] == "loop" and s["samples"] >= 2
        assert s["low"] <= s["speedup"] <= s["high"] and "host clock" in s["method"]
        if s["verdict"] == "dropped":  # the caller's backend from now on
            assert e.solution["config"]["backend"] == "loop"
    raw = json.loads(cache.read_text())["entries"]
    assert sum(r.get("in_step") is not None for r in raw) == len(entries)


def test_cache_show_says_how_each_speedup_was_measured(tmp_path: Path) -> None:
    p = problem_of(torch.randn(8, 16), torch.randn(16, 8))
    q = problem_of(torch.randn(8, 16), torch.randn(16, 12))
    r = problem_of(torch.randn(8, 16), torch.randn(16, 20))
    heur = {"config": {"name": "heur2", "source": "cublaslt"}, "blob": b"x"}
    torch_sol = {"config": {"name": "torch", "source": "torch"}, "blob": b""}
    figure = {"method": "in the step", "baseline": "torch", "choice": "heur2", "speedup": 1.031, "low": 1.012,
              "high": 1.049, "samples": 8}
    cache = tmp_path / "c.json"
    TuningCache(cache).put_many([
        _entry("gemm", p, heur, VERSIONS),
        _entry("gemm", q, heur, VERSIONS, in_step={**figure, "verdict": "kept"}),
        _entry("gemm", r, torch_sol, VERSIONS, in_step={**figure, "verdict": "dropped", "speedup": 0.99,
                                                        "low": 0.97, "high": 1.01}),
    ])
    online = _entry("gemm", problem_of(torch.randn(4, 16), torch.randn(16, 8)), heur, VERSIONS)
    online.tuner_version = "gemm-1+online"
    TuningCache(cache).put(online)
    res = CliRunner().invoke(app, ["cache", "show", str(cache)], terminal_width=400)
    assert res.exit_code == 0, res.output
    assert "speedup (how measured)" in res.output
    assert "2.000x isolated" in res.output and "2.000x online samples" in res.output
    assert "1.031x torch in the step [1.012-1.049], 16 calls (isolated 2.000x)" in res.output
    assert "torch kept: heur2 0.990x in the step [0.970-1.010], 16 calls (isolated 2.000x)" in res.output


@pytest.mark.gpu
def test_on_the_gpu_device_events_drop_a_slow_choice_and_keep_a_fast_one(monkeypatch) -> None:
    """CUDA events recorded on the current stream, read when complete: a GEMM choice doing
    16x the work is dropped; a grouped choice over a fallback doing 16x the work is kept."""
    from primus_perf.kernels.grouped.offsets import known_counts
    from primus_perf.tuner.measure import DeviceClock

    dev = "cuda"
    a, b = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16), torch.randn(2048, 2048, device=dev,
                                                                                   dtype=torch.bfloat16)
    confirmer = Confirmer(ConfirmPolicy(samples=8, warmup=2), DeviceClock())
    router = GemmRouter.from_entries([_entry("gemm", problem_of(a, b), {"config": {"name": "slow", "source": "slowblas"},
                                                                        "blob": b""}, VERSIONS)],
                                     {"slowblas": lambda p, s, d: RepeatedKernel()})
    counts = [512, 64, 0, 448]
    x, w = torch.randn(sum(counts), 1024, device=dev, dtype=torch.bfloat16), \
        torch.randn(len(counts), 1024, 1024, device=dev, dtype=torch.bfloat16)
    # the caller's backend doing the work 16 times; the cached loop for the shape
    monkeypatch.setitem(BACKENDS, "slow_loop", _repeated(BACKENDS["loop"], "slow_loop"))
    grouped = GroupedDispatch("grouped_gemm")  # a dispatch of its own: no override installed, nothing global
    grouped.set_backend("slow_loop")
    grouped.install(GroupedGemmRouter({grouped_problem_of("fwd", x, w, counts).key(): GroupedChoice("loop")}))
    grouped.interpose(confirmer)
    with _gemm_dispatch(router, confirmer) as gemm:
        for _ in range(30):
            gemm.gemm(a, b)
            # the trainer's offs: their host counts known, so the loop waits for no device read
            offs = known_counts(torch.tensor(counts, device=dev).cumsum(0).to(torch.int32), counts)
            grouped.call(_TorchKernel(0), None, x, w, offs)
    verdicts = {v.kind: v for v in confirmer.finish()}
    assert verdicts["gemm"].status == DROPPED and verdicts["gemm"].speedup < 0.2, verdicts["gemm"].text()
    assert verdicts["grouped_gemm"].status == KEPT and verdicts["grouped_gemm"].speedup > 5, \
        verdicts["grouped_gemm"].text()
    assert verdicts["grouped_gemm"].baseline == "slow_loop"
    assert "device events" in verdicts["gemm"].method


def test_an_entry_with_a_malformed_in_step_figure_is_skipped_and_named(tmp_path: Path) -> None:
    p = problem_of(torch.randn(8, 16), torch.randn(16, 8))
    good = _entry("gemm", p, {"config": {"name": "torch", "source": "torch"}, "blob": b""}, VERSIONS,
                  in_step={"speedup": 1.0, "verdict": "dropped"})
    bad = {**good.to_dict(), "problem_key": "other", "in_step": {"speedup": "fast"}}
    (tmp_path / "c.json").write_text(json.dumps({"schema": 1, "entries": [good.to_dict(), bad]}))
    notes: list[str] = []
    entries = TuningCache(tmp_path / "c.json", report_stale=notes.append).entries()
    assert [e.problem_key for e in entries] == [p.key()] and entries[0].in_step["verdict"] == "dropped"
    assert len(notes) == 1 and "in_step.speedup must be a number" in notes[0]


SCRIPT = """
import torch

counts = [40, 8, 0, 16]
x, w = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(4, 32, 24, dtype=torch.bfloat16)
offs = torch.tensor(counts).cumsum(0).to(torch.int32)
for _ in range(30):
    torch._grouped_mm(x, w, offs=offs)
"""


def test_cli_confirm_of_a_program_times_its_grouped_mm_calls_against_torchs_kernel(tmp_path: Path) -> None:
    from primus_perf.problems import grouped_mm_call

    script = tmp_path / "prog.py"
    script.write_text(SCRIPT)
    counts = [40, 8, 0, 16]
    call = grouped_mm_call((64, 32), (32, 1), (4, 32, 24), (768, 24, 1), len(counts), False)
    problem = call.problem("bf16", counts)
    choice = GroupedChoice("padded_bmm")
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(_entry("grouped_gemm", problem, {"config": {"name": "padded_bmm", **choice.to_solution()},
                                                           "blob": b""}, library_versions()))
    res = CliRunner().invoke(app, ["confirm", "--cache", str(cache), "--samples", "4", "--", str(script)],
                             terminal_width=300)
    assert res.exit_code == 0, res.output
    (e,) = TuningCache(cache).entries()
    assert e.in_step is not None and e.in_step["baseline"] == "grouped_mm", res.output  # torch's own kernel
    # the padded bmm reads the program's offs on the host: dropped whatever its calls' times
    assert e.in_step["verdict"] == "dropped" and e.in_step["samples"] >= 4
    assert e.solution["config"]["backend"] == "grouped_mm"


def test_cli_confirm_without_a_run_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(_entry("gemm", problem_of(torch.randn(8, 16), torch.randn(16, 8)),
                                  {"config": {"name": "torch", "source": "torch"}, "blob": b""}, VERSIONS))
    from primus_perf.cli.common import run_app

    with pytest.raises(SystemExit) as exc:
        run_app(app, ["confirm", "--cache", str(cache)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "needs a run" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _kept(key: str, saving_ms: float) -> Verdict:
    return Verdict("gemm", key, "heur1", "torch", KEPT, 1.05, 1.04, 1.06, 8, 1.0 - saving_ms, 1.0, 0.01, "test")


def test_kept_gemm_choices_must_pay_for_routing_every_gemm_call() -> None:
    """Routing GEMMs costs every GEMM call of the program a few microseconds of host time:
    kept choices whose saving over the run is smaller are dropped together, with the
    reason; a saving larger than the cost keeps them."""
    confirmer = Confirmer(ConfirmPolicy(), HostClock())
    confirmer.verdicts = {("gemm", "k1"): _kept("k1", 0.0127), ("gemm", "k2"): _kept("k2", 0.002)}
    confirmer.slot_calls = {("gemm", "k1"): 320, ("gemm", "k2"): 40}
    calls = {"gemm": 3600}  # 90 GEMMs a step, 40 steps; the kept ones saved 4.14 ms
    out = {v.key: v for v in confirmer.routing_pays({"gemm": 5.0}, calls)}  # 3600 x 5 us = 18 ms of routing
    assert {v.status for v in out.values()} == {DROPPED}
    assert "the 2 kept gemm choice(s) saved 4.14 ms over the run" in out["k1"].reason
    assert "less than routing its 3600 calls costs (5.0 us each: 18.00 ms)" in out["k1"].reason
    assert out["k1"].text().startswith("heur1: 1.050x [1.040-1.060], 16 calls in the step, but the 2 kept")
    assert out["k1"].figure()["reason"] == out["k1"].reason
    confirmer.verdicts = {("gemm", "k1"): _kept("k1", 0.0127)}
    assert confirmer.routing_pays({"gemm": 1.0}, calls)[0].status == KEPT  # 4.06 ms saved > 3.6 ms of routing
    assert "reason" not in confirmer.routing_pays({"gemm": 1.0}, calls)[0].figure()
    # another kind's routing cost does not touch the GEMM choices
    assert confirmer.routing_pays({"grouped_gemm": 5.0}, {"grouped_gemm": 3600})[0].status == KEPT


def test_routing_cost_is_measured_on_the_path_against_torchs_kernel() -> None:
    from primus_perf.tuner.measure import host_cost_us

    def twice(a, b):  # a path that costs one more GEMM than torch's
        torch_mm(a, b)
        return torch_mm(a, b)

    assert host_cost_us(torch_mm, torch_mm, torch.device("cpu"), calls=300) < host_cost_us(
        twice, torch_mm, torch.device("cpu"), calls=300)
    # a GEMM's routing is priced on torch.mm (through the overrides in place) against torch's kernel
    assert dispatch.of("gemm").cost_probe() == (torch.mm, torch_mm)


def test_a_dropped_grouped_choice_is_corrected_to_the_callers_backend_even_triton() -> None:
    """The trainer's Triton default (the fixed backend for many experts) is a backend with a
    config: a choice that loses to it is rewritten to its default config, not left in place."""
    from primus_perf.kernels.grouped.configs import GroupedGemmConfig
    from primus_perf.problems import GroupedGemmProblem
    from primus_perf.tuner.core import confirmed_entry

    baseline_solution = dispatch.of("grouped_gemm").baseline_solution  # what a confirmation writes

    sol = baseline_solution("triton")
    assert GroupedChoice.from_solution(sol["config"]) == GroupedChoice("triton", GroupedGemmConfig())
    assert GroupedChoice.from_solution(baseline_solution("loop")["config"]) == GroupedChoice("loop")
    assert baseline_solution("no such backend") is None
    problem = GroupedGemmProblem.from_counts([4, 4], 8, 8)
    e = _entry("grouped_gemm", problem, {"config": {"name": "grouped_mm", **GroupedChoice("grouped_mm").to_solution()},
                                         "blob": b""}, library_versions())
    fixed = confirmed_entry(e, {"verdict": "dropped"}, sol)
    assert GroupedChoice.from_solution(fixed.solution["config"]) == GroupedChoice("triton", GroupedGemmConfig())


def test_the_tiny_trainers_attention_is_confirmed_with_its_backward_and_a_slow_choice_dropped(tmp_path: Path) -> None:
    """The attention kind is confirmed in the tiny trainer's steps, each timed call with its
    backward: a choice whose forward is torch's and whose backward is slower is dropped and its
    entry becomes torch's own SDPA, so the next run routes nothing."""
    import dataclasses

    from primus_perf.kernels.attention.router import library_versions as attention_versions
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.flops import attention_problem
    from primus_perf.tuner.cache_check import confirm_trainer

    overrides = ["model.n_layers=2", "train.seq_len=64", "train.micro_batch=2", "train.device=cpu"]
    torch.set_num_threads(1)
    cfg = load_config("tiny", overrides)
    p = dataclasses.replace(attention_problem(cfg.model, 2, 64, dtype="f32"), heads_kv=cfg.model.n_heads)
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(_entry("attention", p, {"config": {"backend": "sdpa:math"}, "blob": b""},
                                  attention_versions()))
    run = confirm_trainer("tiny", overrides, cache, steps=14, policy=ConfirmPolicy(samples=8, warmup=1),
                          router_kinds=slow_backward_kinds())
    assert [(r.verdict.kind, r.verdict.status) for r in run.rows] == [("attention", DROPPED)], run.rows
    v = run.rows[0].verdict
    assert v.speedup is not None and v.speedup < 0.5 and v.pairs >= 8  # the backward's work is in the samples
    entry = TuningCache(cache).entries("attention")[0]
    assert entry.solution["config"] == {"backend": "sdpa:default"} and entry.in_step["verdict"] == DROPPED


TRAIN_SCRIPT = """
import sys

import torch
import torch.nn.functional as F

steps = int(sys.argv[sys.argv.index("--steps") + 1])
torch.manual_seed(0)
qkv, out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)
opt = torch.optim.AdamW([*qkv.parameters(), *out.parameters()], lr=1e-3)
x = torch.randn(2, 64, 32)
for _ in range(steps):
    q, k, v = (t.view(2, 64, 4, 8).transpose(1, 2) for t in qkv(x).split(32, dim=-1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out(o.transpose(1, 2).reshape(2, 64, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""
SCRIPT_ATTENTION = AttentionProblem(2, 4, 4, 64, 64, 8, "f32", True, "bshd")


def _script_cache(tmp_path: Path) -> Path:
    from primus_perf.kernels.attention.router import library_versions as attention_versions

    (tmp_path / "train.py").write_text(TRAIN_SCRIPT)
    cache = tmp_path / "cache.json"
    TuningCache(cache).put(_entry("attention", SCRIPT_ATTENTION, {"config": {"backend": "sdpa:math"}, "blob": b""},
                                  attention_versions()))
    return cache


def test_a_scripts_confirmation_ends_with_the_final_check_driven_by_its_own_steps(tmp_path: Path) -> None:
    """``primus-tune confirm -- train.py``: the attention choice (slower in its backward) is
    dropped in the script's steps; then, in the same run, the script is held at each step's
    end while the cache is switched, and the step with it is measured against the step without
    it: the cache left behind routes torch's own SDPA."""
    from primus_perf.tuner.cache_check import confirm_program

    torch.set_num_threads(1)
    cache = _script_cache(tmp_path)
    said: list[str] = []
    done = confirm_program(cache, [str(tmp_path / "train.py"), "--steps", "40"], blocks=2, block_steps=2,
                           policy=ConfirmPolicy(samples=8, warmup=1), router_kinds=slow_backward_kinds(),
                           log=said.append)
    assert [r.verdict.status for r in done.confirmation.rows] == [DROPPED] and done.unchecked == ""
    assert done.final is not None and [r.kinds for r in done.final.rounds][:1] == [("attention",)]
    assert any(line.startswith("final check: the cache") for line in said), said
    entry = TuningCache(cache).entries("attention")[0]
    assert entry.solution["config"] == {"backend": "sdpa:default"}


def test_a_script_too_short_for_the_final_check_says_so(tmp_path: Path) -> None:
    cache = _script_cache(tmp_path)
    res = CliRunner().invoke(app, ["confirm", "--cache", str(cache), "--samples", "2", "--warmup", "0", "--",
                                   str(tmp_path / "train.py"), "--steps", "6"])
    assert res.exit_code == 0, res.output
    assert "final check: not run (the program ended after" in res.output and "run the program longer" in res.output
