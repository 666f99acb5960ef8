"""Online tuning on the CPU with an injected device clock and fake candidates: every problem
locks within a bounded number of steps, clearly slower candidates are dropped early, the
choice follows the one selection policy, locks from two processes land in one cache
without losing entries, and a restart with the written cache does no tuning."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch
from torch import nn

import primus_perf
from enable_fakes import FAKE_KINDS, FAKE_SOURCE, FakeClock, launched
from primus_perf.base.devices import current_device
from primus_perf.cache.store import TuningCache
from primus_perf.kernels.gemm import problem_of, torch_mm
from primus_perf.kernels.routing import UNSUPPORTED
from primus_perf.tuner.gemm.online import GemmOnline
from primus_perf.tuner.measure import Sample
from primus_perf.tuner.online import OnlinePolicy, OnlineRouter, Pooled, ProblemTuning

SPEED = {"torch": 1.0, "fast": 0.7, "close": 0.995, "slow": 3.0, "good": 0.8}  # ms per call


class FakeGemmOnline(GemmOnline):
    """The real GEMM adapter with a fake pool: candidates that advance the clock."""

    def __init__(self, clock: FakeClock, names=("torch", "fast", "close", "slow")) -> None:
        super().__init__()
        self.clock = clock
        self.names = names
        self.pools = 0

    def pool(self, problem, a, b, bias=None):
        self.pools += 1
        torch.mm(a.double(), b.double())  # as a reference product: must not start tuning its own problem

        def runner(name):
            def run(x, y):
                self.clock.now += SPEED[name] * 1e-3
                return torch_mm(x, y)
            return run

        source = {"torch": "torch"}
        return [Pooled(n, {"config": {"name": n, "source": source.get(n, FAKE_SOURCE)}, "blob": b""}, 0.0,
                       runner(n)) for n in self.names]


def _call(router: OnlineRouter, a, b):
    """A GEMM call as its dispatch answers it: the router's ``run``, else torch's kernel."""
    _key, run = router.route(a, b)
    return torch_mm(a, b) if run is None else run()


def _race(state: ProblemTuning, clock: FakeClock, speed: dict, limit: int = 200) -> list:
    """Calls until the state is ready: (candidate, contender, side) of each, None for the
    default's untimed calls."""
    placed = []
    while not state.ready() and len(placed) < limit:
        p = state.next()
        placed.append(None if p is None else (p[0].name, p[1], p[2]))
        if p is not None:
            start = clock.mark()
            clock.now += speed[p[0].name](len(placed)) if callable(speed[p[0].name]) else speed[p[0].name]
            state.add(p[1], p[2], Sample([(start, clock.mark())]))
        state.poll()
    return placed


def test_contenders_race_the_default_in_pairs_and_go_when_they_cannot_win() -> None:
    clock = FakeClock(lag=0)
    pool = [Pooled(n, {}, 0.0, None) for n in ("torch", "fast", "close", "slow")]
    state = ProblemTuning(pool, OnlinePolicy(), clock)
    placed = _race(state, clock, SPEED)
    assert placed[:2] == [None, None]  # warm-up: the default, untimed
    # one pair per contender first, ABBA: (fast, torch), (close, torch), (slow, torch), then
    # each contender's second pair the other way round
    assert placed[2:8] == [("fast", "fast", "choice"), ("torch", "fast", "baseline"),
                           ("close", "close", "choice"), ("torch", "close", "baseline"),
                           ("slow", "slow", "choice"), ("torch", "slow", "baseline")]
    assert placed[8:10] == [("torch", "fast", "baseline"), ("fast", "fast", "choice")]
    # "slow" (3x) went after its one pair; "close" (1.005x) after its two: not by the 1% margin
    assert state.dropped == ["slow", "close"]
    assert sum(1 for p in placed if p and p[1] == "slow") == 2
    assert state.lock() == "fast" and state.verdicts["fast"].speedup == pytest.approx(1 / 0.7)
    assert state.calls == 2 + 4 + 12 and len(placed) == 2 + state.calls
    figure = state.figure("close", "gemm", "k")
    assert figure.status == "dropped" and figure.speedup == pytest.approx(1 / 0.995) and figure.pairs == 2
    # without "fast" the default is kept
    state2 = ProblemTuning([pool[0], pool[2]], OnlinePolicy(), clock)
    _race(state2, clock, SPEED)
    assert state2.ready() and state2.lock() == "torch" and state2.dropped == ["close"]


