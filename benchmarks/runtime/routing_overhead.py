"""What routing costs: (a) the per-call overhead of a routed GEMM, (b) enable() with a cache of
all-default entries against no enable, on ``examples/llama_train.py`` steps, (c) the
routing's own Python on CPU tensors.

    python benchmarks/runtime/routing_overhead.py --result benchmarks/results/routing_overhead/h100.json
    python benchmarks/runtime/routing_overhead.py --smoke          # CPU: checks the script (a test runs it)
    python benchmarks/runtime/routing_overhead.py --python-path    # (c) alone, on any machine

(a) One tiny GEMM (``--m/--n/--k``, bf16 on the GPU) whose cache entry is the cuBLASLt /
hipBLASLt heuristic's first algorithm, called ``--calls`` times through ``torch.mm`` under
``enable()`` (the aten override -> the router -> the BLAS-Lt kernel), against plain
``torch.mm`` on the same operands, in interleaved rounds: host time per call (the
program's thread, no synchronization inside the loop) and device time per call (CUDA
events around the loop). The overhead per routed call is the difference of the host
medians; ``host_breakdown`` times the layers of that call apart (:func:`breakdown`).
``--smoke`` runs the same path on the CPU with a kernel-table row that calls torch's GEMM
in place of the library.

(b) Every GEMM problem of the example's step gets a cache entry that keeps torch's choice;
blocks of ``--block`` steps alternate without enable / under enable (``--pairs`` each, a
settling step after each switch): with every entry torch's, enable installs no GEMM
override, so the ratio is the cost of having enabled it.

(c) A cache entry whose kernel answers with an output made in advance (no GEMM), on tiny
CPU tensors: what the GEMM dispatch's Python route and the aten override add, in us per call,
on this host (:func:`python_path`; a GPU run reports it too, for its host).

Routed calls take the native dispatch (``runtime/native.py``: a C++ table of call
signatures) where it builds, the Python overrides otherwise (``PRIMUS_PERF_NATIVE=0``);
``gemm_dispatch`` in the result says which.

The per-call figure is measured here, not by enable() itself: timing every routed call in
the program would cost more than the routing does (two clock reads per call), so the
handle's summary counts routed calls and this benchmark prices them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

import primus_perf
from benchmarks.runtime.enable_overhead import SMOKE, interleaved, load_example, spread
from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.kernels import gemm
from primus_perf.kinds import RouterPart
from primus_perf.runtime import dispatch, native

SMOKE_SOURCE = "smoke"  # the CPU kernel-table row: torch's GEMM where the library would run
SMOKE_VERSIONS = {"smoke": "1"}
PY_CALLS, PY_ROUNDS = 3000, 9  # the Python-path section: calls per round, interleaved rounds


class _TorchAsLibrary:
    def __call__(self, a, b):
        return gemm.torch_mm(a, b)

    def close(self) -> None:
        pass


class _Ready:
    """A kernel that answers with one output made in advance: a call through it costs the
    routing's Python and nothing else."""

    def __init__(self, problem, device) -> None:
        self.out = torch.empty(problem.n, problem.m, device=device)

    def __call__(self, a, b):
        return self.out

    def close(self) -> None:
        pass


def _kinds(table: dict) -> dict:
    return {"gemm": RouterPart(lambda es: gemm.GemmRouter.from_entries(list(es), table), lambda: dict(SMOKE_VERSIONS))}


SMOKE_TABLE = {SMOKE_SOURCE: lambda problem, solution, device: _TorchAsLibrary()}
SMOKE_KINDS = _kinds(SMOKE_TABLE)
READY_KINDS = _kinds({SMOKE_SOURCE: lambda problem, solution, device: _Ready(problem, device)})


def _entry(p, solution: dict, versions: dict) -> CacheEntry:
    return CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=current_device().to_dict(),
                      versions=versions, solution=solution, times={}, tuner_version="routing-overhead")


def _tuned_solution(p, smoke: bool) -> tuple[dict, dict]:
    """The cache solution of ``p`` and the versions it needs: the heuristic's first algo."""
    if smoke:
        return {"config": {"name": "smoke", "source": SMOKE_SOURCE}, "blob": b""}, dict(SMOKE_VERSIONS)
    from primus_perf.kernels.blaslt.binding import load

    lt = load()
    with lt.plan(p) as plan:
        h = plan.heuristics(1, gemm.WORKSPACE_BYTES)[0]
    return {"config": {"name": "heur0", "source": lt.t.source}, "blob": h.algo}, gemm.library_versions(lt)


def _timed(fn, calls: int, cuda: bool) -> tuple[float, float | None]:
    """(host seconds per call, device seconds per call or None)."""
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    if not cuda:
        return host, None
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / 1e3 / calls


