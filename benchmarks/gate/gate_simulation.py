"""The regression gate's error rates in a seeded simulation (CPU, seconds): detection of a
true +5% change and false alarms with no change, for 5, 10, 20 and 40 samples a side at 2%
and 10% noise, plus the sample sizes the gate refuses at each alpha. Writes
``benchmarks/results/gate_simulation/cpu.json``; ``tests/gate/test_gate.py`` holds the key rates.

    python benchmarks/gate/gate_simulation.py [--trials 1000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from primus_perf.base.files import write_text
from primus_perf.gate.simulation import smallest_window, table

OUT = Path(__file__).resolve().parents[1] / "results" / "gate_simulation" / "cpu.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = table(trials=args.trials)
    result["default_profile_window"] = smallest_window(trials=args.trials)
    write_text(args.out, json.dumps(result, indent=1) + "\n")
    for row in result["rows"]:
        print(f"n={row['n']:>2} cv={row['cv']:.0%}: detection {row['detection']:.3f}, "
              f"false alarm {row['false_alarm']:.3f}, smallest p {row['min_p']:.2g}")
    print(f"refused: {result['refused']}; default profiled window: {result['default_profile_window']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
