"""Grouped-GEMM tuning: the plugin through the real core with a fake timer, the launch-bound
timer's semantics on a simulated stream, the router (fwd, dgrad, wgrad; exact problems only),
``enable()`` routing and counting grouped calls, grouped items in problems files, online
tuning of a grouped problem, and the recording of a run's grouped problems."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from enable_fakes import StepClock
from primus_perf import enable
from primus_perf.base.devices import current_device
from primus_perf.base.errors import ConfigError, UserError
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kernels.grouped import BACKENDS, Backend
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.offsets import Offsets
from primus_perf.kernels.grouped.router import (
    GroupedChoice,
    GroupedGemmRouter,
    library_versions,
    shape_key,
)
from primus_perf.kinds import GROUPED
from primus_perf.problems import GroupedGemmProblem, load_problems
from primus_perf.runtime import dispatch
from primus_perf.trainer.moe import grouped_mm
from primus_perf.tuner import core, measure
from primus_perf.tuner.grouped.plugin import (
    GroupedGemmTuner,
    choice_candidate,
    validation_counts,
)
from trainer_runs import routing

COUNTS = [5, 0, 1, 19, 0, 8, 1, 30]
K, N = 16, 24


def fake_timer(times_s: dict[str, float]):
    """Runs every call once (as a real timer would) and reports ``times_s[name]``."""

    def timer(calls, n_sets, reps, seed=0):
        for fn in calls.values():
            fn(0)
        return {key: [times_s[key[0]]] * reps for key in calls}

    return timer


def _tune(problem: GroupedGemmProblem, times: dict[str, float], **kw) -> core.TuneResult:
    tuner = GroupedGemmTuner(device="cpu", **kw)
    return core.tune_problem(tuner, problem, timer=fake_timer(times), budget_s=0.1)


PROBLEM = GroupedGemmProblem.from_counts(COUNTS, K, N, dtype="f32")
TRITON_CFG = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, group_m=2)


@pytest.mark.parametrize("phase", ["fwd", "dgrad", "wgrad"])
def test_loop_is_kept_within_the_margin(phase: str) -> None:
    names = {"loop": 1e-3, "grouped_mm": 0.995e-3, "padded_bmm": 2e-3}
    res = _tune(PROBLEM.with_phase(phase), names, triton=False)
    assert res.chosen == "loop"
    assert {c.name: c.status for c in res.candidates} == {
        "loop": "chosen", "grouped_mm": "measured", "padded_bmm": "dropped"}
    assert res.entry.kind == "grouped_gemm" and res.entry.problem_key == PROBLEM.with_phase(phase).key()


def test_a_faster_backend_is_chosen_and_a_wrong_one_rejected() -> None:
    loop = BACKENDS["loop"]
    fast = choice_candidate(GroupedChoice("loop"), "fast")
    fast.run = Backend("fast", loop.mm, loop.wgrad, loop.unsupported)
    zeros = Backend("zeros", lambda a, b, c: a.new_zeros(a.shape[0], b.shape[2]),
                    lambda a, b, c: a.new_zeros(len(c), a.shape[1], b.shape[1]), loop.unsupported)
    wrong = choice_candidate(GroupedChoice("loop"), "wrong")
    wrong.run = zeros
    times = {"loop": 1e-3, "grouped_mm": 0.9e-3, "fast": 0.5e-3, "wrong": 0.1e-3}
    for phase in ("fwd", "dgrad", "wgrad"):
        res = _tune(PROBLEM.with_phase(phase), times, backends=("grouped_mm",), triton=False,
                    extra=[fast, wrong])
        status = {c.name: c for c in res.candidates}
        assert res.chosen == "fast"
        assert status["wrong"].status == "rejected" and "relative error" in status["wrong"].reason
        assert res.entry.solution["config"] == {"name": "fast", "backend": "loop"}


def test_triton_configs_are_pruned_validated_and_can_win() -> None:
    bad = GroupedGemmConfig(block_k=48)
    label = f"triton {TRITON_CFG.label()}"
    res = _tune(PROBLEM, {"loop": 1e-3, label: 0.4e-3}, backends=(), configs=[bad, TRITON_CFG])
    assert res.details["pruned"] == {bad.label(): "block_k must be a power of two >= 16"}
    assert [c.name for c in res.candidates] == ["loop", label]
    assert res.chosen == label and res.error < 1e-4
    choice = GroupedChoice.from_solution(res.entry.solution["config"])
    assert choice == GroupedChoice("triton", TRITON_CFG)


def test_configs_over_max_configs_are_cut_and_reported() -> None:
    """The space's valid configs beyond ``max_configs`` are not raced, and the result and a
    progress line say how many were cut."""
    from primus_perf.tuner.grouped.space import tiny_space

    valid = tiny_space().configs(PROBLEM, "cpu")
    assert len(valid) > 2
    steps: list[str] = []
    tuner = GroupedGemmTuner(device="cpu", backends=(), space=tiny_space(), max_configs=2)
    session = tuner.open(PROBLEM, None, steps.append)
    try:
        names = [c.name for c in session.candidates()]
    finally:
        session.close()
    assert names == ["loop", *(f"triton {cfg.label()}" for cfg in valid[:2])]
    assert session.details["triton_configs"] == 2 and session.details["triton_configs_cut"] == len(valid) - 2
    assert steps == [f"{len(valid)} valid Triton configs: racing the first 2 (max_configs)"]


def test_validation_counts_have_an_empty_and_a_one_token_group() -> None:
    counts = GroupedGemmProblem(groups=8, k=8, n=8, tokens=256, skew=2.0).example_counts()
    v = validation_counts(counts)
    assert sum(v) == sum(counts) == 256 and v[-1] == 0 and v[-2] == 1
    assert validation_counts([3, 4]) == [3, 4]


def test_unknown_backend_and_bad_dtype_are_user_errors() -> None:
    with pytest.raises(UserError, match="unknown grouped GEMM backend"):
        GroupedGemmTuner(backends=("cublas",))
    with pytest.raises(UserError, match="tolerance"):
        GroupedGemmTuner().check(GroupedGemmProblem(groups=2, k=8, n=8, tokens=8, dtype="f64"))


def test_the_tuner_kind_is_registered() -> None:
    from primus_perf.tuner.kinds import kind_of, plugins

    assert plugins()["grouped_gemm"] is GroupedGemmTuner and kind_of(PROBLEM) == "grouped_gemm"


# ---- the launch-bound timer ----------------------------------------------------------------


class SimulatedStream:
    """One stream and one host clock: a launch costs the host ``launch_s`` and the kernel
    starts when both the launch is done and the stream is free; a mark is a zero-length
    kernel; ``sleep`` queues GPU idle; ``synchronize`` moves the host to the stream's end."""

    def __init__(self, launch_s: float = 5e-6) -> None:
        self.host = 0.0
        self.free = 0.0
        self.launch_s = launch_s

    def kernel(self, gpu_s: float) -> float:
        self.host += self.launch_s
        start = max(self.host, self.free)
        self.free = start + gpu_s
        return self.free

    def sleep(self, cycles: int) -> None:
        self.kernel(cycles * 1e-9)

    def flush(self) -> None:
        self.kernel(80e-6)

    def synchronize(self) -> None:
        self.host = max(self.host, self.free)

    def mark(self) -> float:
        return self.kernel(0.0)

    def elapsed(self, start: float, end: float) -> float:
        return end - start