def _us(xs: list[float]) -> dict | None:
    if not xs:
        return None
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {"median_us": statistics.median(xs) * 1e6, "q1_us": q[0] * 1e6, "q3_us": q[2] * 1e6, "n": len(xs)}


def _layers(a, b, cache: Path, kinds, device_type: str, kernel, rounds: int, calls: int,
            extra: dict | None = None) -> dict[str, list[float]]:
    """Host seconds per call, interleaved rounds: ``torch_mm`` (torch.mm, no enable), then
    under enable(): ``kernel`` (the routed kernel called directly, as the dispatch calls it),
    ``dispatch`` (the GEMM dispatch's Python route, ``GemmDispatch.gemm``: what a call the
    native table does not answer runs), ``override`` (torch.mm: the aten override's path) and
    each of ``extra`` (name -> callable)."""
    samples: dict[str, list[float]] = {"torch_mm": []}
    for _ in range(rounds):
        samples["torch_mm"].append(_timed(partial(torch.mm, a, b), calls, False)[0])
        with primus_perf.enable(cache, kinds=("gemm",), router_kinds=kinds, device_type=device_type, log=None) as h:
            fns = {"kernel": partial(kernel, a, b), "dispatch": partial(dispatch.of("gemm").gemm, a, b),
                   "override": partial(torch.mm, a, b), **(extra or {})}
            for name, fn in fns.items():
                fn()  # a signature's first call resolves it
                samples.setdefault(name, []).append(_timed(fn, calls, False)[0])
            assert h.summary()["gemm"]["routed"] == 2 * (calls + 1)
    return samples


def python_path(args, cache_dir: Path) -> dict:
    """The routing's own Python on the CPU (this host's): a 16x64 @ 64x64 fp32 call whose
    entry's kernel answers with an output made in advance (no GEMM), through the dispatch's
    Python route and ``torch.mm`` under enable() (the aten override), against
    ``torch.mm`` itself (:func:`_layers`). ``*_adds_us``: each path's median less the
    kernel's (the routing's Python); the override's also holds torch.mm's own binding and
    dispatch, which every torch.mm call pays."""
    a, b = torch.randn(16, 64), torch.randn(64, 64)
    p = gemm.problem_of(a, b)
    cache = cache_dir / "ready.json"
    TuningCache(cache).put(_entry(p, *_tuned_solution(p, smoke=True)))
    samples = _layers(a, b, cache, READY_KINDS, "cpu", _Ready(p, "cpu"), PY_ROUNDS, PY_CALLS)
    out = {"problem": p.key(), "calls_per_round": PY_CALLS, **{f"{k}_us": _us(v) for k, v in samples.items()}}
    kernel_us = out["kernel_us"]["median_us"]
    for name in ("dispatch", "override"):
        out[f"{name}_adds_us"] = out[f"{name}_us"]["median_us"] - kernel_us
    return out


def breakdown(args, a, b, p, solution: dict, cache: Path, kinds) -> dict:
    """Where a routed call's host time goes, on the per-call problem's operands (the GPU's
    in a GPU run): :func:`_layers` with the kernel of the cache entry, called as the dispatch
    calls it (its per-signature ``run``), and the parts of that call alone: ``new_empty``
    (the output), ``stream`` (the current raw stream, GPU) and ``torch_mm_out`` (torch's
    GEMM through the ``out=`` overload: what a call left to torch runs)."""
    table = SMOKE_TABLE if args.smoke else gemm.KERNELS
    kernel = table[gemm.solution_source(solution)](p, solution, a.device)
    run = kernel.for_call(a, b) if hasattr(kernel, "for_call") else kernel
    out_shape = (*a.shape[:-1], b.shape[-1])
    extra = {"new_empty": partial(a.new_empty, out_shape), "torch_mm_out": partial(gemm.torch_mm, a, b)}
    if a.is_cuda:
        extra["stream"] = partial(torch._C._cuda_getCurrentRawStream, a.get_device())
    samples = _layers(a, b, cache, kinds, a.device.type, run, args.rounds, args.calls, extra)
    kernel.close()
    return {k: _us(v) for k, v in samples.items()}


