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
from primus_perf.cache.store import TuningCache
from primus_perf.devices import current_device
from primus_perf.kernels.gemm import problem_of, torch_mm
from primus_perf.tuner.online import OnlinePolicy, OnlineRouter, Pooled, ProblemTuning, Sample
from primus_perf.tuner.online_kinds import GemmOnline

SPEED = {"torch": 1.0, "fast": 0.7, "close": 0.995, "slow": 3.0}  # ms per call


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


def test_state_machine_drops_early_and_selects_with_the_margin() -> None:
    clock = FakeClock(lag=0)
    pool = [Pooled(n, {}, 0.0, None) for n in SPEED]
    state = ProblemTuning(pool, OnlinePolicy(min_samples=3, drop_after=2, max_calls=100), clock)
    order = []
    while not state.ready():
        cand = state.next()
        order.append(cand.name)
        start = clock.mark()
        clock.now += SPEED[cand.name]
        state.add(cand.name, Sample([(start, clock.mark())]))
        state.poll()
    assert order[:4] == ["torch", "fast", "close", "slow"]  # round-robin
    # dropped after 2 samples each: over 1.25x the best ("close" is 1.42x "fast")
    assert state.dropped == ["close", "slow"] and order.count("slow") == 2
    assert state.lock() == "fast"
    # "close" is within the 1% margin of the default: without "fast" the default is kept
    state2 = ProblemTuning([pool[0], pool[2]], OnlinePolicy(min_samples=3), clock)
    for name in ["torch", "close"] * 3:
        assert state2.next().name == name
        start = clock.mark()
        clock.now += SPEED[name]
        state2.add(name, Sample([(start, clock.mark())]))
    state2.poll()
    assert state2.ready() and state2.lock() == "torch"


def test_bound_locks_with_samples_in_flight_or_lost() -> None:
    clock = FakeClock(lag=0)
    pool = [Pooled(n, {}, 0.0, None) for n in ("torch", "fast")]
    state = ProblemTuning(pool, OnlinePolicy(min_samples=50, max_calls=6), clock)
    for _ in range(6):
        cand = state.next()
        start = clock.mark()
        clock.now += SPEED[cand.name]
        state.add(cand.name, Sample([(start, clock.mark())], expect=1 if cand.name == "torch" else 2))
    state.poll()  # "fast" samples never complete (a backward that never ran)
    assert not state.ready() and state.next() is None
    for _ in range(6):
        state.next()
    assert state.ready() and state.lock() == "torch" and state.calls == 6


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
    policy = OnlinePolicy(min_samples=3, drop_after=2, max_calls=40)
    with primus_perf.enable(cache, online=True, kinds=("gemm",), device_type="cpu", router_kinds=FAKE_KINDS,
                            online_options={"adapters": {"gemm": adapter}, "clock": clock, "policy": policy},
                            log=lines.append) as tuned:
        router = tuned.routers["gemm"]
        for step in range(1, max_steps + 1):
            model.zero_grad()
            y = model(x)
            ref = x @ model.up.weight.t()
            y.square().mean().backward()  # (a sum's gradient is a stride-0 expand: no BLAS layout)
            if step > 1 and not router.tuning and not router.confirming:
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
    # tuning (about 10 calls), then the lock's confirmation: 2 warm-up + 8 counted pairs
    assert steps <= 40, steps
    assert all(info["chosen"] == "fast" and info["dropped"] == ["close", "slow"] for info in summary["online"].values())
    assert all(info["speedup"] == pytest.approx(SPEED["torch"] / SPEED["fast"]) for info in summary["online"].values())
    assert all(info["in_step"]["verdict"] == "kept" and info["in_step"]["samples"] == 8
               for info in summary["online"].values())
    assert all(calls <= 40 for calls in summary["tuning"].values())
    assert all(info["confirm_calls"] >= 20 for info in summary["online"].values())
    assert len(lines) == 5 and all("locked fast: 1.429x torch in the step [1.429-1.429], 16 calls" in line
                                   and "tuning cost" in line for line in lines), lines
    entries = TuningCache(cache).entries("gemm")
    assert len(entries) == 5 and {e.solution["config"]["name"] for e in entries} == {"fast"}
    assert all(e.tuner_version.endswith("+online") and e.times["tuned_ms"] == pytest.approx(0.7) for e in entries)
    assert all(e.in_step["verdict"] == "kept" and e.in_step["baseline"] == "torch" for e in entries)
    assert all(e.claim().startswith("1.429x torch in the step [1.429-1.429], 16 calls") for e in entries)
    # restart: the written cache routes every problem, nothing is tuned
    clock2, adapter2 = FakeClock(), FakeGemmOnline(FakeClock())
    launched.clear()
    _, summary2, lines2, _ = _steps_until_locked(cache, clock2, adapter2, max_steps=2)
    assert adapter2.pools == 0 and summary2["tuning"] == {} and lines2 == []
    # 5 problems + the reference product of the up projection, per step
    assert summary2["fallback"] == 0 and summary2["routed"] == 12 and sum(launched.values()) == 12