def test_only_the_finalists_go_on_and_a_contender_the_pairs_contradict_goes() -> None:
    """Four contenders faster than the default: after two pairs each only the two fastest
    go on. One that wins its first pairs and then loses is dropped by its verdict."""
    clock = FakeClock(lag=0)
    speed = {"torch": 1.0, "a": 0.9, "b": 0.8, "c": 0.95, "d": 0.85,
             "fickle": lambda call: 0.5 if call <= 6 else 1.3}  # wins its first 2 pairs
    pool = [Pooled(n, {}, 0.0, None) for n in ("torch", "a", "b", "c", "d")]
    state = ProblemTuning(pool, OnlinePolicy(max_candidates=5), clock)
    _race(state, clock, speed)
    assert state.dropped == ["a", "c"] and state.lock() == "b"
    assert state.calls == 2 * 2 * 4 + 2 * 4 * 2  # 2 pairs of 4, then 4 more pairs of the finalists
    state2 = ProblemTuning([Pooled(n, {}, 0.0, None) for n in ("torch", "fickle")], OnlinePolicy(), clock)
    _race(state2, clock, speed)
    assert state2.lock() == "torch" and state2.dropped == ["fickle"]
    assert state2.figure("fickle", "gemm", "k").status == "dropped"


def test_bound_locks_with_samples_in_flight_or_lost() -> None:
    clock = FakeClock(lag=0)
    pool = [Pooled(n, {}, 0.0, None) for n in ("torch", "fast")]
    state = ProblemTuning(pool, OnlinePolicy(pairs=50, warmup=0, max_calls=6, lost_after=6), clock)
    for _ in range(6):
        cand, name, side = state.next()
        start = clock.mark()
        clock.now += SPEED[cand.name]
        # the contender's samples never complete (a backward that never ran)
        state.add(name, side, Sample([(start, clock.mark())], expect=1 if cand.name == "torch" else 2))
    state.poll()
    assert not state.ready() and state.next() is None
    for _ in range(6):
        state.next()
    assert state.ready() and state.lock() == "torch" and state.calls == 6 and state.undecided() == ["fast"]


class StepEvents:
    """Device events as a busy GPU gives them: a mark completes only once the step it was
    recorded in has ended (:meth:`end_step`); time advances as fake candidates run."""

    def __init__(self) -> None:
        self.now = 0.0
        self.step = 0

    def mark(self) -> tuple[int, float]:
        return (self.step, self.now)

    def elapsed(self, start, end) -> float | None:
        return None if end[0] >= self.step else end[1] - start[1]

    def end_step(self) -> None:
        self.step += 1


def _steps(state: ProblemTuning, clock: StepEvents, speed: dict, calls_per_step: int, steps: int = 10,
           lost: set | None = None, kinds=None) -> int:
    """Steps of ``calls_per_step`` calls (polled before each, as the router does) until the
    state is ready; ``lost``: timed-call indices whose sample never completes; ``kinds``:
    the kind of each call in a step."""
    timed = 0
    for step in range(1, steps + 1):
        for i in range(calls_per_step):
            state.poll()
            if state.ready():
                return step
            p = state.next(kinds[i] if kinds else None)
            if p is not None:
                start = clock.mark()
                clock.now += speed[p[0].name]
                state.add(p[1], p[2], Sample([(start, clock.mark())], expect=2 if timed in (lost or ()) else 1))
                timed += 1
        clock.end_step()
    return 0


