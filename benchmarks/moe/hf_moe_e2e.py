"""Hugging Face transformers MoE models end to end: plain ``experts_implementation=
"grouped_mm"`` against the same program under ``primus_perf.enable`` with a grouped-GEMM
cache tuned from the program's own trace.

Per case (the GPU sizes of ``examples/hf_moe_train.py --preset h100``, bf16, AdamW):
Qwen3-MoE (128 experts of 768), Mixtral (8 experts of 14336), DeepSeek-V3 (one shared
expert and 48 routed experts of 2048):

1. profile: two steps recorded with torch.profiler (``record_shapes``) under ``enable()``
   with an empty cache, so each ``aten::_grouped_mm`` call names its problem and token
   split in the trace (a plain trace records shapes only);
2. tune: the trace's grouped problems (``tuner.problems_input.gather_problems``, what
   ``primus-tune grouped-gemm --trace`` reads) with the grouped-GEMM tuner, ``--budget-s``
   and ``--max-configs`` per problem, into a cache of the case; then confirm the choices
   inside up to ``--confirm-steps`` steps of the program (what ``primus-tune confirm --
   program`` does: a choice that does not beat torch's kernel where it runs is dropped);
3. losses: two fresh models (same seed, same batches) for ``--loss-steps`` steps, plain and
   under ``enable(cache)``; the largest relative difference;
4. speed: one model, the sides interleaved in blocks of ``--block-steps`` steps (one
   settling step after each switch, the order rotating): plain (``grouped_mm``), enabled
   with an empty cache (``enable_no_choice``: the override's own cost) and enabled with
   the tuned cache (``tuned``); medians of the step times with quartiles and extremes,
   each enabled side's ratio to plain, its routed and fallback call counts and the calls
   that read ``offs`` on the host (``offs_reads``: each waits for the GPU; none with no
   choice, none where the shape's entries agree on a backend that takes ``offs`` on the
   device); ``mixed_shapes``: shapes whose tuned entries differ by skew bucket (a call of
   one takes its counts from a non-blocking copy, or runs its call site's last choice; a
   site's first call waits for them);
5. ``grouped_share``: from the profiled steps, the GPU time of the kernels that
   ``aten::_grouped_mm`` launches against all kernel time, and Amdahl's bound: the step's
   speedup were they free, and how much faster they must get for the step to reach 1.10x.

    python benchmarks/moe/hf_moe_e2e.py --out benchmarks/results/hf_moe_e2e/h100.json

``--smoke`` runs the CPU sizes for a few steps (one candidate backend, no Triton): it
checks the script, not the hardware. Needs transformers (``pip install 'primus-perf[hf]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

import primus_perf
from benchmarks import ROOT
from benchmarks.moe.moe_e2e import rotated_blocks
from primus_perf.base.devices import current_device, library_versions
from primus_perf.base.files import write_json
from primus_perf.kernels.grouped.router import shape_key
from primus_perf.problems import GroupedGemmProblem
from primus_perf.tuner import core
from primus_perf.tuner.grouped.plugin import GroupedGemmTuner
from primus_perf.tuner.problems_input import gather_problems

EXAMPLE = ROOT / "examples" / "hf_moe_train.py"
CASES = {"qwen3-moe-128e": "qwen3-moe", "mixtral-8e": "mixtral", "deepseek-v3-48e": "deepseek-v3"}
SIDES = ("grouped_mm", "enable_no_choice", "tuned")
BAR = 1.10  # the step speedup asked of the 128-expert model


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("hf_moe_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Run:
    """A model of one case with its optimizer and batches: ``step()`` trains one step."""

    def __init__(self, ex: Any, model: str, preset: str, seq: int, steps: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        torch.manual_seed(0)
        self.net = ex.build(model, preset, None, None, dtype, device)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        vocab = self.net.config.vocab_size
        self.batches = [torch.randint(0, vocab, (1, seq), generator=gen).to(device) for _ in range(steps)]
        self.device, self.i = device, 0

    def step(self) -> tuple[float, float]:
        """(milliseconds, loss) of the next step (the batches cycle)."""
        ids = self.batches[self.i % len(self.batches)]
        self.i += 1
        self._sync()
        t0 = time.perf_counter()
        loss = self.net(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._sync()
        return (time.perf_counter() - t0) * 1e3, float(loss.detach())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        del self.net, self.opt, self.batches
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def profile(run: Run, empty_cache: Path, out_dir: Path) -> tuple[Path, dict[str, float]]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if run.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with primus_perf.enable(empty_cache, kinds=("grouped_gemm",), log=None):
        run.step()  # warm-up outside the trace
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            run.step()
            run.step()
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    return trace, grouped_share(prof, steps=2)


def grouped_share(prof: Any, *, steps: int) -> dict[str, float]:
    """GPU time per profiled step of the kernels ``aten::_grouped_mm`` launches (its own
    kernels: forward and both gradients) against all kernel time: the part of the step
    any grouped-GEMM choice can change."""
    events = prof.key_averages()
    host_names = {e.key for e in events if e.device_type != torch.autograd.DeviceType.CUDA}
    grouped = total = 0.0
    for e in events:
        us = getattr(e, "self_device_time_total", 0.0)
        if e.key == "aten::_grouped_mm":
            grouped += us
        # kernels, copies and fills; not the device spans of record_function annotations,
        # which carry their host range's name (and would count their kernels twice)
        elif e.device_type == torch.autograd.DeviceType.CUDA and e.key not in host_names:
            total += us
    return {"grouped_gpu_ms": round(grouped / 1e3 / steps, 3), "kernels_gpu_ms": round(total / 1e3 / steps, 3)}


def tune(trace: Path, cache: Path, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    t0 = time.perf_counter()
    problems = gather_problems("grouped_gemm", traces=[trace])
    options = {"backends": tuple(args.backends)} if args.backends else {}
    if args.smoke:
        options["sets"] = 1
    tuner = GroupedGemmTuner(device=device.type, triton=args.max_configs > 0, max_configs=args.max_configs, **options)
    result = core.tune(problems, cache=cache, tuners=[tuner], budget_s=args.budget_s)
    chosen = {r.problem.key(): r.chosen for r in result.results}
    by_shape: dict[str, set[str]] = {}
    for key, choice in chosen.items():
        by_shape.setdefault(shape_key(GroupedGemmProblem.from_key(key)), set()).add(choice)
    return {"problems": len(problems), "tune_s": round(time.perf_counter() - t0, 2), "chosen": chosen,
            "shapes": len(by_shape), "mixed_shapes": sorted(k for k, v in by_shape.items() if len(v) > 1)}


def confirm(ex: Any, spec: dict[str, Any], cache: Path, steps: int) -> dict[str, Any]:
    """The tuned choices confirmed inside up to ``steps`` steps of the program (``primus-tune
    confirm``'s ``confirm_run``: each shape's choice against torch's kernel, alternating
    calls; it stops once every shape has its verdict); the cache is corrected in place."""
    from primus_perf.tuner.confirm import confirm_run

    def program(confirmer: Any) -> int:
        run = Run(ex, **spec)
        try:
            run.step()  # allocation, library set-up: its calls are the confirmation's warm-up
            for i in range(steps - 1):
                run.step()
                if i >= 1 and not confirmer.confirming:
                    break
        finally:
            run.close()
        return 0

    out = confirm_run(cache, program, kinds_=("grouped_gemm",))
    return {"kept": out.count("kept"), "dropped": out.count("dropped"), "unconfirmed": out.count("unconfirmed"),
            "rows": [{"problem": r.problem, "entries": r.entries, **r.verdict.figure()} for r in out.rows]}


def losses(ex: Any, spec: dict[str, Any], cache: Path, steps: int) -> dict[str, list[float]]:
    out = {}
    for side in ("grouped_mm", "tuned"):
        run = Run(ex, **spec)
        try:
            if side == "tuned":
                with primus_perf.enable(cache, kinds=("grouped_gemm",), log=None):
                    out[side] = [run.step()[1] for _ in range(steps)]
            else:
                out[side] = [run.step()[1] for _ in range(steps)]
        finally:
            run.close()
    return out


def speed(ex: Any, spec: dict[str, Any], cache: Path, empty: Path, args: argparse.Namespace) -> dict[str, Any]:
    run = Run(ex, **spec)
    caches = {"enable_no_choice": empty, "tuned": cache}
    ms: dict[str, list[float]] = {s: [] for s in SIDES}
    calls = {side: {"routed": 0, "fallback": 0, "offs_reads": 0, "steps": 0} for side in caches}

    def block(side: str, steps: int) -> list[float]:
        if side == "grouped_mm":
            return [run.step()[0] for _ in range(steps)]
        with primus_perf.enable(caches[side], kinds=("grouped_gemm",), log=None) as handle:
            times = [run.step()[0] for _ in range(steps)]
            row = handle.summary()["grouped_gemm"]
        for part in ("routed", "fallback", "offs_reads"):
            calls[side][part] += row.get(part, 0)
        calls[side]["steps"] += steps
        return times

    try:
        for side in SIDES:  # warm-up on every side
            block(side, 1)
        for side in rotated_blocks(SIDES, args.blocks):
            ms[side] += block(side, 1 + args.block_steps)[1:]  # the first step settles
    finally:
        run.close()

    def stats(v: list[float]) -> dict[str, float]:
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        return {"median": round(statistics.median(v), 3), "p25": round(q[0], 3), "p75": round(q[2], 3),
                "min": round(min(v), 3), "max": round(max(v), 3)}

    step_ms = {s: stats(v) for s, v in ms.items()}
    plain = step_ms["grouped_mm"]["median"]
    ratios = {side: round(plain / step_ms[side]["median"], 4) for side in caches}  # > 1: faster than plain
    return {"step_ms": step_ms, "samples_ms": ms, "vs_grouped_mm": ratios, "calls": calls,
            "tuned_calls": calls["tuned"]}


def ceiling(step_ms: float, grouped_ms: float, bar: float = BAR) -> dict[str, float | None]:
    """Amdahl's bound on the step from the grouped GEMMs alone: ``free`` is the step's speedup
    if they took no time; ``needed_for_bar`` the factor they must get faster by for the
    step to reach ``bar`` (None: not even free would do)."""
    rest = step_ms - grouped_ms
    saving = step_ms - step_ms / bar
    return {"step_ms": step_ms, "free": round(step_ms / rest, 4) if rest > 0 else None, "bar": bar,
            "needed_for_bar": round(grouped_ms / (grouped_ms - saving), 3) if grouped_ms > saving else None}


def _line(row: dict[str, Any]) -> str:
    """One case in a terminal or a log: per side the median step (p25-p75) and, for the
    enabled sides, the ratio to plain and the calls routed, left to torch and reading offs."""
    parts = []
    for side in SIDES:
        st = row["step_ms"][side]
        text = f"{side} {st['median']:.2f} ms ({st['p25']:.2f}-{st['p75']:.2f})"
        if side in row["calls"]:
            c = row["calls"][side]
            text += (f" {row['vs_grouped_mm'][side]:.3f}x plain, {c['routed']} routed / {c['fallback']} torch,"
                     f" {c['offs_reads']} offs reads in {c['steps']} steps")
        parts.append(text)
    sh = row["grouped_share"]
    need = sh["needed_for_bar"]
    return (f"{row['case']}: " + "; ".join(parts) + f"; {row['problems']} problems ({row['shapes']} shapes,"
            f" {len(row['mixed_shapes'])} mixed) tuned in {row['tune_s']:.0f} s; max loss diff"
            f" {row['loss_max_rel_diff']:.2e}; grouped GEMMs {sh['grouped_gpu_ms']:.1f} of"
            f" {sh['kernels_gpu_ms']:.1f} GPU ms a step: free they would make the step {sh['free'] or 0:.3f}x,"
            f" {sh['bar']:.2f}x needs them " + (f"{need:.2f}x faster" if need else "to take less than no time"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", "--models", nargs="*", choices=sorted(CASES), default=None, help="default: all")
    ap.add_argument("--backends", nargs="*", default=None,
                    help="non-Triton backends raced against the Triton configs (default: the tuner's)")
    ap.add_argument("--confirm-steps", type=int, default=30,
                    help="at most this many steps confirm the tuned choices in the program (0: none)")
    ap.add_argument("--loss-steps", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--block-steps", type=int, default=5)
    ap.add_argument("--max-configs", type=int, default=4, help="Triton configs raced per problem")
    ap.add_argument("--budget-s", type=float, default=0.3, help="time budget per problem for the final race")
    ap.add_argument("--smoke", action="store_true", help="CPU sizes, few steps: checks the script")
    args = ap.parse_args(argv)
    if args.smoke:
        args.loss_steps, args.blocks, args.block_steps, args.max_configs, args.budget_s = 2, 1, 1, 0, 0.01
        args.confirm_steps = min(args.confirm_steps, 3)
        args.backends = args.backends or ["padded_bmm"]  # one candidate against the default
        device, preset, dtype = torch.device("cpu"), "cpu", torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("the GPU sizes need a GPU; use --smoke on the CPU")
        device, preset, dtype = torch.device("cuda"), "h100", torch.bfloat16
    ex = _example()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.json"
        empty.write_text("")  # an empty cache: every call left to torch
        for case in args.cases or CASES:
            model = CASES[case]
            seq = 16 if args.smoke else ex.MODELS[model]["seq"][preset]
            steps = max(args.loss_steps, 3)
            spec = dict(model=model, preset=preset, seq=seq, steps=steps, dtype=dtype, device=device)
            run = Run(ex, **spec)
            try:
                trace, share = profile(run, empty, Path(tmp) / case)
            finally:
                run.close()
            cache = Path(tmp) / f"{case}.json"
            tuned = tune(trace, cache, args, device)
            if args.confirm_steps:
                tuned["confirmation"] = confirm(ex, spec, cache, args.confirm_steps)
            loss = losses(ex, spec, cache, args.loss_steps)
            worst = max(abs(a - b) / abs(b) for a, b in zip(loss["tuned"], loss["grouped_mm"]))
            sp = speed(ex, spec, cache, empty, args)
            med = {s: v["median"] for s, v in sp["step_ms"].items()}
            row = {"case": case, "tuned_ms": med["tuned"],
                   "baselines": {"grouped_mm": med["grouped_mm"], "enable_no_choice": med["enable_no_choice"]},
                   "speedup_vs_grouped_mm": sp["vs_grouped_mm"]["tuned"],
                   "no_choice_vs_grouped_mm": sp["vs_grouped_mm"]["enable_no_choice"],
                   "loss_max_rel_diff": worst, "losses": loss, "seq": seq, **tuned, **sp,
                   "grouped_share": {**share, **ceiling(med["grouped_mm"], share["grouped_gpu_ms"])}}
            rows.append(row)
            print(_line(row), flush=True)
            # after every case: a run stopped at its time limit keeps the cases it finished
            write_json(args.out, {"benchmark": "hf_moe_e2e", "device": current_device().to_dict(),
                                  "versions": library_versions(), "smoke": args.smoke, "blocks": args.blocks,
                                  "block_steps": args.block_steps, "budget_s": args.budget_s,
                                  "max_configs": args.max_configs, "backends": args.backends, "rows": rows}, default=float)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