def _tune_in_process(cache: str, out_features: int) -> None:
    import torch

    clock = FakeClock(lag=0)
    router = OnlineRouter(FakeGemmOnline(clock), None, cache, current_device(), {"fakeblas": "1.0"},
                          policy=OnlinePolicy(min_samples=2, drop_after=2), clock=clock)
    a, b = torch.randn(8, 16), torch.randn(16, out_features)
    for _ in range(30):
        router(a, b)
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
            worker = threading.Thread(target=lambda: out.append(router(x, y)))  # another thread's call
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
        assert seen["other_thread"] is None  # answered by torch, not tuned
        assert len(router.tuning) == 1  # only the program's own problem is being tuned


class ColdTorchOnline(FakeGemmOnline):
    """torch's kernel is 12x slower on its first calls (a cold start the tuning samples
    catch), as fast as "heur2" after: the tuning locks heur2 on a false 12x."""

    def pool(self, problem, a, b, bias=None):
        self.pools += 1
        calls = {"torch": 0}

        def torch_run(x, y):
            calls["torch"] += 1
            self.clock.now += (12.0 if calls["torch"] <= 3 else 1.0) * 1e-3
            return torch_mm(x, y)

        def heur_run(x, y):
            self.clock.now += 1e-3
            return torch_mm(x, y)

        return [Pooled("torch", {"config": {"name": "torch", "source": "torch"}, "blob": b""}, 0.0, torch_run),
                Pooled("heur2", {"config": {"name": "heur2", "source": FAKE_SOURCE}, "blob": b""}, 0.0, heur_run)]


def test_a_lock_the_step_does_not_bear_out_keeps_torch_and_says_so(tmp_path: Path) -> None:
    clock = FakeClock(lag=1)
    cache = tmp_path / "cache.json"
    lines: list[str] = []
    router = OnlineRouter(ColdTorchOnline(clock), None, cache, current_device(), {"fakeblas": "1.0"},
                          policy=OnlinePolicy(min_samples=3, drop_after=3), clock=clock, log=lines.append)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    for _ in range(40):
        torch.testing.assert_close(router(a, b), a @ b)
    key = problem_of(a, b).key()
    assert key in router.locked and router.locked[key].name == "torch"
    info = router.online[key]
    assert info["tried"] == "heur2" and info["tuning_speedup"] > 5  # the tuning samples' false claim
    assert info["in_step"]["verdict"] == "dropped" and info["speedup"] == pytest.approx(1.0)
    assert len(lines) == 1 and "heur2 not confirmed in the step (1.000x [1.000-1.000], 16 calls): torch kept" \
        in lines[0], lines
    (entry,) = TuningCache(cache).entries("gemm")
    assert entry.solution["config"]["source"] == "torch" and entry.in_step["choice"] == "heur2"
    assert entry.claim().startswith("torch kept: heur2 1.000x in the step") and "online samples" in entry.claim()


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