def test_a_winner_is_found_when_many_calls_come_before_any_event_is_read() -> None:
    """48 calls a step (a 48-layer model), events read after the step: the contenders get
    their first two pairs each before the finalists go on, so the bound of 40 timed calls
    still holds every verdict; a sample that never completes is placed again."""
    speed = {"torch": 1.0, "fast": 0.7, "b": 0.95, "c": 0.9, "d": 1.1}
    pool = [Pooled(n, {}, 0.0, None) for n in speed]
    clock = StepEvents()
    state = ProblemTuning(pool, OnlinePolicy(), clock)
    assert _steps(state, clock, speed, 48) == 3
    assert state.lock() == "fast" and state.verdicts["fast"].pairs == 6 and state.calls <= 40
    assert state.dropped == ["d", "b"] and set(state.verdicts) == {"fast", "c"}  # d slower, b not a finalist
    clock = StepEvents()
    state = ProblemTuning(pool[:2], OnlinePolicy(), clock)
    assert _steps(state, clock, speed, 48, lost={3}) == 3  # a pair of its 7 lost: 6 still counted
    assert state.lock() == "fast" and state.races["fast"].calls == 14


def test_samples_still_in_flight_within_a_step_do_not_end_the_tuning() -> None:
    """80 calls a step and events read after it: nothing is concluded in the first step."""
    speed = {"torch": 1.0, "fast": 0.7}
    clock = StepEvents()
    state = ProblemTuning([Pooled(n, {}, 0.0, None) for n in speed], OnlinePolicy(), clock)
    assert _steps(state, clock, speed, 80) == 2 and state.lock() == "fast"


def test_a_win_smaller_than_what_routing_costs_is_not_kept() -> None:
    speed = {"torch": 6e-6, "close": 5.7e-6}  # 1.053x, 0.3 us a call
    clock = StepEvents()
    state = ProblemTuning([Pooled(n, {}, 0.0, None) for n in speed], OnlinePolicy(), clock)
    _steps(state, clock, speed, 4)
    assert state.lock() == "torch" and state.dropped == ["close"]
    figure = state.figure("close", "gemm", "k")
    assert figure.status == "dropped" and figure.speedup == pytest.approx(6 / 5.7)
    assert "saves 0.3 us a call, under the 5 us" in figure.reason


def test_a_pair_is_two_calls_of_one_kind() -> None:
    """Calls that time differently (an attention forward with and without its backward)
    never make one pair: the open pair waits for a call of its kind."""
    speed = {"torch": 1.0, "fast": 0.7}
    clock = StepEvents()
    state = ProblemTuning([Pooled(n, {}, 0.0, None) for n in speed], OnlinePolicy(warmup=0), clock)
    first = state.next("grad")
    assert first[2] == "choice" and state.next("no grad") is None
    assert state.next("grad")[2] == "baseline" and state.next("no grad")[2] == "baseline"


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _steps_until_locked(cache: Path, clock: FakeClock, adapter: FakeGemmOnline, max_steps: int = 60):
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(16, 32)
    lines: list[str] = []
    policy = OnlinePolicy()
    with primus_perf.enable(cache, online=True, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS,
                            online_options={"adapters": {"gemm": adapter}, "clock": clock, "policy": policy},
                            log=lines.append) as tuned:
        router = tuned.routers["gemm"]
        for step in range(1, max_steps + 1):
            model.zero_grad()
            y = model(x)
            ref = x @ model.up.weight.t()
            y.square().mean().backward()  # (a sum's gradient is a stride-0 expand: no BLAS layout)
            for _ in range(clock.lag):  # the step goes on: its marks complete, as device events do
                clock.mark()
            if step > 1 and not router.tuning:
                break
        summary = tuned.summary()["gemm"]
    torch.testing.assert_close(ref, x @ model.up.weight.t())
    return step, summary, lines, router