def _calls(stream: SimulatedStream) -> dict:
    def many_small(_i: int) -> None:  # the per-expert loop: 32 launches of 1 us each
        for _ in range(32):
            stream.kernel(1e-6)

    def one_big(_i: int) -> None:  # one grouped kernel of 60 us
        stream.kernel(60e-6)

    return {"loop": many_small, "grouped": one_big}


def test_launch_bound_timer_counts_the_launches_the_isolated_timer_hides() -> None:
    stream = SimulatedStream(launch_s=5e-6)
    iso = measure.time_isolated(_calls(stream), 1, 3, ops=stream)
    bound = measure.time_launch_bound(_calls(stream), 1, 3, ops=stream)
    # isolated: the loop's launches queue while the GPU sleeps, only its 32 us of GPU time show
    assert iso["loop"] == pytest.approx([32e-6] * 3)
    assert iso["grouped"] == pytest.approx([60e-6] * 3)
    # launch-bound: 32 launches of 5 us leave the GPU waiting: 160 us, more than the kernel
    assert bound["loop"] == pytest.approx([33 * 5e-6] * 3)  # the end mark waits for the 33rd launch
    assert bound["grouped"] == pytest.approx([5e-6 + 60e-6] * 3)
    assert min(bound, key=lambda n: bound[n][0]) == "grouped" != min(iso, key=lambda n: iso[n][0])


