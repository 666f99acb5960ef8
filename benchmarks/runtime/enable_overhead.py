"""Step time of a plain PyTorch Llama-style training script with and without
``primus_perf.enable``, in interleaved blocks, on one GPU.

    python benchmarks/runtime/enable_overhead.py --cache tuning_cache.json \
        --result benchmarks/results/enable_overhead/h100.json            # 4 layers of Llama-3-8B
    python benchmarks/runtime/enable_overhead.py --smoke                         # CPU: the script works

The model and the step are those of ``examples/llama_train.py``. Blocks of ``--block``
steps alternate off / on (``--pairs`` of each, one settling step after each switch); the
result has each side's median step time, its spread (quartiles), the ratio on/off (the
bar: at least 0.995x the throughput of the run without enable, i.e. ratio <= 1.005),
the routed-call counts against the model's GEMMs and attention calls per step, and the
per-call dispatch cost of the overrides measured on small GEMMs (host time, the router
answering "not mine"). With a cache from offline tuning the on side also carries the
tuned kernels' effect; with an empty cache (``--cache`` of a file with no entries) it is
the overhead alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import primus_perf
from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_train.py"
SMOKE = ["--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2", "--hidden", "128",
         "--vocab", "256", "--seq", "32", "--batch", "2", "--device", "cpu"]


def load_example():
    spec = importlib.util.spec_from_file_location("llama_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spread(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {"median_ms": statistics.median(xs) * 1e3, "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3, "n": len(xs)}


def interleaved(step, enable, pairs: int, block: int, start: int = 0, before_disable=None) -> dict[str, list[float]]:
    """Step times of ``2 * pairs`` alternating blocks, off (no enable) then on (``enable()``'s
    handle): one settling step after each switch, then ``block`` timed steps (``step(i)``
    returns its seconds); ``before_disable(handle)`` sees each on-block's handle."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    i = start
    for b in range(2 * pairs):
        side = "on" if b % 2 else "off"
        handle = enable() if side == "on" else None
        try:
            step(i)  # settle after the switch
            i += 1
            for _ in range(block):
                times[side].append(step(i))
                i += 1
        finally:
            if handle is not None:
                if before_disable is not None:
                    before_disable(handle)
                handle.disable()
    return times


def dispatch_cost_us(cache: str, n: int = 2000) -> dict[str, float]:
    """Host time per small GEMM with and without the overrides (best of 5 rounds)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = torch.randn(16, 16, device=dev), torch.randn(16, 16, device=dev)

    def best() -> float:
        out = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                torch.mm(a, b)
            if dev == "cuda":
                torch.cuda.synchronize()
            out = min(out, (time.perf_counter() - t0) / n)
        return out

    plain = best()
    with primus_perf.enable(cache, kinds=("gemm",), log=None) as handle:
        routed = best() if "gemm" in handle.routers else float("nan")
    return {"plain_us": plain * 1e6, "enabled_us": routed * 1e6, "overhead_us": (routed - plain) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="tuning cache (offline-tuned, or empty for the overhead alone)")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--result", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, measures nothing")
    ap.add_argument("model_args", nargs="*", help="examples/llama_train.py options after --, e.g. -- --layers 8")
    args = ap.parse_args()
    example = load_example()
    margs = example.parse([*args.model_args, *(SMOKE if args.smoke else [])])
    cache = args.cache
    if cache is None:
        if not args.smoke:
            ap.error("--cache is required (use a file with no entries to measure the overhead alone)")
        cache = str(Path(tempfile.mkdtemp()) / "empty.json")
        write_json(cache, {"schema": 1, "entries": []})
    model, opt = example.build(margs)
    for i in range(2):  # warm-up: allocator, kernels, autotuners
        example.step(model, opt, margs, i)
    counts: dict[str, int] = {}

    def count(handle) -> None:
        for kind, row in handle.summary().items():
            if row.get("available"):
                counts[kind] = counts.get(kind, 0) + row["routed"] + row["fallback"]
                counts[f"{kind}_routed"] = counts.get(f"{kind}_routed", 0) + row["routed"]

    times = interleaved(lambda i: example.step(model, opt, margs, i), lambda: primus_perf.enable(cache, log=None),
                        args.pairs, args.block, start=2, before_disable=count)
    on_steps = args.pairs * (args.block + 1)
    per_step = model.calls_per_step()
    result = {
        "device": current_device().to_dict(),
        "versions": library_versions(),
        "model": {k: getattr(margs, k) for k in ("layers", "dim", "heads", "kv_heads", "hidden", "vocab", "seq", "batch")},
        "pairs": args.pairs, "block": args.block,
        "off": spread(times["off"]), "on": spread(times["on"]),
        "ratio_on_off": statistics.median(times["on"]) / statistics.median(times["off"]),
        "calls": {kind: {"seen_per_step": counts.get(kind, 0) / on_steps,
                         "routed_per_step": counts.get(f"{kind}_routed", 0) / on_steps,
                         "model_per_step": per_step[kind]} for kind in per_step},
        "dispatch": dispatch_cost_us(cache),
    }
    print(json.dumps(result, indent=1))
    if args.result and not args.smoke:
        write_json(args.result, result)


if __name__ == "__main__":
    main()
