"""Bad and unusual traces: each gives a useful analysis or one clear line and exit code 2,
never a traceback. Inputs are made from the committed H100 trace (truncated, corrupted,
stripped of shapes or of CPU events, rewritten as a ROCm trace) and by seeded fuzzing."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from primus_perf.base.errors import UserError
from primus_perf.tracelens.analyze import analyze

H100 = Path(__file__).parents[1] / "data" / "traces" / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
SHAPE_ARGS = ("Input Dims", "Input type", "Input Strides", "Concrete Inputs")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@pytest.fixture(scope="module")
def raw() -> bytes:
    return gzip.decompress(H100.read_bytes())


@pytest.fixture(scope="module")
def trace(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return analyze([H100])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    from inprocess import completed

    return completed(["profile", *args])


def _write(path: Path, data: bytes | dict) -> Path:
    if isinstance(data, dict):
        data = json.dumps(data).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def _assert_one_line_exit_2(path: Path, text: str) -> None:
    r = _cli("analyze", str(path))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, (path.name, r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert text in lines[0] and path.name in lines[0], lines[0]


# --------------------------------------------------------------------------- unreadable input


def test_unreadable_traces_are_one_line_and_exit_2(tmp_path: Path, raw: bytes) -> None:
    gz = gzip.compress(raw)
    cases = [
        (_write(tmp_path / "truncated.json", raw[: len(raw) // 2]), "truncated JSON"),
        (_write(tmp_path / "truncated_gz.json.gz", raw[: len(raw) // 3]), "truncated JSON"),
        ((tmp_path / "cut_stream.json.gz"), "bad gzip"),
        ((tmp_path / "not_gzip.json.gz"), "JSON"),
        (_write(tmp_path / "empty.json", b""), r"is empty \(0 bytes\)"),  # refused before it is read, as the CLI does
        (_write(tmp_path / "object.json", b"{}"), "no traceEvents"),
        (_write(tmp_path / "array.json", b"[]"), "nothing to analyze"),  # the JSON Array Format, empty
        (_write(tmp_path / "string.json", b'"trace"'), r"is not JSON \(an object or array\) or gzip"),
        (_write(tmp_path / "events_object.json", b'{"traceEvents": {}}'), "not a list"),
        (_write(tmp_path / "no_events.json", b'{"traceEvents": []}'), "nothing to analyze"),
        (_write(tmp_path / "latin1.json", b'{"traceEvents": [{"ph": "X", "name": "caf\xe9"}]}'), "UTF-8"),
    ]
    (tmp_path / "cut_stream.json.gz").write_bytes(gz[: len(gz) // 2])
    (tmp_path / "not_gzip.json.gz").write_bytes(b"this is not gzip data")
    for path, text in cases:
        with pytest.raises(UserError, match=text):
            analyze([path])
    for path, text in [*cases[::3], cases[-1]]:  # the CLI: one line on stderr, exit 2
        _assert_one_line_exit_2(path, text)
    r = _cli("analyze", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not found" in r.stderr
    (tmp_path / "empty_dir").mkdir()
    r = _cli("shapes", str(tmp_path / "empty_dir"), "-o", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "no trace files" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- degraded traces


def test_trace_without_shapes_degrades_to_unknown_flops(tmp_path: Path, trace: dict, original: Any) -> None:
    stripped = json.loads(json.dumps(trace))
    for e in stripped["traceEvents"]:
        for k in SHAPE_ARGS:
            (e.get("args") or {}).pop(k, None)
    path = _write(tmp_path / "no_shapes.json.gz", stripped)
    a = analyze([path])
    assert a.totals["gemm_flops_per_step"] is None and a.totals["attention_flops_per_step"] is None
    assert len(a.gemm_problems) == 0 and any("no recorded shapes" in n for n in a.notes)
    # same kernels, same categories (op names are still there), same busy time
    assert a.totals["gemm_s_per_step"] == pytest.approx(original.totals["gemm_s_per_step"], rel=1e-12)
    assert a.totals["gpu_busy_s_per_step"] == pytest.approx(original.totals["gpu_busy_s_per_step"], rel=1e-12)
    r = _cli("analyze", str(path))
    assert r.returncode == 0 and "FLOPs unknown" in r.stdout, r.stderr


def test_trace_without_cpu_events_uses_kernel_names(tmp_path: Path, trace: dict, original: Any) -> None:
    gpu_only = {k: v for k, v in trace.items() if k != "traceEvents"}
    gpu_only["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") in GPU_CATS or e.get("ph") == "M"]
    path = _write(tmp_path / "gpu_only.json", gpu_only)
    a = analyze([path])
    assert any("no CPU ops" in n for n in a.notes)
    assert a.totals["gemm_flops_per_step"] is None
    kernels = original.kernels
    # every kernel is still there; GEMM kernels are found by their names
    assert len(a.kernels) == len(kernels[kernels["kind"].isin(GPU_CATS)]) or len(a.kernels) == len(kernels)
    gemm_names = set(kernels.loc[kernels["category"] == "gemm", "name"].astype(str))
    found = set(a.kernels.loc[a.kernels["category"] == "gemm", "name"].astype(str))
    assert gemm_names <= found
    total_gpu = float(a.kernels["dur_us"].sum())
    assert total_gpu == pytest.approx(float(kernels["dur_us"].sum()), rel=1e-9)
    r = _cli("analyze", str(path), "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["breakdown"], r.stderr


def rocm_version_of(trace: dict, gemm_kernels: set[str]) -> dict:
    """The CUDA trace as a ROCm build of torch writes it: HIP runtime calls, hipBLASLt
    kernel names, an MI300X, roctracer instead of CUPTI."""
    out = json.loads(json.dumps(trace))
    for k in ("cupti_version", "cuda_driver_version", "cuda_runtime_version"):
        out.pop(k, None)
    out["roctracer_version"] = 4
    out["hip_runtime_version"] = 60342134
    for p in out["deviceProperties"]:
        p.update(name="AMD Instinct MI300X", computeMajor=9, computeMinor=4, numSms=304, warpSize=64)
    runtime = {"cudaLaunchKernel": "hipLaunchKernel", "cuLaunchKernelEx": "hipExtModuleLaunchKernel",
               "cudaMemcpyAsync": "hipMemcpyWithStream", "cudaMemsetAsync": "hipMemsetAsync"}
    for i, e in enumerate(out["traceEvents"]):
        name = e.get("name", "")
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            e["name"] = runtime.get(name, name.replace("cuda", "hip", 1))
        elif e.get("cat") == "kernel" and name in gemm_kernels:
            e["name"] = f"Cijk_Alik_Bljk_BBS_BH_MT256x256x64_MI32x32x8x1_SN_1LDSB1_GRVW8_K1_WG32_8_1_{i % 5}"
    return out


def test_rocm_trace_links_and_models_like_the_cuda_one(tmp_path: Path, trace: dict, original: Any) -> None:
    k = original.kernels
    gemm_kernels = set(k.loc[k["category"] == "gemm", "name"].astype(str))
    path = _write(tmp_path / "mi300x.json.gz", rocm_version_of(trace, gemm_kernels))
    a = analyze([path])
    assert a.device["name"] == "AMD Instinct MI300X" and a.device["vendor"] == "amd"
    assert a.totals["gemm_flops_per_step"] == original.totals["gemm_flops_per_step"] > 0
    assert set(a.gemm_problems["key"]) == set(original.gemm_problems["key"])
    assert a.totals["gemm_s_per_step"] == pytest.approx(original.totals["gemm_s_per_step"], rel=1e-12)
    assert a.kernels["name"].astype(str).str.startswith("Cijk_").sum() == len(k[k["category"] == "gemm"])
    # and without CPU ops, the hipBLASLt names alone say GEMM
    bare = rocm_version_of(trace, gemm_kernels)
    bare["traceEvents"] = [e for e in bare["traceEvents"] if e.get("cat") in GPU_CATS]
    b = analyze([_write(tmp_path / "mi300x_gpu_only.json", bare)])
    assert b.totals["gemm_s_per_step"] > 0.9 * original.totals["gemm_s_per_step"] * len(original.steps)


# --------------------------------------------------------------------------- fuzzing

JUNK = [None, "", "x" * 3, -1, 0, 2**70, -(2**70), 1.5e308, float("nan"), [], [1, [2]], {}, {"a": None}, True]


def _mutate(events: list[dict], rng: random.Random) -> list[dict]:
    ev = json.loads(json.dumps(events))
    for _ in range(rng.randint(1, 12)):
        op = rng.randrange(6)
        e = rng.choice(ev) if ev else {}
        keys = list(e) + list(e.get("args", {}) if isinstance(e.get("args"), dict) else [])
        if op == 0 and keys:  # drop a field
            k = rng.choice(keys)
            (e if k in e else e["args"]).pop(k, None)
        elif op == 1 and keys:  # a value of the wrong type
            k = rng.choice(keys)
            (e if k in e else e["args"])[k] = rng.choice(JUNK)
        elif op == 2 and ev:  # drop events
            del ev[rng.randrange(len(ev)):][: rng.randint(1, 20)]
        elif op == 3 and ev:  # duplicate an event
            ev.insert(rng.randrange(len(ev)), json.loads(json.dumps(rng.choice(ev))))
        elif op == 4 and "ts" in e and "dur" in e:  # swap start and duration
            e["ts"], e["dur"] = e["dur"], e["ts"]
        elif op == 5 and isinstance(e.get("args"), dict) and "Input Dims" in e["args"]:
            e["args"]["Input Dims"] = rng.choice([[[-3, 4]], [["a"]], [[2**40, 2**40], [2**40, 2**40]], "dims"])
    return ev


def test_fuzzed_traces_analyze_or_fail_cleanly(tmp_path: Path, trace: dict, raw: bytes) -> None:
    """100 seeded mutations of one step of the real trace, and 40 byte-level corruptions:
    analyze() returns an analysis whose JSON serializes, or raises UserError; nothing else."""
    events = trace["traceEvents"]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    t0, t1 = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
    window = [e for e in events if e.get("ph") == "M" or t0 <= float(e.get("ts", -1)) <= t1 + 5_000]
    head = {k: v for k, v in trace.items() if k != "traceEvents"}
    small = json.dumps({**head, "traceEvents": window}).encode()
    outcomes = {"ok": 0, "user_error": 0}
    path = tmp_path / "fuzz.json"
    for seed in range(100):
        rng = random.Random(seed)
        path.write_text(json.dumps({**head, "traceEvents": _mutate(window, rng)}))
        _analyze_cleanly(path, seed, outcomes)
    for seed in range(40):
        rng = random.Random(10_000 + seed)
        data = bytearray(small)
        if seed % 2:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        _analyze_cleanly(path, 10_000 + seed, outcomes)
    assert outcomes["ok"] > 35 and outcomes["user_error"] > 15, outcomes


def _analyze_cleanly(path: Path, seed: int, outcomes: dict[str, int]) -> None:
    try:
        a = analyze([path])
    except UserError as exc:
        assert "\n" not in str(exc), (seed, str(exc))
        outcomes["user_error"] += 1
        return
    except Exception as exc:  # anything but UserError is a bug
        pytest.fail(f"seed {seed}: {type(exc).__name__}: {exc}")
    json.dumps(a.to_json(), allow_nan=True, default=str)
    outcomes["ok"] += 1
