"""Eight GPUs of one machine: llama3-70b with FSDP2 over the eight and with TP=8,
deepseek-v3 with EP=8, preflight across the GPUs, and tuning with one worker per GPU.

    python benchmarks/trainer/eight_gpus.py --out runs/eight_gpus   # its summary.json: results/eight_gpus/8xh200.json
    python benchmarks/trainer/eight_gpus.py --smoke --out /tmp/eight_cpu   # 8 gloo ranks, tiny models
    python benchmarks/trainer/eight_gpus.py --smoke --gpus 2 --out /tmp/two_cpu

Per layout (``layouts``: FSDP2, TP and EP over all ``--gpus``): ``primus-profile run``
under torchrun traces every rank; the traces are analyzed together (per-rank breakdown and the slowest rank, collectives and
their skew, all-to-all bytes and bandwidth per rank, expert load) into
``<layout>/analysis.json`` and ``<layout>/report.html``; tokens/s and MFU are the run's
(its manifest: the steps after the profiler window). Then:

- losses: each layout trains a smaller model of its preset from the same seed for
  ``--loss-steps`` steps against one process with the same global batch (``matches``);
  the largest relative difference per layout (bf16 tolerance on GPUs, 1e-4 on the CPU);
- ep, tuned vs default: the grouped GEMMs of its trace are tuned on every GPU
  (``primus-tune grouped-gemm --trace --gpus N``), then ``primus-train`` runs without and
  with the cache, alternated ``--rounds`` times: median tokens/s of each and the ratio;
- ``primus-profile preflight`` under torchrun on the same ranks (JSON and HTML);
- ``benchmarks/gemm/multi_gpu_tuning.py --gpus N --all-problems``: the wall-clock speedup of
  N tuning workers over one (``--smoke``: CPU workers on small problems).

Everything lands under ``--out``; ``summary.json`` holds the figures (a run of some
``--layouts`` or with ``--skip`` adds to the summary already there: one device call each). ``--smoke`` runs the
same steps on the CPU over gloo with tiny models: it checks the 8-way code paths and the
script, not the hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

import torch

from benchmarks import ROOT
from benchmarks.trainer.trainer_tp import run as train
from primus_perf import TuningCache, analyze
from primus_perf.base.files import write_json

ENV = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")

LAYOUTS = ("fsdp", "tp", "ep")
TINY_TP = ["model.n_heads=8", "model.n_kv_heads=8"]  # tiny's 4 heads do not split 8 ways
MATCH_70B = ["--layers", "1", "train.seq_len=1024"]
MATCH_DSV3 = ["--layers", "2", "model.moe.first_k_dense=1", "model.moe.n_experts=32", "model.vocab_size=32000",
              "train.seq_len=1024"]


def layouts(n: int, smoke: bool) -> dict[str, tuple[str, list[str]]]:
    """Layout -> (preset, overrides) of its profiled run over ``n`` ranks; the GPU models are
    overridden to fit 8 GPUs."""
    if smoke:
        return {"fsdp": ("tiny", [f"parallel.dp_shard={n}", f"train.micro_batch={8 // n}"]),
                "tp": ("tiny", [*TINY_TP, f"parallel.tp={n}"]),
                "ep": ("tiny-moe", [f"parallel.ep={n}", f"train.micro_batch={8 // n}"])}
    long = ["train.seq_len=4096", "train.micro_batch=1"]
    return {"fsdp": ("llama3-70b", ["--layers", "8", "parallel.tp=1", f"parallel.dp_shard={n}", *long]),
            "tp": ("llama3-70b", ["--layers", "8", f"parallel.tp={n}", *long]),
            "ep": ("deepseek-v3", ["--layers", "3", "model.moe.first_k_dense=1", "model.vocab_size=32000",
                                   f"parallel.ep={n}", *long])}


def matches(n: int, smoke: bool) -> dict[str, tuple[str, list[str], list[str]]]:
    """Layout -> (preset, overrides over ``n`` ranks, overrides of one process): one global batch."""
    if smoke:
        return {"fsdp": ("tiny", [f"parallel.dp_shard={n}", f"train.micro_batch={8 // n}"], ["train.micro_batch=8"]),
                "tp": ("tiny", [*TINY_TP, f"parallel.tp={n}"], TINY_TP),
                "ep": ("tiny-moe", [f"parallel.ep={n}", f"train.micro_batch={8 // n}"], ["train.micro_batch=8"])}
    return {"fsdp": ("llama3-70b", [*MATCH_70B, "parallel.tp=1", f"parallel.dp_shard={n}", "train.micro_batch=1"],
                     [*MATCH_70B, "parallel.tp=1", f"train.micro_batch={n}"]),
            "tp": ("llama3-70b", [*MATCH_70B, f"parallel.tp={n}", f"train.micro_batch={n}"],
                   [*MATCH_70B, "parallel.tp=1", f"train.micro_batch={n}"]),
            "ep": ("deepseek-v3", [*MATCH_DSV3, f"parallel.ep={n}", "train.micro_batch=1"],
                   [*MATCH_DSV3, f"train.micro_batch={n}"])}


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def command(cmd: list[str], log: Path, timeout: int = 1800) -> int:
    """Run ``cmd`` with its output in ``log``; its exit code."""
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=ENV, timeout=timeout).returncode


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def profiled(name: str, preset: str, overrides: list[str], nproc: int, out: Path, extra: list[str]) -> dict:
    """Trace every rank, analyze the traces together, write the report."""
    run_dir = out / name
    code = command([*torchrun(nproc), "-m", "primus_perf.cli.profile", "run", "--config", preset,
                    "--out", str(run_dir), "--overwrite", "--steps", "2", "--warmup", "1", "--wait", "0",
                    "--baseline", "3", "--after", "3", *overrides, *extra], out / f"{name}_run.log")
    if code != 0:
        return {"returncode": code, "log_tail": tail(out / f"{name}_run.log")}
    a = analyze([run_dir])
    doc = a.to_json()
    write_json(run_dir / "analysis.json", doc, default=float)
    report = command([sys.executable, "-m", "primus_perf.cli.profile", "report", str(run_dir),
                      "-o", str(run_dir / "report.html")], out / f"{name}_report.log")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {
        "returncode": 0, "report_returncode": report, "ranks": a.ranks,
        "tokens_per_s": manifest.get("tokens_per_s"), "mfu": manifest.get("mfu"),
        "step_time_s": manifest.get("step_time_s"),
        "ranks_summary": doc.get("ranks_summary", []),
        "slowest_rank": next((r["rank"] for r in doc.get("ranks_summary", []) if r.get("slowest")), None),
        "collectives": doc.get("collectives", [])[:8],
        "collective_bandwidth": doc.get("collective_bandwidth", []),
        "collective_ranks": doc.get("collective_ranks", []),
        "expert_load": doc.get("expert_load"),
        "notes": doc.get("notes", []),
    }


def losses_match(name: str, preset: str, many: list[str], one: list[str], nproc: int, steps: int,
                 out: Path, extra: list[str]) -> dict:
    common = ["--config", preset, "--steps", str(steps), *extra]
    multi = train([*common, *many], nproc, out / f"{name}_match_{nproc}.jsonl")
    single = train([*common, *one], 1, out / f"{name}_match_1.jsonl")
    result = {"many": multi, "one": single}
    if "losses" in multi and "losses" in single:
        result["max_rel_loss_diff"] = max(abs(x - y) / abs(y) for x, y in zip(multi["losses"], single["losses"]))
    return result


def tuned_vs_default(preset: str, overrides: list[str], nproc: int, out: Path, smoke: bool,
                     extra: list[str], steps: int, rounds: int) -> dict:
    """Tune the ep trace's grouped GEMMs, then train without and with the cache, alternated."""
    cache = out / "ep_cache.json"
    tune = ["--device", "cpu", "--no-triton", "--budget-s", "0.05"] if smoke else ["--gpus", str(nproc)]
    code = command([sys.executable, "-m", "primus_perf.cli.tune", "grouped-gemm", "--trace", str(out / "ep"),
                    "--cache", str(cache), *tune], out / "ep_tune.log")
    if code != 0:
        return {"tune_returncode": code, "log_tail": tail(out / "ep_tune.log")}
    sides: dict[str, list[float]] = {"default": [], "tuned": []}
    warm = min(2, steps - 1)
    for i in range(rounds):
        for side in ("default", "tuned") if i % 2 == 0 else ("tuned", "default"):
            cached = [f"tuning.cache={cache}"] if side == "tuned" else []
            r = train(["--config", preset, "--steps", str(steps), *overrides, *extra, *cached], nproc,
                      out / f"ep_{side}_{i}.jsonl")
            if "tokens_per_s" not in r:
                return {"failed_run": r}
            sides[side] += r["tokens_per_s"][warm:]
    med = {s: statistics.median(v) for s, v in sides.items()}
    return {"tuned_problems": len(TuningCache(cache).entries()), "median_tokens_per_s": med, "samples": sides,
            "tuned_vs_default": med["tuned"] / med["default"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="8 gloo ranks on the CPU, tiny models: tests the script")
    ap.add_argument("--gpus", type=int, default=8, help="ranks (--smoke: CPU processes, 2, 4 or 8)")
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--loss-steps", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=8, help="steps of each tuned/default run")
    ap.add_argument("--rounds", type=int, default=2, help="tuned/default alternations")
    ap.add_argument("--skip", nargs="*", default=[], choices=["losses", "tuning", "preflight", "multi-gpu"])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    n = a.gpus
    if a.smoke:
        if n not in (2, 4, 8):
            print("error: --smoke runs 2, 4 or 8 ranks (tiny's batch of 8 splits over them)", file=sys.stderr)
            return 2
        extra = ["train.device=cpu"]
        a.loss_steps, a.train_steps, a.rounds, device = min(a.loss_steps, 5), min(a.train_steps, 3), 1, "cpu"
    else:
        if torch.cuda.device_count() < a.gpus:
            print(f"error: needs {a.gpus} GPUs (or --smoke)", file=sys.stderr)
            return 2
        extra, device = [], torch.cuda.get_device_name(0)
    a.out.mkdir(parents=True, exist_ok=True)
    runs, match = layouts(n, a.smoke), matches(n, a.smoke)
    summary = a.out / "summary.json"  # a run of some layouts adds to an earlier run's summary
    result: dict = json.loads(summary.read_text()) if summary.exists() else {"layouts": {}}
    result.update({"benchmark": "eight_gpus", "smoke": a.smoke, "device": device, "ranks": n,
                   "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip}})
    for name in a.layouts:
        preset, overrides = runs[name]
        r = result["layouts"][name] = {"preset": preset, "overrides": overrides,
                                       "profiled": profiled(name, preset, overrides, n, a.out, extra)}
        p = r["profiled"]
        print(f"{name}: {preset} {' '.join(overrides)}: " + (
            f"{p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu'] if p['mfu'] is None else format(p['mfu'], '.1%')},"
            f" {len(p['ranks'])} ranks analyzed, slowest rank {p['slowest_rank']}" if p["returncode"] == 0
            else f"failed ({p['returncode']})"), flush=True)
        if "losses" not in a.skip:
            mp, many, one = match[name]
            r["losses"] = losses_match(name, mp, many, one, n, a.loss_steps, a.out, extra)
            print(f"{name}: losses vs one process, largest relative difference "
                  f"{r['losses'].get('max_rel_loss_diff', 'n/a')}", flush=True)
        if name == "ep" and "tuning" not in a.skip and p["returncode"] == 0:
            r["tuning"] = tuned_vs_default(preset, overrides, n, a.out, a.smoke, extra, a.train_steps, a.rounds)
            print(f"ep: tuned vs default tokens/s {r['tuning'].get('tuned_vs_default', 'n/a')}", flush=True)
    if "preflight" not in a.skip:
        code = command([*torchrun(n), "-m", "primus_perf.cli.profile", "preflight", "--json",
                        str(a.out / "preflight.json"), "-o", str(a.out / "preflight.html")], a.out / "preflight.log")
        report = json.loads((a.out / "preflight.json").read_text()) if (a.out / "preflight.json").exists() else {}
        result["preflight"] = {"returncode": code, "failed": [c for c in report.get("checks", [])
                                                              if c.get("status") not in ("ok", "info")]}
        print(f"preflight over {n} ranks: exit {code}, {len(result['preflight']['failed'])} check(s) flagged")
    if "multi-gpu" not in a.skip:
        mg = a.out / "multi_gpu_tuning.json"
        args = ["--smoke"] if a.smoke else ["--all-problems"]
        code = command([sys.executable, str(ROOT / "benchmarks" / "gemm" / "multi_gpu_tuning.py"), *args, "--gpus", str(n),
                        "--out", str(mg)], a.out / "multi_gpu_tuning.log")
        data = json.loads(mg.read_text()) if mg.exists() else {}
        result["multi_gpu_tuning"] = {"returncode": code, **{k: data.get(k) for k in (
            "problems", "one_gpu_s", "multi_gpu_s", "speedup", "one_gpu_startup_s", "multi_gpu_startup_s")}}
        print(f"tuning with {n} workers: {result['multi_gpu_tuning']}")
    write_json(summary, result, indent=1, default=float)
    print(f"wrote {summary}")
    failed = [name for name in a.layouts if result["layouts"][name]["profiled"]["returncode"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
