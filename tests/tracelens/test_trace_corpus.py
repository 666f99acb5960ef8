"""Every public trace of other projects (``../shared/traces/external``, SOURCES.md) analyzes
cleanly: no negative figure, temporal parts that add up to the span, category totals equal
to the kernel time summed independently from the raw events, little "other", GEMM FLOPs
where shapes were recorded; the same model on MI300X and H100 gives the same GEMM problems.

Each trace is analyzed once per session; the raw-event reader here is independent of the
loader (gzip + json, the step of each GPU event found from its launch's correlation id)."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from primus_perf.tracelens.analyze import Analysis, analyze

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "traces" / "external"
TRACES = sorted(str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*.json.gz")) if CORPUS.is_dir() else []
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "Runtime", "hip_runtime"}
STEP = re.compile(r"^ProfilerStep#(\d+)$")

pytestmark = pytest.mark.skipif(not TRACES, reason=f"the external trace corpus is absent ({CORPUS})")


def _int(v: Any) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v, 0)
        except ValueError:
            return None
    return None


def raw_gpu_time(path: Path) -> dict[str, float]:
    """Microseconds of GPU events: over the whole trace, and inside the profiled steps by
    the step of each event's launch (the runtime call with the same correlation id)."""
    data = json.loads(gzip.decompress(path.read_bytes()))
    events = data["traceEvents"]
    windows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
               if e.get("ph") == "X" and STEP.match(str(e.get("name", "")))
               and e.get("cat") in ("user_annotation", "cpu_op", "Operator")]
    launch_ts = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in RUNTIME_CATS:
            c = _int((e.get("args") or {}).get("correlation"))
            if c is not None:
                launch_ts.setdefault(c, float(e["ts"]))
    total = in_steps = 0.0
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    launched = any(_int((e.get("args") or {}).get("correlation")) in launch_ts for e in gpu)
    for e in gpu:
        d = float(e.get("dur", 0))
        total += d
        t = launch_ts.get(_int((e.get("args") or {}).get("correlation"))) if launched else float(e["ts"])
        if t is not None and any(a <= t < b for a, b in windows):
            in_steps += d
    return {"total_us": total, "in_steps_us": in_steps if windows else total}


@pytest.fixture(scope="module")
def analyses() -> dict[str, Analysis]:
    return {}


def _analysis(analyses: dict[str, Analysis], rel: str) -> Analysis:
    if rel not in analyses:
        analyses[rel] = analyze([CORPUS / rel])
    return analyses[rel]


@pytest.mark.parametrize("rel", TRACES)
def test_corpus_trace(rel: str, analyses: dict[str, Analysis]) -> None:
    a = _analysis(analyses, rel)
    json.dumps(a.to_json(), default=str)
    # no negative figure anywhere in the breakdowns
    for name, df in (("temporal", a.temporal), ("breakdown", a.breakdown), ("hotspots", a.hotspots),
                     ("op_times", a.op_times), ("rank_summary", a.rank_summary)):
        num = df.select_dtypes("number")
        assert not (num < 0).any().any(), (name, num[(num < 0).any(axis=1)].head())
    assert all(v is None or not isinstance(v, (int, float)) or v >= 0 for v in a.totals.values()), a.totals
    # the temporal parts add up to the span
    t = a.temporal
    assert len(t) >= 1
    parts = t["compute_s"] + t["exposed_comm_s"] + t["exposed_memcpy_s"] + t["idle_s"]
    assert np.allclose(parts, t["span_s"], rtol=1e-3, atol=1e-9), t
    # category totals equal the raw GPU event time: inside the steps, and over the whole trace
    raw = raw_gpu_time(CORPUS / rel)
    in_steps = float(a.breakdown["seconds"].sum()) * 1e6
    assert in_steps == pytest.approx(raw["in_steps_us"], rel=5e-3), (in_steps, raw)
    assert float(a.kernels["dur_us"].sum()) == pytest.approx(raw["total_us"], rel=5e-3)
    outside = a.totals["outside_steps_gpu_s"] * 1e6
    assert in_steps + outside == pytest.approx(raw["total_us"], rel=5e-3)
    # "other" is at most 10% of GPU time
    cats = a.category_seconds()
    assert cats.get("other", 0.0) <= 0.10 * cats.sum(), cats
    # GEMM FLOPs wherever GEMM ops were recorded with shapes
    if not a.gemm_problems.empty:
        assert a.totals["gemm_flops_per_step"] and a.totals["gemm_flops_per_step"] > 0
        assert a.gemm_problems["flops"].notna().all() and (a.gemm_problems["flops"] > 0).all()
    has_shapes = not any("no recorded shapes" in n or "no CPU ops" in n for n in a.notes)
    if has_shapes and (a.kernels["category"] == "gemm").any() and a.totals["gemm_flops_per_step"] is None:
        pytest.fail(f"GEMM kernels and shapes but no GEMM FLOPs: {a.notes}")


def test_mi300x_and_h100_give_the_same_gemm_problems(analyses: dict[str, Analysis]) -> None:
    pairs = [f"tracelens/{d}/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz" for d in ("mi300", "h100")]
    if not all(p in TRACES for p in pairs):
        pytest.skip("the Qwen pair is not in the corpus")
    mi300, h100 = (_analysis(analyses, p) for p in pairs)
    assert mi300.device["peaks"] == "mi300x" and h100.device["peaks"] == "h100-sxm"

    def problems(a: Analysis) -> pd.DataFrame:
        return a.gemm_problems[["key", "calls", "flops"]].sort_values("key", ignore_index=True)

    assert len(problems(h100)) > 0
    pd.testing.assert_frame_equal(problems(mi300), problems(h100))
    assert mi300.totals["gemm_flops_per_step"] == h100.totals["gemm_flops_per_step"] > 0


def test_parallel_ranks_equal_serial() -> None:
    pair = [CORPUS / "hta/trace_filter" / f"sampled_rank-{r}.json.gz" for r in (0, 1)]
    if not all(p.is_file() for p in pair):
        pytest.skip("the 2-rank pair is not in the corpus")
    serial, parallel = analyze(pair, jobs=1), analyze(pair, jobs=2)
    assert serial.ranks == parallel.ranks and len(serial.ranks) == 2
    pd.testing.assert_frame_equal(serial.kernels, parallel.kernels)
    pd.testing.assert_frame_equal(serial.temporal, parallel.temporal)
    pd.testing.assert_frame_equal(serial.hotspots, parallel.hotspots)
    assert serial.totals == parallel.totals and serial.notes == parallel.notes
