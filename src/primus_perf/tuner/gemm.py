"""GEMM search: candidate pool (torch default, cuBLASLt/hipBLASLt heuristics and widenings),
numerical validation against an fp32 reference, robust interleaved timing, resumable runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.devices import require_gpu
from primus_perf.problems import GemmProblem, torch_dtype
from primus_perf.tuner import bench

TUNER_VERSION = "gemm-2"  # 2: isolated timing (tuner/bench.py)
WORKSPACE_BYTES = 32 * 2**20
TOLERANCE = {"bf16": 2e-2, "f16": 5e-3, "f32": 1e-4, "tf32": 5e-3, "f64": 1e-10}
ROUGH_DROP = 1.5
ROUGH_REPS = 5
ISOLATION_COST_S = 1.2e-3  # GPU idle + flush before each isolated call
KEEP_TORCH_MARGIN = 0.99


@dataclass
class Candidate:
    name: str
    algo: bytes | None  # None: torch's own choice
    workspace: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    fn: Callable[[Any, Any, Any], object] | None = None  # (a, b, out): a Python candidate


def library_versions() -> dict[str, str]:
    from primus_perf.tuner.blaslt.binding import load

    lt = load()
    return {("cublasLt" if lt.t.vendor == "nvidia" else "hipblasLt"): lt.version()}


class Operands:
    """Rotating sets of inputs and outputs for one problem, in the torch layout the trainer uses."""

    def __init__(self, p: GemmProblem, seed: int = 0) -> None:
        import torch

        M, N, K, at, bt = p.row_major_shapes()
        dt = torch_dtype(p.dtype_a)
        g = torch.Generator(device="cuda").manual_seed(seed)
        per_set = (M * K + K * N + M * N) * torch.empty((), dtype=dt).element_size()
        self.n = bench.buffer_sets(per_set)
        self.a, self.b, self.d = [], [], []
        for _ in range(self.n):
            a = torch.randn(*((K, M) if at else (M, K)), device="cuda", dtype=dt, generator=g)
            b = torch.randn(*((N, K) if bt else (K, N)), device="cuda", dtype=dt, generator=g)
            self.a.append(a.T if at else a)
            self.b.append(b.T if bt else b)
            self.d.append(torch.empty(M, N, device="cuda", dtype=torch_dtype(p.dtype_d)))


def solution_index(algo: bytes, offset: int) -> int:
    """The library's solution index stored in an algo struct (hipBLASLt)."""
    return int.from_bytes(algo[offset:offset + 4], "little", signed=True)


def candidates(plan: Any, p: GemmProblem, widen: bool = False) -> list[Candidate]:
    pool = [Candidate("torch", None)]
    seen: set[bytes] = set()
    t = plan.lt.t
    for i, h in enumerate(plan.heuristics(t.heuristic_count, WORKSPACE_BYTES)):
        if h.algo in seen:
            continue
        seen.add(h.algo)
        config = plan.algo_config(h.algo)
        if t.solution_index_offset is not None:
            config["solution_index"] = solution_index(h.algo, t.solution_index_offset)
        pool.append(Candidate(f"heur{i}", h.algo, h.workspace, config))
    if widen and plan.lt.t.algo_config_attr:
        for c in list(pool[1:4]):
            for splitk in (2, 4):
                v = plan.with_config(c.algo, SPLITK_NUM=splitk, REDUCTION_SCHEME=1)
                if v and v[0] not in seen and v[1] <= WORKSPACE_BYTES:
                    seen.add(v[0])
                    pool.append(Candidate(f"{c.name}-splitk{splitk}", v[0], v[1], plan.algo_config(v[0])))
    return pool