def test_launch_bound_timer_equals_gpu_time_when_the_gpu_is_slower() -> None:
    stream = SimulatedStream(launch_s=1e-6)

    def two_long(_i: int) -> None:
        stream.kernel(50e-6)
        stream.kernel(50e-6)

    bound = measure.time_launch_bound({"x": two_long}, 1, 2, ops=stream)
    assert bound["x"] == pytest.approx([1e-6 + 100e-6] * 2)  # one launch latency + GPU time


def test_the_core_uses_the_plugins_own_timer() -> None:
    assert core.timer_for(GroupedGemmTuner()) is measure.launch_bound_timer()
    from primus_perf.tuner.gemm.plugin import GemmTuner

    assert core.timer_for(GemmTuner()) is measure.default_timer()


# ---- the router --------------------------------------------------------------------------------


def _operands(counts=COUNTS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(sum(counts), K, generator=g), torch.randn(len(counts), K, N, generator=g),
            torch.randn(sum(counts), N, generator=g))


def _spy_backend(calls: list[str]) -> Backend:
    loop = BACKENDS["padded_bmm"]

    def mm(a, b, counts):
        calls.append("mm")
        return loop.mm(a, b, counts)

    def wgrad(a, b, counts):
        calls.append("wgrad")
        return loop.wgrad(a, b, counts)

    return Backend("spy", mm, wgrad, loop.unsupported)


def test_router_routes_exactly_the_cached_problems(monkeypatch) -> None:
    """The router in the grouped dispatch: the cached problems' passes run its choice (counted
    under their shape's key), another token bucket runs the caller's backend (the loop)."""
    used: list[str] = []
    choice = GroupedChoice("padded_bmm")
    monkeypatch.setattr(GroupedChoice, "implementation", lambda self: _spy_backend(used))
    keys = [PROBLEM.with_phase(ph).key() for ph in ("fwd", "dgrad", "wgrad")]
    router = GroupedGemmRouter({k: choice for k in keys})
    x, w, dy = _operands()
    with routing(GROUPED.name, router, backend="loop") as grouped:
        grouped.reset()
        x.requires_grad_(True)
        w.requires_grad_(True)
        y = grouped_mm(x, w, COUNTS)
        y.backward(dy)
        assert sorted(used) == ["mm", "mm", "wgrad"]
        assert grouped.summary()["routed"] == {shape_key(PROBLEM.with_phase(ph)): 1 for ph in ("fwd", "dgrad", "wgrad")}
        # another token bucket: not cached, the caller's backend runs
        other = [100, 3, 2, 1, 0, 0, 0, 0]
        x2, w2, _ = _operands(other, seed=1)
        grouped_mm(x2, w2, other)
        assert sorted(used) == ["mm", "mm", "wgrad"]
        assert sum(grouped.summary()["fallback"].values()) == 1
    assert dispatch.of(GROUPED.name).router is None and not dispatch.of(GROUPED.name).intercepting
    ref = [x.detach()[sum(COUNTS[:g]):sum(COUNTS[:g + 1])] @ w.detach()[g] for g in range(len(COUNTS))]
    torch.testing.assert_close(y.detach(), torch.cat(ref))


def test_cache_solution_round_trip_and_bad_entries() -> None:
    tri = GroupedChoice("triton", TRITON_CFG)
    assert GroupedChoice.from_solution({"name": "x", **tri.to_solution()}) == tri
    with pytest.raises(ValueError):
        GroupedChoice("triton")
    with pytest.raises(ValueError):
        GroupedChoice("cublas")


