"""Check the analyzer's top recommendation against the measured saving of applying it.

    python benchmarks/analyzer/recommendation_check.py --config llama3-8b --layers 4 \\
        --out-dir runs/reccheck train.seq_len=4096 train.micro_batch=2      # on the GPU

1. ``primus-profile run`` profiles the trainer (``OUT/base``), ``analyze`` ranks the
   recommendations; the top one that names a trainer config key (``train.compile=true``,
   ...) is the one checked.
2. ``primus-train`` runs the base config and the config with that key, alternately
   (``--pairs`` times each, so both sides see the same clocks and thermals); each run's
   median step time after ``--skip`` warm-up steps.
3. Measured saving, in ms per step of the base run's tokens (what every estimate is in):

   - a key that keeps the tokens per step (``train.compile=true``, a backend, ...): median
     base step - median applied step, at equal tokens;
   - ``train.micro_batch=N`` (the base run's M): the applied step carries N/M times the
     tokens, so its time per token is expressed per base step: median base step - median
     applied step x M/N (a larger micro-batch that does not fit in memory fails the check).

   The estimate is within the bar when ``|estimate - measured| <= 30% of measured``.

Writes ``OUT/recommendation_check.json`` (the recommendation, both sides' step times, the
token ratio, the measured saving and the speedup per token) and prints one line per run.
Every command it runs is printed first.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

BAR = 0.3
_KEY = re.compile(r"^set ((?:train|model|parallel|tuning)\.[a-z_]+=[^\s,;()]+)")  # "set train.compile=true (...)"


def _run(cmd: list[str]) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _median_step(log: Path, skip: int) -> float:
    steps = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    times = [s["step_time_s"] for s in steps[skip:]]
    if not times:
        sys.exit(f"{log}: no steps after the first {skip}")
    return statistics.median(times)


def _token_ratio(key: str, manifest: dict) -> float:
    """Tokens per step of the applied run over the base run's: N/M for ``train.micro_batch=N``
    (M from the profiled run's config), 1 for every other key."""
    name, _, value = key.partition("=")
    if name != "train.micro_batch":
        return 1.0
    base = ((manifest.get("config") or {}).get("train") or {}).get("micro_batch")
    if not isinstance(base, int) or base <= 0:
        sys.exit("train.micro_batch: the profiled run's manifest does not record its micro-batch")
    return int(value) / base


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out-dir", default="runs/reccheck")
    p.add_argument("--steps", type=int, default=30, help="steps per training run")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of each run's median")
    p.add_argument("--pairs", type=int, default=2, help="base/applied runs, alternating")
    p.add_argument("overrides", nargs="*", help="config overrides of the base run, key=value")
    args = p.parse_args()

    from primus_perf.tracelens.analyze import analyze

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = ["--config", args.config, "--layers", str(args.layers)]
    _run(["primus-profile", "run", *base, "-o", str(out / "base"), "--overwrite", *args.overrides])
    a = analyze([out / "base"])
    recs = a.recommendations.to_dict(orient="records")
    for i, r in enumerate(recs, 1):
        print(f"{i}. {r['category']}: ~{r['estimated_saving_ms']:.2f} ms/step; do: {r['action']}")
    rec = next(((r, m.group(1)) for r in recs if (m := _KEY.match(r["action"]))), None)
    if rec is None:
        sys.exit("no recommendation names a trainer config key: nothing to apply")
    r, key = rec
    if r is not recs[0]:
        print(f"note: the top recommendation ({recs[0]['category']}) names no config key; checking {r['category']}")
    times: dict[str, list[float]] = {"base": [], "applied": []}
    for i in range(args.pairs):
        for side, extra in (("base", []), ("applied", [key])):
            log = out / f"{side}_{i}.jsonl"
            try:
                _run(["primus-train", *base, "--steps", str(args.steps), "--json-log", str(log), *args.overrides,
                      *extra])
            except subprocess.CalledProcessError as e:  # e.g. a larger micro-batch out of memory
                sys.exit(f"the {side} run failed (exit {e.returncode}): nothing measured")
            times[side].append(_median_step(log, args.skip))
            print(f"{side} run {i}: median step {times[side][-1] * 1e3:.2f} ms", flush=True)
    base_s, applied_s = statistics.median(times["base"]), statistics.median(times["applied"])
    tokens = _token_ratio(key, a.manifest)  # applied tokens per step / base tokens per step
    applied_s /= tokens  # per step of the base run's tokens
    measured_ms = (base_s - applied_s) * 1e3
    estimate_ms = float(r["estimated_saving_ms"])
    within = measured_ms > 0 and abs(estimate_ms - measured_ms) <= BAR * measured_ms
    result = {"device": a.device, "versions": a.versions, "config": args.config, "layers": args.layers,
              "overrides": args.overrides, "recommendation": r, "applied": key, "top": r is recs[0],
              "base_step_s": times["base"], "applied_step_s": times["applied"], "token_ratio": tokens,
              "measured_saving_ms": measured_ms,
              "estimated_saving_ms": estimate_ms, "speedup": base_s / applied_s, "within_bar": within, "bar": BAR}
    (out / "recommendation_check.json").write_text(json.dumps(result, indent=1, default=str))
    per = " (per base step's tokens)" if tokens != 1 else ""
    print(f"{r['category']} ({key}): estimated {estimate_ms:.2f} ms, measured {measured_ms:.2f} ms per step{per} "
          f"({base_s / applied_s:.3f}x); within {BAR:.0%}: {within}")


if __name__ == "__main__":
    main()