def per_call(args, cache_dir: Path) -> dict:
    cuda = not args.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    a, b = torch.randn(args.m, args.k, device=dev, dtype=dtype), torch.randn(args.k, args.n, device=dev, dtype=dtype)
    p = gemm.problem_of(a, b)
    solution, versions = _tuned_solution(p, args.smoke)
    cache = cache_dir / "one_tuned.json"
    TuningCache(cache).put(_entry(p, solution, versions))
    kinds = SMOKE_KINDS if args.smoke else None
    samples: dict[str, list[float]] = {"plain_host": [], "routed_host": [], "plain_device": [], "routed_device": []}
    routed_calls = 0
    for _ in range(args.rounds):
        for side in ("plain", "routed"):
            handle = primus_perf.enable(cache, kinds=("gemm",), router_kinds=kinds,
                                        device_type=dev, log=None) if side == "routed" else None
            try:
                torch.mm(a, b)  # settle
                host, device = _timed(lambda: torch.mm(a, b), args.calls, cuda)
            finally:
                if handle is not None:
                    routed_calls += handle.summary()["gemm"]["routed"]
                    handle.disable()
            samples[f"{side}_host"].append(host)
            if device is not None:
                samples[f"{side}_device"].append(device)
    expected = args.rounds * (args.calls + 1)
    assert routed_calls == expected, f"{routed_calls} of {expected} calls were routed"
    out = {"problem": p.key(), "calls_per_round": args.calls, **{k: _us(v) for k, v in samples.items()}}
    out["overhead_host_us"] = out["routed_host"]["median_us"] - out["plain_host"]["median_us"]
    if cuda:
        out["overhead_device_us"] = out["routed_device"]["median_us"] - out["plain_device"]["median_us"]
    out["host_breakdown"] = breakdown(args, a, b, p, solution, cache, kinds)
    return out


class _Recorder:
    """A GEMM router that records every problem it sees and routes none."""

    def __init__(self) -> None:
        self.problems: dict[str, object] = {}

    def route(self, a, b, bias=None):
        try:
            p = gemm.problem_of(a, b)
        except ValueError:
            return "unsupported", None
        if bias is not None:
            import dataclasses

            p = dataclasses.replace(p, epilogue="bias")
        self.problems[p.key()] = p
        return p.key(), None


def step_problems(example, model, opt, margs, device_type: str) -> list:
    rec = _Recorder()
    d = dispatch.of("gemm")
    d.install(rec)
    d.keep_overrides(rec, device_type)
    try:
        example.step(model, opt, margs, 0)
    finally:
        d.release(rec)
        d.install(None)
    return list(rec.problems.values())


def all_default(args, cache_dir: Path) -> dict:
    example = load_example()
    margs = example.parse([*args.model_args, *(SMOKE if args.smoke else [])])
    model, opt = example.build(margs)
    device_type = "cpu" if args.smoke else "cuda"
    problems = step_problems(example, model, opt, margs, device_type)
    versions = dict(SMOKE_VERSIONS) if args.smoke else gemm.library_versions()
    cache = cache_dir / "all_default.json"
    TuningCache(cache).put_many([_entry(p, {"config": {"name": "torch", "source": "torch"}, "blob": b""}, versions)
                                 for p in problems])
    kinds = SMOKE_KINDS if args.smoke else None
    for i in range(2):
        example.step(model, opt, margs, i)
    intercepted = []

    def enable():
        handle = primus_perf.enable(cache, kinds=("gemm",), router_kinds=kinds, device_type=device_type, log=None)
        intercepted.append(dispatch.of("gemm").intercepting)
        return handle

    times = interleaved(lambda i: example.step(model, opt, margs, i), enable, args.pairs, args.block, start=2)
    return {"entries": len(problems), "gemm_override_installed": any(intercepted), "pairs": args.pairs,
            "block": args.block, "off": spread(times["off"]), "on": spread(times["on"]),
            "ratio_on_off": statistics.median(times["on"]) / statistics.median(times["off"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--result", type=Path)
    ap.add_argument("--smoke", action="store_true", help="the CPU: the script and the Python path, no GPU")
    ap.add_argument("--python-path", action="store_true", help="only the routing's Python on the CPU (any machine)")
    ap.add_argument("model_args", nargs="*", help="examples/llama_train.py options after --")
    args = ap.parse_args()
    if args.python_path:
        print(json.dumps(python_path(args, Path(tempfile.mkdtemp())), indent=1))
        return
    if args.smoke:
        args.calls, args.rounds, args.pairs, args.block = min(args.calls, 300), min(args.rounds, 3), 1, 1
    elif not torch.cuda.is_available():
        ap.error("needs a GPU (or --smoke)")
    cache_dir = Path(tempfile.mkdtemp())
    ext = native.load(print)
    result = {"device": current_device().to_dict(), "versions": library_versions(), "smoke": args.smoke,
              "gemm_dispatch": "native" if ext is not None else f"python: {native.why_not()}",
              "python_path": python_path(args, cache_dir), "per_call": per_call(args, cache_dir),
              "all_default_cache": all_default(args, cache_dir)}
    print(json.dumps(result, indent=1))
    if args.result and not args.smoke:
        write_json(args.result, result)


if __name__ == "__main__":
    main()