def _entry(problem: GroupedGemmProblem, backend: str = "padded_bmm") -> CacheEntry:
    return CacheEntry(kind="grouped_gemm", problem_key=problem.key(), problem=problem.to_dict(),
                      device=current_device().to_dict(), versions=library_versions(),
                      solution={"config": {"name": backend, "backend": backend}, "blob": b""},
                      times={"tuned_ms": 1.0, "default_ms": 2.0}, error=0.0, tuner_version="test")


def test_enable_routes_and_counts_grouped_calls(tmp_path: Path) -> None:
    cache = tmp_path / "cache.json"
    TuningCache(cache).put_many([_entry(PROBLEM.with_phase(ph)) for ph in ("fwd", "dgrad", "wgrad")])
    x, w, dy = _operands()
    x.requires_grad_(True)
    w.requires_grad_(True)
    with enable(cache, kinds=("grouped_gemm",), device_type="cpu") as handle:
        grouped_mm(x, w, COUNTS).backward(dy)
        other = [100, 3, 2, 1, 0, 0, 0, 0]
        x2, w2, _ = _operands(other, seed=1)
        grouped_mm(x2, w2, other)
        row = handle.summary()["grouped_gemm"]
    assert row["available"] is True
    assert (row["routed"], row["fallback"], row["entries"], row["stale"]) == (3, 1, 3, 0)
    assert dispatch.of(GROUPED.name).router is None and not dispatch.of(GROUPED.name).intercepting


def test_enable_online_tunes_a_grouped_problem_and_writes_the_cache(tmp_path: Path) -> None:
    from primus_perf.tuner.online import OnlinePolicy

    cache = tmp_path / "cache.json"
    x, w, _ = _operands()
    policy = OnlinePolicy(pairs=2, warmup=0, drop_after=1, max_calls=16)
    with enable(cache, online=True, kinds=("grouped_gemm",), device_type="cpu", log=None,
                online_options={"policy": policy, "clock": StepClock()}) as handle:
        outs = [grouped_mm(x, w, COUNTS) for _ in range(12)]
        row = handle.summary()["grouped_gemm"]
    key = shape_key(PROBLEM)  # one tuning per shape: a later skew bucket starts none
    assert row["tuning"][key] >= 2 and key in row["online"]
    ref = outs[0]
    for out in outs[1:]:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    written = TuningCache(cache).entries()
    assert [e.problem_key for e in written] == [key] and written[0].kind == "grouped_gemm"
    GroupedChoice.from_solution(written[0].solution["config"])  # readable by the router
    # the next run: calls of the shape at another skew use the entry, nothing is tuned again
    balanced = [8] * 8
    with enable(cache, online=True, kinds=("grouped_gemm",), device_type="cpu", log=None,
                online_options={"policy": policy, "clock": StepClock()}) as handle:
        for counts in (COUNTS, balanced):
            grouped_mm(x, w, counts)
        row = handle.summary()["grouped_gemm"]
    assert not row.get("tuning") and row["routed"] == 2


@pytest.mark.parametrize("caller", ["padded_bmm", "loop"])
def test_online_grouped_tuning_races_against_the_callers_backend(caller: str, tmp_path: Path) -> None:
    """The online pool's baseline is the backend the call would have run (never dropped, the
    one a lock must beat): with every candidate equally fast, it is the one kept; Triton's
    default config is in the pool even with no Triton entry in the cache."""
    from primus_perf.tuner.grouped.online import GroupedGemmOnline
    from primus_perf.tuner.online import OnlinePolicy

    cache = tmp_path / "cache.json"
    x, w, _ = _operands()
    policy = OnlinePolicy(pairs=2, warmup=0, drop_after=1, max_calls=16)
    with (routing(GROUPED.name, backend=caller),  # the caller's backend, set before enable() as the trainer does
          enable(cache, online=True, kinds=("grouped_gemm",), device_type="cpu", log=None,
                 online_options={"policy": policy, "clock": StepClock()}) as handle):
        for _ in range(12):
            grouped_mm(x, w, COUNTS)
        info = handle.summary()["grouped_gemm"]["online"][shape_key(PROBLEM)]
    assert info["chosen"] == caller and info["candidates"] >= 3
    (written,) = TuningCache(cache).entries()
    assert GroupedChoice.from_solution(written.solution["config"]) == GroupedChoice(caller)
    assert GroupedChoice.of_backend("triton") == GroupedChoice("triton", GroupedGemmConfig())
    assert GroupedChoice.of_backend("torch") is None and GroupedChoice.of_backend(None) is None
    from primus_perf.tuner.grouped.space import prune

    big = GroupedGemmProblem.from_counts([64, 32, 32, 0], 256, 256, dtype="f32")
    xb, wb = torch.randn(128, 256), torch.randn(4, 256, 256)
    offsets = Offsets(128, counts=[64, 32, 32, 0])
    assert prune([GroupedGemmConfig()], big, "cpu")[0]  # the default config fits this problem
    # the pool's first: the baseline the dispatch gives (the backend the call would have run)
    assert GroupedGemmOnline().pool(big, "fwd", xb, wb, offsets, "grouped_mm")[0].name == "grouped_mm"
    names = [c.name for c in GroupedGemmOnline().pool(big, "fwd", xb, wb, offsets, "loop")]
    assert names[0] == "loop" and GroupedChoice("triton", GroupedGemmConfig()).label() in names
    # the Triton configs before the other backends: the router races the first few
    triton = [n.startswith("triton") for n in names[1:]]
    assert triton == sorted(triton, reverse=True) and not all(triton)


