"""``primus-tune attention`` input handling and trace problem extraction (CPU)."""

from __future__ import annotations

import json
import subprocess

import pytest

from inprocess import completed
from primus_perf.base.errors import UserError
from primus_perf.cli.tune_attention import parse_attention_spec
from primus_perf.problems import AttentionProblem
from primus_perf.tuner.attention.plugin import AttentionTuner


def _cli(*args: str) -> subprocess.CompletedProcess:
    return completed(["tune", "attention", *args])


def test_problem_spec_parses_into_the_trainer_layout() -> None:
    p = parse_attention_spec("4,32,8,4096,128,causal")
    assert p == AttentionProblem(4, 32, 8, 4096, 4096, 128, "bf16", True, "bshd")
    assert parse_attention_spec(" 1, 2, 2, 64, 64, full", "f16").causal is False
    for bad, msg in [
        ("1,2,3", "6 fields"),
        ("1,2,x,4,5,causal", "integers"),
        ("1,2,2,64,64,maybe", "causal or full"),
        ("1,3,2,64,64,causal", "multiple of heads_kv"),
    ]:
        with pytest.raises(UserError, match=msg):
            parse_attention_spec(bad)
    with pytest.raises(UserError, match="head_dim"):
        AttentionTuner().check(parse_attention_spec("1,2,2,64,96,causal"))
    with pytest.raises(UserError, match="bf16 or f16"):
        AttentionTuner().check(parse_attention_spec("1,2,2,64,64,causal", "f32"))


def test_cli_errors_are_one_line_with_exit_code_2() -> None:
    r = _cli("--problem", "1,2,3")
    assert r.returncode == 2 and "6 fields" in r.stderr and "Traceback" not in r.stderr
    r = _cli("--strategy", "random", "--problem", "1,2,2,64,64,causal")
    assert r.returncode == 2 and "grid, tpe" in r.stderr
    r = _cli()
    assert r.returncode == 2 and "nothing to tune" in r.stderr
    r = _cli("--from-trace", "/nonexistent/trace.json")
    assert r.returncode == 2 and "trace not found" in r.stderr


def test_dry_run_lists_the_problems_and_tunes_nothing(tmp_path) -> None:
    cache = tmp_path / "cache.json"
    r = _cli("--problem", "1,4,2,64,64,causal", "--problem", "1,4,2,64,64,causal", "--problem", "2,8,8,128,64,full",
             "--dry-run", "--cache", str(cache))
    assert r.returncode == 0, r.stderr
    p = parse_attention_spec("1,4,2,64,64,causal")
    assert f"{p}  {p.key()}" in r.stdout and "2 unique attention problems" in r.stdout
    assert not cache.exists()


def _trace(path, events) -> None:
    path.write_text(json.dumps({"traceEvents": events}))


def test_problems_from_trace(tmp_path) -> None:
    """The attention problems of a trace come from the trace analyzer: nested SDPA ops count once."""
    from primus_perf.tracelens.shapes import problems_from_traces

    def op(name, dims, ts, dur, causal="True", dtype="c10::BFloat16"):
        concrete = [""] * 8
        concrete[{"aten::scaled_dot_product_attention": 5}.get(name, 4)] = causal
        return {
            "ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": {"Input Dims": dims, "Input type": [dtype] * 3, "Concrete Inputs": concrete},
        }

    q, kv = [2, 32, 1024, 128], [2, 8, 1024, 128]
    events = [
        op("aten::scaled_dot_product_attention", [q, kv, kv], 0, 10),
        op("aten::_scaled_dot_product_flash_attention", [q, kv, kv], 1, 8),  # nested in the one above
        op("aten::scaled_dot_product_attention", [q, kv, kv], 20, 10),
        op("aten::_scaled_dot_product_flash_attention", [q, kv, kv], 21, 8),
        op("aten::scaled_dot_product_attention", [[1, 4, 77, 64]] * 3, 40, 5, causal="False"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 50, "dur": 1,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"]}},
    ]
    path = tmp_path / "trace.json"
    _trace(path, events)
    found = problems_from_traces([path])
    gemm, attn = found["gemm"], found["attention"]
    assert found["grouped_gemm"] == []
    assert dict(attn) == {
        AttentionProblem(2, 32, 8, 1024, 1024, 128, "bf16", True, "bshd"): 2,
        AttentionProblem(1, 4, 4, 77, 77, 64, "bf16", False, "bshd"): 1,
    }
    assert [(p.row_major_shapes()[:3], n) for p, n in gemm] == [((2, 4, 3), 1)]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="malformed JSON"):
        problems_from_traces([bad])
    bad.write_text(json.dumps({"x": 1}))
    with pytest.raises(UserError, match="not a Kineto trace"):
        problems_from_traces([bad])
