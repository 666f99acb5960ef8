"""Output that must not mislead: GEMM passes (fwd, dgrad, wgrad), FLOPs in a unit that shows
them, the profiler's overhead only where it stands out of the step-to-step spread."""

from __future__ import annotations

from pathlib import Path

from primus_perf.cli.profile_analysis import _tflop
from primus_perf.cli.profile_capture import overhead_line
from primus_perf.tracelens.analyze import analyze

H100 = Path(__file__).parents[1] / "data" / "traces" / "h100_llama3-8b_l2_s1024_cudnn.json.gz"


def test_gemm_rows_say_fwd_dgrad_or_wgrad() -> None:
    g = analyze([H100]).gemm_problems
    rows = {r.problem.row_major_shapes()[:3]: r.direction for r in g.itertuples()}
    forward = [shape for shape, direction in rows.items() if direction == "fwd"]
    assert forward and set(rows.values()) == {"fwd", "dgrad", "wgrad"}
    for m, n, k in forward:  # y = x W^T (M tokens, N out, K in): dX = dY W (M, K, N), dW = dY^T X (N, K, M)
        assert rows.get((m, k, n)) == "dgrad" and rows.get((n, k, m)) == "wgrad", (m, n, k)


def test_flops_are_shown_in_a_unit_that_shows_them() -> None:
    assert _tflop(None) == "FLOPs unknown"
    assert _tflop(2.5e12) == "2.50 TFLOP/step"
    assert _tflop(1.41e9) == "1.41 GFLOP/step"
    assert _tflop(3e6) == "3.00 MFLOP/step"


def _steps(**phases: list[float]) -> list[dict]:
    return [{"phase": p, "time_s": t} for p, times in phases.items() for t in times]


def test_profiler_overhead_is_claimed_only_outside_the_spread() -> None:
    clear = overhead_line(_steps(baseline=[9.0, 1.0, 1.01, 0.99], active=[1.3, 1.31, 1.29], wait=[1.0, 1.02]))
    assert "recorded steps +30.0%" in clear and "outside the window: not measurable" in clear
    noisy = overhead_line(_steps(baseline=[9.0, 0.5, 2.0], active=[0.3, 1.9], wait=[1.0, 1.1]))
    assert "recorded steps: not measurable, within the step-to-step spread" in noisy and "%" not in noisy
    faster = overhead_line(_steps(baseline=[9.0, 2.0, 2.1, 1.9], active=[1.2, 1.25], wait=[1.3, 1.28]))
    assert "%" not in faster and faster.count("not measurable, faster than the unprofiled steps") == 2, faster
    few = overhead_line(_steps(baseline=[2.5], active=[0.5], after=[2.6]))
    assert few.count("not measured (fewer than 2 steps") == 2


def _every_field_differs() -> list:
    """GEMM problems whose keys differ in one field each from a base problem, every field."""
    from dataclasses import replace

    from primus_perf.problems import GemmProblem

    base = GemmProblem.from_row_major(8944, 1024, 1024, b_transposed=True)
    variants = [base, replace(base, epilogue="bias"), replace(base, epilogue="gelu_bias"),
                replace(base, dtype_c="f32", dtype_d="f32"), replace(base, compute="tf32", dtype_a="f32", dtype_b="f32",
                                                                   dtype_c="f32", dtype_d="f32"),
                replace(base, lda=2048), replace(base, ldb=2048), replace(base, ldc=2048, ldd=2048),
                replace(base, ldd=4096), replace(base, trans_a=False, lda=1024), replace(base, trans_b=True, ldb=8944),
                replace(base, m=2048, lda=1024, ldc=2048, ldd=2048), replace(base, n=64), replace(base, k=512, lda=512),
                replace(base, batch=2), replace(base, batch=2, stride_a=2 << 20)]
    keys = [p.key() for p in variants]
    assert len(set(keys)) == len(keys)
    return variants


def test_labels_are_unique_over_problems_whose_keys_differ_in_every_field() -> None:
    from primus_perf.tracelens.analyses.problems import _labels

    problems = _every_field_differs()
    labels = _labels(problems, [p.key() for p in problems])
    assert len(set(labels)) == len(labels), labels
    # the two problems of the report that once shared a label: bias against none
    assert labels[0] != labels[1] and "+bias" in labels[1]
    # one problem under two directions keeps one label
    assert _labels(problems[:1] * 2, [problems[0].key()] * 2) == [str(problems[0])] * 2


def test_one_label_for_every_command_and_gemm_problem_reads_it_back(capsys) -> None:
    """--dry-run prints each problem by the label analyze, report, cache show and the tuners
    print (str(problem)), then its key; `primus-tune gemm --problem LABEL` reads a packed
    GEMM's label back as the same problem."""
    from primus_perf.cli.tune_run import list_problems
    from primus_perf.problems import GemmProblem

    problems = _every_field_differs()
    list_problems(problems + problems[:1], "GEMM")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:len(problems)] == [f"{p}  {p.key()}" for p in problems]
    for p in problems:
        M, N, K, a_t, b_t = p.row_major_shapes()
        packed = GemmProblem.from_row_major(M, N, K, a_transposed=a_t, b_transposed=b_t, dtype=p.dtype_a)
        if packed == p:
            assert GemmProblem.from_spec(str(p)) == p
            assert GemmProblem.from_spec(f"{M},{N},{K},{str(p).split()[2]},{p.dtype_a}") == p