def test_online_seed_configs_fit_the_problems_they_were_picked_on() -> None:
    """The vendor's seed configs (raced online next to the default config) can run the
    grouped problems of a 128-expert model on sm_90; on another vendor a seed runs only
    where it fits."""
    from primus_perf.tuner.grouped.space import ONLINE_SEEDS, default_space, prune

    qwen3 = [GroupedGemmProblem(groups=128, k=2048, n=1536, phase=phase, tokens=32768, skew=1.25)
             for phase in ("fwd", "dgrad", "wgrad")]
    grid = default_space("nvidia").grid()
    for problem in qwen3:
        kept, why = prune(ONLINE_SEEDS["nvidia"], problem, "sm_90")
        assert kept == list(ONLINE_SEEDS["nvidia"]), why
    assert all(seed in grid for seed in ONLINE_SEEDS["nvidia"])  # points of the searched space
    assert set(ONLINE_SEEDS) >= {"nvidia", "amd", "cpu"}


# ---- problems -------------------------------------------------------------------------------


def test_problems_file_reads_grouped_items(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    items = [
        {"kind": "grouped_gemm", "problem": {"groups": 32, "k": 7168, "n": 4096, "tokens": 8192,
                                             "skew": 2, "phase": "dgrad"}},
        {"kind": "grouped_gemm", "problem": {"counts": COUNTS, "k": K, "n": N, "dtype": "f32"}},
        {"kind": "gemm", "problem": {"M": 64, "N": 64, "K": 64}},
    ]
    path.write_text(json.dumps({"problems": items}))
    got = load_problems(path)
    assert got[0] == GroupedGemmProblem(groups=32, k=7168, n=4096, tokens=8192, skew=2.0, phase="dgrad")
    assert got[1] == PROBLEM
    path.write_text(json.dumps([{"kind": "grouped_gemm", "problem": {"counts": COUNTS, "k": K, "n": N,
                                                                      "groups": 8}}]))
    with pytest.raises(ConfigError, match="counts or groups"):
        load_problems(path)
    path.write_text(json.dumps([{"kind": "grouped_gemm", "problem": {"groups": 8, "k": K, "n": N,
                                                                      "tokens": 100}}]))
    with pytest.raises(ConfigError, match="power of two"):
        load_problems(path)


def test_a_short_run_records_its_grouped_problems() -> None:
    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.grouped_problems import record_grouped_problems

    cfg = load_config("tiny-moe", ["model.n_layers=2", "train.steps=1", "train.seq_len=32"])
    found = record_grouped_problems(cfg, steps=1)
    assert len(found) == len({p.key() for p, _ in found}) and all(n >= 1 for _, n in found)
    m = cfg.model
    shapes = {(m.dim, 2 * m.moe.expert_dim), (m.moe.expert_dim, m.dim)}
    assert {(p.k, p.n, p.phase) for p, _ in found} == {(k, n, ph) for k, n in shapes
                                                      for ph in ("fwd", "dgrad", "wgrad")}
    with pytest.raises(ConfigError, match="no MoE layer"):
        record_grouped_problems(load_config("tiny", ["train.steps=1"]), steps=1)


# ---- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_plugin_end_to_end_on_the_gpu(tmp_path: Path) -> None:
    """Every backend and a few Triton configs race on a Qwen3-like problem (bf16), the
    launch-bound timer, the entry lands in the cache and the router runs it."""
    p = GroupedGemmProblem(groups=64, k=2048, n=1536, tokens=8192, skew=2.0)
    run = core.tune([p.with_phase(ph) for ph in ("fwd", "dgrad", "wgrad")], cache=tmp_path / "c.json",
                    tuners=[GroupedGemmTuner(max_configs=4)], budget_s=2.0)
    assert len(run.results) == 3
    for r in run.results:
        assert r.tuned_s <= r.default_s and r.error < 2e-2
        statuses = {c.name: c.status for c in r.candidates}
        assert statuses["loop"] in ("chosen", "measured", "dropped")
        assert any(n.startswith("triton") and s != "rejected" for n, s in statuses.items())


@pytest.mark.gpu
def test_router_on_the_gpu(tmp_path: Path) -> None:
    counts = [512, 0, 1, 300] + [199] * 12
    p = GroupedGemmProblem.from_counts(counts, 256, 512)
    cache = tmp_path / "c.json"
    entries = [_entry(p.with_phase("fwd"), "grouped_mm"), _entry(p.with_phase("dgrad"), "padded_bmm")]
    tri = GroupedChoice("triton", GroupedGemmConfig(block_m=64, block_n=128, block_k=64))
    wg = _entry(p.with_phase("wgrad"))
    wg.solution = {"config": {"name": "t", **tri.to_solution()}, "blob": b""}
    TuningCache(cache).put_many([*entries, wg])
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(counts), 256, device="cuda", generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(len(counts), 256, 512, device="cuda", generator=g).bfloat16().requires_grad_(True)
    dy = torch.randn(sum(counts), 512, device="cuda", generator=g).bfloat16()
    y0 = grouped_mm(x, w, counts)
    dx0, dw0 = torch.autograd.grad(y0, (x, w), dy)
    with enable(cache, kinds=("grouped_gemm",)) as handle:
        y = grouped_mm(x, w, counts)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
        row = handle.summary()["grouped_gemm"]
    assert row["routed"] == 3 and row["fallback"] == 0 and not row["failed"]
    for got, want in ((y, y0), (dx, dx0), (dw, dw0)):
        torch.testing.assert_close(got.float(), want.float(), atol=0.5, rtol=2e-2)


def test_benchmarks_run_their_smoke_modes(tmp_path: Path) -> None:
    """``moe_e2e.py`` and ``moe_grouped_gemm.py --tune`` on the CPU: the scripts, not the numbers."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "TRITON_INTERPRET": "1"}
    e2e = subprocess.run([sys.executable, str(root / "benchmarks/moe/moe_e2e.py"), "--smoke", "--out",
                          str(tmp_path / "e2e.json")], env=env, capture_output=True, text=True, timeout=300)
    assert e2e.returncode == 0, e2e.stderr[-2000:]
    res = json.loads((tmp_path / "e2e.json").read_text())["results"]["tiny-moe"]
    assert set(res["tokens_per_s"]) == {"loop", "grouped_mm", "tuned"} and res["routed_calls"] > 0
    assert res["max_rel_loss_diff_vs_loop"] < 1e-3
    gg = subprocess.run([sys.executable, str(root / "benchmarks/moe/moe_grouped_gemm.py"), "--smoke", "--tune",
                         "--reps", "2", "--max-configs", "1", "--tune-budget-s", "0.05",
                         "--cases", "qwen3-30b-a3b-up", "--out", str(tmp_path / "gg.json")],
                        env=env, capture_output=True, text=True, timeout=300)
    assert gg.returncode == 0, gg.stderr[-2000:]
    summary = json.loads((tmp_path / "gg.json").read_text())["summary"]
    assert [s["phase"] for s in summary] == ["fwd", "dgrad", "wgrad"] and all("tuned_choice" in s for s in summary)