def test_online_run_locks_every_problem_writes_the_cache_and_restart_does_no_tuning(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    clock = FakeClock(lag=2)
    adapter = FakeGemmOnline(clock)
    steps, summary, lines, _ = _steps_until_locked(cache, clock, adapter)
    # 2 linears: fwd + dgrad (down only: x needs no grad) + wgrad = 5 problems, one call each per step
    assert adapter.pools == 5 and len(summary["online"]) == 5
    # 2 warm-up calls, then pairs against torch, a whole pair a call (GEMMs: both sides on the
    # call's operands): "slow" 1, "close" 2 (not 1% faster), "fast" 6 (its verdict), the events
    # read 2 marks later; a pair a side a call, this took 23 steps
    assert steps <= 12, steps
    assert all(info["chosen"] == "fast" and info["dropped"] == ["slow", "close"] for info in summary["online"].values())
    assert all(info["speedup"] == pytest.approx(SPEED["torch"] / SPEED["fast"]) for info in summary["online"].values())
    assert all(info["in_step"]["verdict"] == "kept" and info["in_step"]["samples"] == 6
               for info in summary["online"].values())
    assert all(calls == 9 for calls in summary["tuning"].values())  # 18 timed calls
    assert len(lines) == 5 and all("locked fast: 1.429x torch in the step [1.429-1.429], 12 calls" in line
                                   and "tuning cost" in line for line in lines), lines
    entries = TuningCache(cache).entries("gemm")
    assert len(entries) == 5 and {e.solution["config"]["name"] for e in entries} == {"fast"}
    assert all(e.tuner_version.endswith("+online") and e.times["tuned_ms"] == pytest.approx(0.7) for e in entries)
    assert all(e.in_step["verdict"] == "kept" and e.in_step["baseline"] == "torch" for e in entries)
    assert all(e.claim().startswith("1.429x torch in the step [1.429-1.429], 12 calls") for e in entries)
    # restart: the written cache routes every problem, nothing is tuned
    clock2, adapter2 = FakeClock(), CachedGemmOnline(FakeClock())  # confirmed entries are not raced
    launched.clear()
    _, summary2, lines2, _ = _steps_until_locked(cache, clock2, adapter2, max_steps=2)
    assert adapter2.pools == 0 and summary2["tuning"] == {} and lines2 == []
    # 5 problems + the reference product of the up projection, per step
    assert summary2["fallback"] == 0 and summary2["routed"] == 12 and sum(launched.values()) == 12


def test_gemms_called_once_a_step_lock_within_20_steps_with_two_finalists(tmp_path: Path) -> None:
    """The longest race: four contenders, two of them faster than torch, so two finalists go
    on to their verdicts; the output layer's GEMMs are called once a step, and still lock by
    step 20 (a whole pair a call)."""
    clock = FakeClock(lag=2)
    adapter = FakeGemmOnline(clock, names=("torch", "fast", "close", "slow", "good"))
    steps, summary, _lines, _ = _steps_until_locked(tmp_path / "cache.json", clock, adapter)
    assert steps <= 20, steps
    assert all(info["chosen"] == "fast" and info["dropped"] == ["slow", "close"]  # "good" kept, not the best
               for info in summary["online"].values())


def _tune_in_process(cache: str, out_features: int) -> None:
    import torch

    clock = FakeClock(lag=0)
    router = OnlineRouter(FakeGemmOnline(clock), None, cache, current_device(), {"fakeblas": "1.0"},
                          policy=OnlinePolicy(pairs=2, warmup=0), clock=clock)
    a, b = torch.randn(8, 16), torch.randn(16, out_features)
    for _ in range(30):
        _call(router, a, b)
    assert not router.tuning and len(router.locked) == 1


def test_two_processes_lock_into_one_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_tune_in_process, args=(str(cache), n)) for n in (4, 12)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    keys = {e.problem_key for e in TuningCache(cache).entries()}
    assert keys == {problem_of(torch.randn(8, 16), torch.randn(16, n)).key() for n in (4, 12)}


