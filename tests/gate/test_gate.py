from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from primus_perf.gate import gate as g
from primus_perf.gate.stats import mann_whitney_greater

TRIALS = 2000


def _simulate(true_change: float, *, trials: int = TRIALS, n: int = 20, cv: float = 0.02, seed: int) -> float:
    """Fraction of trials in which the gate reports a regression."""
    rng = np.random.default_rng(seed)
    fails = 0
    for _ in range(trials):
        base = 1.0 + cv * rng.standard_normal(n)
        cand = (1.0 + true_change) * (1.0 + cv * rng.standard_normal(n))
        v = g.compare_metric("step_time", base, cand, bootstrap=False)
        fails += v.regression
    return fails / trials


def test_catches_five_percent_regression_in_at_least_95_percent_of_trials() -> None:
    rate = _simulate(0.05, seed=1)
    assert rate >= 0.95, rate


def test_no_change_fails_at_most_2_percent_of_trials() -> None:
    rate = _simulate(0.0, seed=2)
    assert rate <= 0.02, rate


def test_heavy_tailed_noise_does_not_fail_no_change() -> None:
    # 2% CV plus 10% of steps 30% slower (stragglers) on both sides.
    rng = np.random.default_rng(3)
    fails = 0
    for _ in range(500):
        sides = []
        for _side in range(2):
            x = 1.0 + 0.02 * rng.standard_normal(20)
            x[rng.random(20) < 0.1] *= 1.3
            sides.append(x)
        fails += g.compare_metric("step_time", sides[0], sides[1], bootstrap=False).regression
    assert fails / 500 <= 0.02


def test_small_but_significant_shift_passes_the_minimum_effect() -> None:
    rng = np.random.default_rng(4)
    base = 1.0 + 0.002 * rng.standard_normal(50)
    cand = 1.01 * (1.0 + 0.002 * rng.standard_normal(50))
    v = g.compare_metric("step_time", base, cand)
    assert v.p_value < 1e-6  # clearly significant...
    assert not v.regression  # ...but below the 3% allowed


def test_mann_whitney_matches_known_values() -> None:
    # Complete separation, n1 = n2 = 5: U = 25, var = 25 * 11 / 12, z = 12 / sqrt(var);
    # scipy.stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic") = 0.00609.
    x, y = np.arange(6, 11.0), np.arange(1, 6.0)
    p = mann_whitney_greater(x, y)
    assert p == pytest.approx(0.00609, abs=2e-5)
    assert mann_whitney_greater(y, x) > 0.98
    # All ties: no evidence either way.
    assert mann_whitney_greater(np.ones(5), np.ones(5)) == 0.5


def test_throughput_metrics_are_higher_is_better() -> None:
    rng = np.random.default_rng(5)
    base = 1000 * (1 + 0.01 * rng.standard_normal(20))
    worse = 900 * (1 + 0.01 * rng.standard_normal(20))
    v = g.compare_metric("tokens_per_s", base, worse)
    assert v.regression and v.change > 0.09
    v2 = g.compare_metric("tokens_per_s", worse, base)
    assert not v2.regression and v2.improvement


def _samples(path: Path, values: list[float], *, device: str = "NVIDIA H100 80GB HBM3", **extra) -> Path:
    data = {
        "schema": g.SAMPLES_SCHEMA,
        "config": "tiny",
        "device": {"name": device, "arch": "sm_90", "compute_units": 132, "world_size": 1},
        "versions": {"torch": "2.11"},
        "metrics": {"step_time": values, "gpu_time.gemm": values},
        **extra,
    }
    path.write_text(json.dumps(data))
    return path


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    from inprocess import completed

    return completed(["profile", "gate", *args])


