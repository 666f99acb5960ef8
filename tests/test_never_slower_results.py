"""The committed never-slower results (``benchmarks/never_slower.py`` on an H100) against the
claims their caches make: every problem whose confirmed cache entry says it runs faster than
the baseline in the step must add up to a step saving the step-level A/B bears out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "never_slower_h100.json"
ROWS = json.loads(RESULTS.read_text())["rows"]


def _kept_claims(row: dict) -> list[dict]:
    """The cache entries of ``row`` that claim an in-step gain (verdict kept)."""
    out = []
    for entry in (row.get("cache") or {}).get("entries", []):
        ins = entry.get("in_step") or {}
        if ins.get("verdict") == "kept":
            out.append({"key": entry["problem_key"], **ins})
    return out


def test_rows_have_the_documented_shape() -> None:
    assert ROWS
    for row in ROWS:
        assert isinstance(row["case"], str) and row["tuned_ms"] > 0
        assert row["baselines"] and all(ms > 0 for ms in row["baselines"].values())


# the trainer rows: they record each problem's calls per step and the step A/B's block pairs
STEP_AB = [r for r in ROWS if _kept_claims(r) and "calls_per_step" in r]


def test_the_trainer_rows_with_claims_are_checked() -> None:
    assert len(STEP_AB) >= 2


@pytest.mark.parametrize("row", STEP_AB, ids=lambda r: r["case"])
def test_in_step_claims_agree_with_the_step_level_ab(row: dict) -> None:
    """Sum over the kept entries of (baseline - choice) per call x calls per step is the
    saving the claims predict; the trainer's step A/B (tuned against its default backend,
    block pairs) must contain it within the spread of its block pairs."""
    claims = _kept_claims(row)
    for c in claims:
        assert c["speedup"] > 1 and c["baseline_ms"] > c["choice_ms"], c
        assert c["low"] <= c["speedup"] <= c["high"], c
    calls = row["calls_per_step"]
    predicted = sum((c["baseline_ms"] - c["choice_ms"]) * calls.get(c["key"], 0) for c in claims)
    saving = row["saving_vs_default_ms"]
    assert predicted == pytest.approx(saving["predicted"], rel=1e-9)
    pairs = saving["block_pairs_ms"]
    assert len(pairs) >= 3
    spread = max(pairs) - min(pairs)
    assert abs(predicted - saving["measured"]) <= spread, (predicted, saving["measured"], pairs)


def test_no_claim_says_more_than_the_whole_step_could_give() -> None:
    """A claimed per-call saving times the calls per step never exceeds the tuned side's step
    (the kind of claim a cold or launch-bound timing makes: "12x" on a kernel of a few us)."""
    for row in ROWS:
        calls = row.get("calls_per_step") or {}
        for c in _kept_claims(row):
            assert (c["baseline_ms"] - c["choice_ms"]) * calls.get(c["key"], 0) < row["tuned_ms"], (row["case"], c)


def test_benchmark_smoke(tmp_path: Path) -> None:
    """``never_slower.py --smoke moe``: a tiny MoE tuned, confirmed in its steps and timed
    against every fixed backend; one row of the documented shape."""
    import os
    import subprocess
    import sys

    out = tmp_path / "ns.json"
    script = RESULTS.parents[1] / "never_slower.py"
    r = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out), "moe"], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "tiny-moe/a" and set(row["baselines"]) == {"loop", "grouped_mm", "triton"}
    assert row["tuned_ms"] > 0 and "rows" in row["confirmation"]