def tune_problem(p: GemmProblem, budget_s: float = 5.0, widen: bool = False,
                 planted: Candidate | None = None) -> tuple[CacheEntry, dict[str, Any]]:
    """Tune one problem; returns the cache entry and a report (candidates, errors, timings)."""
    import torch

    from primus_perf.tuner.blaslt.binding import BlasLtError, load

    t0 = time.perf_counter()
    device = require_gpu()
    lt = load()
    plan = lt.plan(p)
    ops = Operands(p)
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    pool = candidates(plan, p, widen)
    if planted is not None:
        pool.append(planted)

    def runner(c: Candidate) -> Callable[[int], object]:
        if c.fn is not None:
            return lambda i: c.fn(ops.a[i], ops.b[i], ops.d[i])
        if c.algo is None:
            return lambda i: torch.mm(ops.a[i], ops.b[i], out=ops.d[i])
        stream = torch.cuda.current_stream().cuda_stream
        return lambda i: plan.run(c.algo, ops.b[i].data_ptr(), ops.a[i].data_ptr(), ops.d[i].data_ptr(),
                                  ws.data_ptr(), WORKSPACE_BYTES, stream)

    ref = ops.a[0].float() @ ops.b[0].float()
    ref_norm = ref.norm().item() or 1.0
    tol = TOLERANCE.get(p.compute if p.compute == "tf32" else p.dtype_a, 2e-2)
    report: dict[str, Any] = {"problem": p.key(), "candidates": {}, "rejected": {}}
    valid: dict[str, Candidate] = {}
    errors: dict[str, float] = {}
    for c in pool:
        try:
            ops.d[0].fill_(float("nan"))
            runner(c)(0)
            torch.cuda.synchronize()
            err = ((ops.d[0].float() - ref).norm().item()) / ref_norm
        except BlasLtError as exc:
            report["rejected"][c.name] = str(exc)
            continue
        if not err <= tol:  # NaN fails too
            report["rejected"][c.name] = f"relative error {err:.3g} > {tol}"
            continue
        valid[c.name] = c
        errors[c.name] = err
    if "torch" not in valid:
        raise RuntimeError(f"torch's own result fails the reference check for {p}")
    # every call timed alone, in the conditions of a training step (see tuner/bench.py)
    fns = {n: runner(c) for n, c in valid.items()}
    rough = bench.time_isolated(fns, ops.n, ROUGH_REPS)
    med = {n: sorted(v)[len(v) // 2] for n, v in rough.items()}
    best = min(med.values())
    finalists = {n: f for n, f in fns.items() if med[n] <= ROUGH_DROP * best or n == "torch"}
    spent = time.perf_counter() - t0
    per_round = sum(med[n] + ISOLATION_COST_S for n in finalists)
    rounds = int(max(10, min(40, (budget_s - spent) / max(per_round, 1e-6) * 0.6)))
    final = bench.time_isolated(finalists, ops.n, rounds, seed=1)
    stats = {n: bench.summarize(v) for n, v in final.items()}
    chosen = min(stats, key=lambda n: stats[n]["median_s"])
    if stats[chosen]["median_s"] > KEEP_TORCH_MARGIN * stats["torch"]["median_s"]:
        chosen = "torch"  # a win inside the noise is not worth leaving torch for
    c = valid[chosen]
    report.update(candidates={n: stats[n] for n in stats}, chosen=chosen, rounds=rounds,
                  pool=len(pool), valid=len(valid), tuning_s=time.perf_counter() - t0)
    entry = CacheEntry(
        kind="gemm",
        problem_key=p.key(),
        problem=p.to_dict(),
        device=device.to_dict(),
        versions={("cublasLt" if lt.t.vendor == "nvidia" else "hipblasLt"): lt.version()},
        solution={"config": {"source": "torch" if c.algo is None else lt.t.source, "name": c.name,
                             "workspace": c.workspace, **c.config},
                  "blob": c.algo or b""},
        times={"tuned_ms": stats[chosen]["median_s"] * 1e3, "default_ms": stats["torch"]["median_s"] * 1e3},
        error=errors[chosen],
        tuner_version=TUNER_VERSION,
        created=time.time(),
    )
    plan.close()
    return entry, report


def tune_problems(problems: Iterable[GemmProblem], cache_path: str, budget_s: float = 5.0,
                  on_done: Callable[[GemmProblem, CacheEntry | None, dict], None] | None = None) -> list[CacheEntry]:
    """Tune each unique problem not yet in the cache for this device, writing as it goes."""
    from primus_perf.devices import current_device

    cache = TuningCache(cache_path)
    device = current_device()
    versions = library_versions()
    out = []
    seen: set[str] = set()
    for p in problems:
        if p.key() in seen:
            continue
        seen.add(p.key())
        existing = cache.get("gemm", p.key(), device, versions)
        if existing is not None:
            if on_done:
                on_done(p, existing, {"skipped": True})
            out.append(existing)
            continue
        entry, report = tune_problem(p, budget_s)
        cache.put(entry)
        out.append(entry)
        if on_done:
            on_done(p, entry, report)
    return out