def test_gate_cli_exit_codes(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    base = _samples(tmp_path / "b.json", list(0.1 * (1 + 0.02 * rng.standard_normal(20))))
    same = _samples(tmp_path / "s.json", list(0.1 * (1 + 0.02 * rng.standard_normal(20))))
    slow = _samples(tmp_path / "c.json", list(0.11 * (1 + 0.02 * rng.standard_normal(20))))
    other = _samples(tmp_path / "o.json", [0.1] * 20, device="NVIDIA H200")
    garbage = tmp_path / "g.json"
    garbage.write_text("{not json")

    r = _run_cli("--baseline", str(base), "--candidate", str(same))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout

    r = _run_cli("--baseline", str(base), "--candidate", str(slow), "--max-regression", "3%")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "REGRESSION" in r.stdout

    # A 10% regression passes when 15% is allowed.
    r = _run_cli("--baseline", str(base), "--candidate", str(slow), "--max-regression", "15%")
    assert r.returncode == 0, r.stdout + r.stderr

    r = _run_cli("--baseline", str(base), "--candidate", str(other))
    assert r.returncode == 2 and "different devices" in r.stderr
    assert "Traceback" not in r.stderr

    r = _run_cli("--baseline", str(base), "--candidate", str(garbage))
    assert r.returncode == 2 and "not valid JSON" in r.stderr

    r = _run_cli("--baseline", str(base), "--candidate", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "not found" in r.stderr

    r = _run_cli("--baseline", str(base), "--candidate", str(same), "--metric", "nope")
    assert r.returncode == 2 and "nope" in r.stderr

    r = _run_cli("--baseline", str(base), "--candidate", str(slow), "--metric", "step_time",
                 "--metric", "gpu_time.gemm", "--json", "-")
    assert r.returncode == 1
    out = json.loads(r.stdout)
    assert [v["metric"] for v in out["verdicts"]] == ["step_time", "gpu_time.gemm"]
    assert out["verdicts"][0]["regression"] is True


def test_too_few_samples_is_bad_input(tmp_path: Path) -> None:
    base = _samples(tmp_path / "b.json", [0.1, 0.1, 0.1])
    with pytest.raises(g.GateInputError, match="at least"):
        g.gate(base, base)


def test_parse_fraction() -> None:
    assert g.parse_fraction("3%") == pytest.approx(0.03)
    assert g.parse_fraction("0.05") == pytest.approx(0.05)
    with pytest.raises(g.GateInputError):
        g.parse_fraction("three")


def test_bench_samples_the_trainer_and_gates_against_itself(tmp_path: Path) -> None:
    from primus_perf.gate.bench import bench, write_samples

    data = bench("tiny", overrides=["train.seq_len=64"], repeat=6, warmup=1, profile_steps=2)
    # the profiled window runs through the one capture function and the analysis; a CPU has no GPU times
    if data["device"]["name"] == "cpu":
        assert not any(m.startswith("gpu_time.") for m in data["metrics"])
        assert any("no GPU events" in n for n in data["notes"]), data["notes"]
    else:
        assert len(data["metrics"]["gpu_time.total"]) == 2
    assert data["schema"] == g.SAMPLES_SCHEMA and data["config"] == "tiny"
    assert len(data["metrics"]["step_time"]) == 6 and all(t > 0 for t in data["metrics"]["step_time"])
    assert len(data["metrics"]["tokens_per_s"]) == 6
    assert data["device"]["name"] and data["device"]["world_size"] == 1
    assert data["versions"]["torch"]
    path = write_samples(data, tmp_path / "s.json")
    loaded = g.load_samples(path)
    result = g.gate(loaded, loaded, metrics=["step_time", "tokens_per_s"])
    # no regression; 6 samples of a loaded CPU may be too noisy to rule out one past 3%
    assert result.verdict in ("PASS", "INCONCLUSIVE") and result.exit_code in (0, 3)
    assert all(v.change == 0.0 and not v.regression for v in result.verdicts)


def test_bench_cli_rejects_a_bad_config(tmp_path: Path) -> None:
    from inprocess import completed

    r = completed(["profile", "bench", "--config", "no-such-preset", "-o", str(tmp_path / "s.json")])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "s.json").exists()


# --------------------------------------------------------------------------- simulation, refusals


@pytest.fixture(scope="module")
def sim_table() -> dict:
    from primus_perf.gate.simulation import table

    return table(trials=400, seed=11)


def _rate(table: dict, n: int, cv: float, key: str) -> float:
    (row,) = [r for r in table["rows"] if r["n"] == n and r["cv"] == cv]
    return row[key]


def test_simulated_rates_for_5_10_20_40_samples_at_2_and_10_percent_noise(sim_table: dict) -> None:
    assert [(r["n"], r["cv"]) for r in sim_table["rows"]] == [(n, cv) for n in (5, 10, 20, 40) for cv in (0.02, 0.1)]
    assert all(r["false_alarm"] <= 0.02 for r in sim_table["rows"])  # the rule's false alarms stay low
    assert _rate(sim_table, 5, 0.02, "detection") < 0.8  # 5 profiled steps miss a 5% change often
    assert _rate(sim_table, 20, 0.02, "detection") >= 0.97
    assert _rate(sim_table, 40, 0.02, "detection") >= 0.99
    assert _rate(sim_table, 40, 0.1, "detection") < 0.6  # at 10% noise even 40 samples do not suffice
    detections = [_rate(sim_table, n, 0.02, "detection") for n in (5, 10, 20, 40)]
    assert detections == sorted(detections)
    assert sim_table["refused"]["0.005"] == [5] and sim_table["refused"]["0.01"] == []


def test_the_default_profiled_window_is_the_smallest_that_catches_five_percent() -> None:
    from primus_perf.gate.simulation import smallest_window

    assert smallest_window(trials=400) == g.DEFAULT_PROFILE_STEPS


def test_committed_simulation_table_matches_the_rule() -> None:
    data = json.loads((Path(__file__).parents[2] / "benchmarks" / "results" / "gate_simulation" / "cpu.json").read_text())
    assert data["default_profile_window"] == g.DEFAULT_PROFILE_STEPS
    assert data["alpha"] == g.DEFAULT_ALPHA and data["max_regression"] == g.DEFAULT_MAX_REGRESSION


def test_a_comparison_that_cannot_reach_significance_is_refused() -> None:
    from primus_perf.gate.stats import min_p_value

    assert min_p_value(5, 5) == pytest.approx(0.0061, abs=1e-4)
    base, slow = [1.0] * 5, [10.0] * 5  # +900%
    with pytest.raises(g.GateInputError, match=r"smallest possible p is 0.006\d*, not below alpha 0.005"):
        g.compare_metric("step_time", base, slow, alpha=0.005)
    assert g.compare_metric("step_time", base, slow, alpha=0.01).regression


def _doc(values: list[float], **extra) -> dict:
    return {"schema": g.SAMPLES_SCHEMA, "config": "tiny", "overrides": [],
            "device": {"name": "cpu", "arch": "", "compute_units": 2, "world_size": 1},
            "metrics": {"step_time": values}, **extra}


@pytest.mark.parametrize("field,other", [("config", "llama3-8b"), ("overrides", ["model.dim=64"]),
                                         ("device", {"name": "NVIDIA H100", "arch": "sm_90", "compute_units": 132,
                                                     "world_size": 1})])
def test_different_configs_overrides_or_devices_are_refused_unless_allowed(field: str, other) -> None:
    values = list(np.linspace(1.0, 1.01, 10))
    with pytest.raises(g.GateInputError, match="--allow-mismatch"):
        g.gate(_doc(values), _doc(values, **{field: other}))
    result = g.gate(_doc(values), _doc(values, **{field: other}), allow_mismatch=True)
    assert result.passed and any(field.rstrip("s") in n or "device" in n for n in result.notes)


def test_each_sides_noise_is_reported_and_a_noisy_side_gets_a_note() -> None:
    rng = np.random.default_rng(5)
    quiet = list(1.0 + 0.01 * rng.standard_normal(20))
    noisy = list(np.abs(1.0 + 0.4 * rng.standard_normal(20)) + 0.1)
    result = g.gate(_doc(quiet), _doc(noisy))
    (v,) = result.verdicts
    assert v.cv_baseline < 0.02 and v.cv_candidate > 0.2
    assert any("candidate is noisy" in n for n in result.notes)
    assert not any("baseline is noisy" in n for n in result.notes)


# --------------------------------------------------------------------------- inconclusive, extremes


def test_a_slowdown_hidden_by_noise_is_inconclusive_not_a_pass(tmp_path: Path) -> None:
    """The issue's case: +20.9% slower, p above alpha, CV 38-64%: no regression is shown, and
    none past the allowed 3% is ruled out."""
    rng = np.random.default_rng(4)
    base = list(0.1 * np.exp(0.45 * rng.standard_normal(10)))
    slow = list(0.1209 * np.exp(0.45 * rng.standard_normal(10)))
    result = g.gate(_doc(base), _doc(slow))
    (v,) = result.verdicts
    assert not v.regression and v.p_value > 0.01 and v.inconclusive
    assert result.verdict == "INCONCLUSIVE" and not result.passed and result.exit_code == 3
    assert any("inconclusive" in n and "more samples" in n for n in result.notes)
    r = _run_cli("--baseline", str(_samples(tmp_path / "b.json", base)),
                 "--candidate", str(_samples(tmp_path / "c.json", slow)))
    assert r.returncode == 3 and "INCONCLUSIVE" in r.stdout and "PASS" not in r.stdout, r.stdout + r.stderr


def test_quiet_samples_without_a_change_pass_and_rarely_are_inconclusive() -> None:
    rng = np.random.default_rng(8)
    verdicts = [g.compare_metric("step_time", 1 + 0.02 * rng.standard_normal(20), 1 + 0.02 * rng.standard_normal(20))
                for _ in range(200)]
    assert sum(v.inconclusive for v in verdicts) <= 0.1 * len(verdicts)
    assert not any(v.regression for v in verdicts)


def test_the_bootstrap_medians_follow_resampling() -> None:
    """The medians drawn from order statistics have the distribution of resampled medians."""
    from primus_perf.gate.stats import bootstrap_medians

    rng = np.random.default_rng(2)
    for n in (5, 6, 21):
        x = rng.standard_normal(n)
        drawn = bootstrap_medians(x, 100_000, np.random.default_rng(1))
        resampled = np.median(rng.choice(x, size=(100_000, n)), axis=1)
        assert np.percentile(drawn, [2.5, 50, 97.5]) == pytest.approx(np.percentile(resampled, [2.5, 50, 97.5]),
                                                                     abs=0.05)


def test_samples_at_the_end_of_the_float_range_give_a_verdict_without_a_warning() -> None:
    with np.errstate(all="raise"):
        v = g.compare_metric("step_time", [1e308] * 20, [1.5e308] * 19 + [1e308])
    assert v.regression and v.change == pytest.approx(0.5)
    assert g.metric_value("step_time", 1e308) == "1e+308 s"
    with pytest.raises(g.GateInputError, match="too far apart"):
        g.compare_metric("step_time", [1e-308] * 20, [1e308] * 20)


def test_a_million_samples_a_side_are_gated_in_bounded_memory() -> None:
    rng = np.random.default_rng(9)
    v = g.compare_metric("step_time", 1 + 0.02 * rng.standard_normal(1_000_000),
                         1 + 0.02 * rng.standard_normal(1_000_000))
    assert v.verdict == "ok" and v.ci_high - v.ci_low < 0.001