def test_validation_runs_without_autocast_and_its_calls_from_any_thread_go_to_torch(tmp_path: Path) -> None:
    """A pool is validated inside the program's forward (autocast on) and its reference's
    backward GEMMs run on autograd's worker threads: both must reach torch's own kernels,
    untuned, and the reference must be fp32."""
    import threading

    clock = FakeClock()
    seen: dict[str, object] = {}

    class Probing(FakeGemmOnline):
        def pool(self, problem, a, b, bias=None):
            seen["autocast"] = torch.is_autocast_enabled("cpu")
            x, y = torch.randn(3, 5), torch.randn(5, 7)
            seen["reference_dtype"] = (x @ y).dtype
            out: list = []
            worker = threading.Thread(target=lambda: out.append(router.route(x, y)))  # another thread's call
            worker.start()
            worker.join()
            seen["other_thread"] = out[0]
            return super().pool(problem, a, b, bias)

    adapter = Probing(clock)
    with primus_perf.enable(tmp_path / "c.json", online=True, kinds=("gemm",), device_type="cpu",
                            router_kinds=FAKE_KINDS, online_options={"adapters": {"gemm": adapter}, "clock": clock},
                            log=lambda _l: None) as handle:
        router = handle.routers["gemm"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.Linear(8, 4, bias=False)(torch.randn(2, 8))
        assert seen["autocast"] is False and seen["reference_dtype"] == torch.float32
        assert seen["other_thread"] == (UNSUPPORTED, None)  # answered by torch, not tuned
        assert len(router.tuning) == 1  # only the program's own problem is being tuned


class ColdTorchOnline(FakeGemmOnline):
    """torch's kernel is 12x slower on its first 2 calls (a cold start), as fast as "heur2"
    after: the first pairs claim 12x for heur2, the median of its pairs does not."""

    def pool(self, problem, a, b, bias=None):
        self.pools += 1
        calls = {"torch": 0}

        def torch_run(x, y):
            calls["torch"] += 1
            self.clock.now += (12.0 if calls["torch"] <= 2 else 1.0) * 1e-3
            return torch_mm(x, y)

        def heur_run(x, y):
            self.clock.now += 1e-3
            return torch_mm(x, y)

        return [Pooled("torch", {"config": {"name": "torch", "source": "torch"}, "blob": b""}, 0.0, torch_run),
                Pooled("heur2", {"config": {"name": "heur2", "source": FAKE_SOURCE}, "blob": b""}, 0.0, heur_run)]


def test_a_contender_its_pairs_do_not_bear_out_keeps_torch_and_says_so(tmp_path: Path) -> None:
    clock = FakeClock(lag=1)
    cache = tmp_path / "cache.json"
    lines: list[str] = []
    router = OnlineRouter(ColdTorchOnline(clock), None, cache, current_device(), {"fakeblas": "1.0"},
                          policy=OnlinePolicy(warmup=0), clock=clock, log=lines.append)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    for _ in range(40):
        torch.testing.assert_close(_call(router, a, b), a @ b)
    key = problem_of(a, b).key()
    assert key in router.locked and router.locked[key].name == "torch"
    info = router.online[key]
    # ratios 12, 12, 1, 1, 1: let go after its fifth pair, its median no longer 1% faster (one
    # more pair placed while the fifth pair's last event was in flight)
    assert info["tried"] == "heur2" and info["dropped"] == ["heur2"] and info["calls"] == 12
    assert info["in_step"]["verdict"] == "dropped" and info["in_step"]["speedup"] == pytest.approx(1.0)
    assert info["speedup"] == pytest.approx(1.0)
    assert len(lines) == 1 and "locked torch: no contender beat it in the step (heur2 1.000x, 5 pairs)" \
        in lines[0], lines
    (entry,) = TuningCache(cache).entries("gemm")
    assert entry.solution["config"]["source"] == "torch" and entry.in_step["choice"] == "heur2"
    assert entry.claim().startswith("torch kept: heur2 1.000x in the step [1.000-12.000], 10 calls"), entry.claim()


class LostSamplesOnline(FakeGemmOnline):
    """The contenders' samples never complete (a backward that never runs)."""

    def timed(self, cand, clock, *args):
        out, sample = super().timed(cand, clock, *args)
        sample.expect = 1 if cand.name == "torch" else 2
        return out, sample


def test_a_lock_for_want_of_evidence_is_this_runs_only(tmp_path: Path) -> None:
    clock = FakeClock(lag=0)
    cache = tmp_path / "cache.json"
    lines: list[str] = []
    router = OnlineRouter(LostSamplesOnline(clock, names=("torch", "fast")), None, cache, current_device(),
                          {"fakeblas": "1.0"}, policy=OnlinePolicy(warmup=0, lost_after=8), clock=clock,
                          log=lines.append)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    for _ in range(40):
        torch.testing.assert_close(_call(router, a, b), a @ b)  # the contender's, or torch's own
    key = problem_of(a, b).key()
    assert router.locked[key].name == "torch" and router.online[key]["undecided"] is True
    assert router.online[key]["calls"] == 12  # its 6 pairs (none completes: none is known lost)
    assert len(lines) == 1 and "torch for this run: fast undecided in the step" in lines[0]
    assert "not written: the next run tunes it again" in lines[0], lines
    assert not cache.exists() or TuningCache(cache).entries() == []


def test_online_gemm_key_refuses_operands_of_two_devices() -> None:
    """A call whose operands (or bias) sit on different devices, or a bias of another dtype,
    has no problem: torch's kernel answers it (and says what is wrong); a locked library
    kernel is never handed another device's pointer."""
    adapter = GemmOnline()
    a, b = torch.randn(32, 16), torch.randn(16, 8)
    key, _problem = adapter.key(a, b)
    assert adapter.key(a, b.to("meta")) is None and adapter.key(a.to("meta"), b) is None
    assert adapter.key(a, b, torch.randn(8, device="meta")) is None
    assert adapter.key(a, b, torch.randn(8, dtype=torch.float64)) is None
    assert adapter.key(a, b, torch.randn(8))[0] != key  # a bias: the bias epilogue's problem
    assert adapter.key(a, b)[0] == key


def test_a_candidate_that_raises_fails_its_problem_once(tmp_path: Path) -> None:
    """The dispatch says so once and runs torch's kernel for the problem; the pool is not built
    and validated again on the next call."""
    from primus_perf.runtime.gemm import GemmDispatch

    clock = FakeClock(lag=0)

    class Breaking(FakeGemmOnline):
        def pool(self, problem, a, b, bias=None):
            out = super().pool(problem, a, b, bias)
            for p in out[1:]:
                p.run = lambda x, y: (_ for _ in ()).throw(RuntimeError("kernel exploded"))
            return out

    adapter = Breaking(clock)
    router = OnlineRouter(adapter, None, tmp_path / "c.json", current_device(), {"fakeblas": "1.0"}, clock=clock)
    d = GemmDispatch("gemm")
    d.install(router)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    for _ in range(30):
        torch.testing.assert_close(d.gemm(a, b), a @ b)
    assert adapter.pools == 1 and d.summary()["failed"] == [problem_of(a, b).key()]


class CachedGemmOnline(FakeGemmOnline):
    """The fake adapter that also races a cached choice: its name in the entry says its speed."""

    def cached(self, solution, problem, a, b, bias=None):
        pool = {p.name: p for p in self.pool(problem, a, b, bias)}
        self.pools -= 1
        name = solution["config"]["name"]
        return [pool["torch"], Pooled(name, dict(solution), 0.0, pool[name].run)]


@pytest.mark.parametrize("choice, kept", [("slow", False), ("fast", True)])
def test_a_cached_choice_no_step_confirmed_is_raced_and_the_default_stays_where_it_loses(tmp_path: Path, choice: str,
                                                                                       kept: bool) -> None:
    """Online tuning with a cache from an offline tuner (entries without an in-step figure): each
    cached choice races torch's kernel in the step like a new problem with one contender; one
    that loses falls back to torch and its entry says so, one that wins stays, confirmed."""
    from enable_fakes import gemm_entry

    cache = tmp_path / "cache.json"
    clock = FakeClock(lag=2)
    adapter = CachedGemmOnline(clock)
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(16, 32)
    problem = problem_of(x, model.up.weight.t())
    entry = gemm_entry(problem, current_device())
    entry.solution["config"]["name"] = choice
    TuningCache(cache).put(entry)
    steps, summary, _lines, _router = _steps_until_locked(cache, clock, adapter)
    info = summary["online"][problem.key()]
    assert info["chosen"] == (choice if kept else "torch") and info["in_step"]["verdict"] == ("kept" if kept else "dropped")
    (written,) = [e for e in TuningCache(cache).entries("gemm") if e.problem_key == problem.key()]
    assert written.solution["config"]["name"] == (choice if kept else "torch")
    assert written.in_step["choice"] == choice and steps <= 12
