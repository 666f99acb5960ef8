"""``primus-tune gemm --dry-run`` (problems file or trace) and ``cache show|merge`` on the CPU; problems-file errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from primus_perf.base.errors import UserError
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.cli.tune import app
from primus_perf.problems import AttentionProblem, GemmProblem


def test_problems_file_forms_and_dry_run(tmp_path) -> None:
    p1 = GemmProblem.from_row_major(4096, 6144, 4096, b_transposed=True)
    attn = AttentionProblem(1, 4, 2, 64, 64, 16, "bf16", True)
    items = [p1.to_dict(), {"kind": "gemm", "problem": p1.to_dict()},
             {"M": 128, "N": 4096, "K": 14336, "b_transposed": True, "dtype": "f16"},
             {"kind": "attention", "problem": attn.to_dict()}]
    f = tmp_path / "problems.json"
    f.write_text(json.dumps({"problems": items}))
    res = CliRunner().invoke(app, ["gemm", "--problems", str(f), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "2 unique GEMM problems" in res.output  # the attention problem is not a GEMM
    # the label every command prints (the torch product's M x N x K, dtype, layout), then the key
    assert "128x4096x14336 f16 TN  gemm:TN|m4096|n128|k14336|" in res.output
    # the label, or M,N,K[,layout,dtype], names the same problem on the command line
    one = CliRunner().invoke(app, ["gemm", "--problem", "4096,6144,4096", "--problem", "128x4096x14336 f16 TN",
                                   "--problem", "128,4096,14336,TN,f16", "--dry-run"])
    assert one.exit_code == 0 and one.output == res.output, one.output
    bad = CliRunner().invoke(app, ["gemm", "--problem", "4096,4096", "--dry-run"])
    assert isinstance(bad.exception, UserError) and "is not M,N,K[,layout,dtype]" in str(bad.exception)
    offline = CliRunner().invoke(app, ["gemm", "--offline", "--problems", str(f), "--dry-run"])
    assert offline.exit_code == 0 and offline.output == res.output  # --offline spells the default


def test_from_trace_dry_run_lists_the_traces_problems() -> None:
    from pathlib import Path

    from primus_perf.trainer.config import load_config
    from primus_perf.trainer.flops import model_gemms

    trace = Path(__file__).parents[1] / "data" / "traces" / "h100_llama3-8b_l2_s1024_cudnn.json.gz"
    res = CliRunner().invoke(app, ["gemm", "--from-trace", str(trace), "--dry-run"])
    assert res.exit_code == 0, res.output
    cfg = load_config("llama3-8b", ["model.n_layers=2", "train.seq_len=1024", "train.micro_batch=1"])
    expected = {str(c.problem) for c in model_gemms(cfg.model, 1, 1024)}
    assert f"{len(expected)} unique GEMM problems" in res.output
    lines = [line for line in res.output.splitlines() if " bf16 " in line]
    listed = {str(GemmProblem.from_dict({**_fields(key), "dtype_a": "bf16"})) for key in
              (line.split("  ")[1] for line in lines)}
    assert listed == expected == {line.split("  ")[0] for line in lines}  # each line: the label, then its key


def test_problem_errors_are_one_line() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["gemm", "--dry-run"])
    assert isinstance(res.exception, UserError) and "nothing to tune" in str(res.exception)
    res = runner.invoke(app, ["gemm", "--problems", "/nonexistent/p.json", "--dry-run"])
    assert isinstance(res.exception, UserError) and "problems file not found" in str(res.exception)


def test_cache_show_and_merge(tmp_path) -> None:
    p = GemmProblem.from_row_major(256, 512, 128)
    dev = {"name": "NVIDIA H100 80GB HBM3", "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    e = CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=dev,
                   versions={"cublasLt": "13.1.0"}, solution={"config": {"name": "heur3"}, "blob": b"\x01" * 64},
                   times={"tuned_ms": 1.0, "default_ms": 1.2})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    TuningCache(a).put(e)
    runner = CliRunner()
    res = runner.invoke(app, ["cache", "merge", str(b), str(a)])
    assert res.exit_code == 0, res.output
    assert [x.problem_key for x in TuningCache(b).entries()] == [p.key()]
    assert TuningCache(b).entries()[0].solution["blob"] == b"\x01" * 64
    res = runner.invoke(app, ["cache", "show", str(b)])
    assert res.exit_code == 0 and "heur3" in res.output and "1.200x" in res.output


def test_tunableop_export_format(tmp_path) -> None:
    dev = {"name": "AMD Instinct MI300X", "vendor": "amd", "arch": "gfx942", "compute_units": 304}
    p1 = GemmProblem.from_row_major(4096, 6144, 4096, b_transposed=True)  # BLAS "TN", m=6144
    p2 = GemmProblem.from_row_major(128, 4096, 14336, dtype="f16")
    p3 = GemmProblem.from_row_major(512, 512, 512)
    mk = lambda p, cfg: CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=dev,  # noqa: E731
                                   versions={"hipblasLt": "0.12.0"}, solution={"config": cfg, "blob": b""},
                                   times={"tuned_ms": 0.5, "default_ms": 0.6})
    cache = tmp_path / "c.json"
    TuningCache(cache).put_many([mk(p1, {"source": "hipblaslt", "solution_index": 1234}),
                                 mk(p2, {"source": "torch"}), mk(p3, {"source": "cublaslt", "name": "heur0"})])
    out = tmp_path / "tunableop_results.csv"
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "tunableop", "--out", str(out)])
    assert res.exit_code == 0, res.output  # for the running torch (this CPU build: its release)
    import torch

    assert out.read_text().splitlines()[0] == f"Validator,PT_VERSION,{torch.__version__.split('+')[0]}"
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "tunableop", "--out", str(out),
                                   "--torch-version", "2.14.0"])
    assert res.exit_code == 0, res.output
    lines = out.read_text().splitlines()
    assert lines[0] == "Validator,PT_VERSION,2.14.0"
    assert "Validator,HIPBLASLT_VERSION,0.12.0" in lines
    assert "GemmTunableOp_BFloat16_TN,tn_6144_4096_4096_ld_4096_4096_6144,Gemm_Hipblaslt_1234,0.500000" in lines
    assert "GemmTunableOp_Half_NN,nn_4096_128_14336_ld_4096_14336_4096,Default,0.500000" in lines
    assert len([x for x in lines if not x.startswith("Validator")]) == 2  # a cuBLASLt entry without its algo config
    assert "skipped, chose cuBLASLt algorithm heur0, stored as an opaque algo" in res.output  # and why
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "hipblaslt", "--out", str(tmp_path / "h.txt")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "h.txt").read_text().splitlines() == [
        "T,N,6144,4096,4096,1,4096,4096,6144,6144,bf16_r,bf16_r,bf16_r,bf16_r,c_f32_r,1234"]
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "xml", "--out", str(tmp_path / "x")])
    assert isinstance(res.exception, UserError) and "unknown export format 'xml'" in str(res.exception)


def _export(tmp_path, entries: list, torch_version: str):
    """A cache of ``entries`` exported to TunableOp's file: the CLI result (asserted exit 0) and the file."""
    cache, out = tmp_path / "c.json", tmp_path / "t.csv"
    TuningCache(cache).put_many(entries)
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "tunableop", "--out", str(out),
                                   "--torch-version", torch_version])
    assert res.exit_code == 0, res.output
    return res, out


def test_tunableop_export_spells_cublaslt_algorithms(tmp_path) -> None:
    dev = {"name": "NVIDIA H100 80GB HBM3", "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    p = GemmProblem.from_row_major(8192, 4096, 4096, b_transposed=True)
    algo = {"ID": 66, "TILE_ID": 18, "SPLITK_NUM": 1, "REDUCTION_SCHEME": 0, "CTA_SWIZZLING": 1,
            "CUSTOM_OPTION": 0, "STAGES_ID": 35, "INNER_SHAPE_ID": 1, "CLUSTER_SHAPE_ID": 2}
    old = {k: v for k, v in algo.items() if k not in ("INNER_SHAPE_ID", "CLUSTER_SHAPE_ID")}
    q = GemmProblem.from_row_major(1024, 1024, 1024, dtype="f16")
    mk = lambda prob, cfg: CacheEntry(kind="gemm", problem_key=prob.key(), problem=prob.to_dict(), device=dev,  # noqa: E731
                                      versions={"cublasLt": "13.1.0"},
                                      solution={"config": {"name": "heur2", "source": "cublaslt", **cfg},
                                                "blob": b"\x01" * 64}, times={"tuned_ms": 1.25, "default_ms": 1.3})
    res, out = _export(tmp_path, [mk(p, algo), mk(q, old)], "2.14.0.dev20260101+cu130")
    cache = tmp_path / "c.json"
    assert out.read_text().splitlines() == [
        "Validator,PT_VERSION,2.14.0",  # TORCH_VERSION: major.minor.patch
        "Validator,CUBLASLT_VERSION,13.1.0",
        "GemmTunableOp_BFloat16_TN,tn_4096_8192_4096_ld_4096_4096_4096,"
        "Gemm_Cublaslt_id_66_tile_18_stages_35_splitk_1_red_0_swizzle_1_custom_0_inner_1_cluster_2,1.250000",
    ]
    # cuBLASLt 12+ builds of TunableOp parse only names with the inner and cluster shapes
    assert f"{q}: skipped" in res.output and "INNER_SHAPE_ID, CLUSTER_SHAPE_ID); export on" in res.output
    # torch 2.13 on CUDA: Default only, and only the PT_VERSION validator (another makes TunableOp drop the file)
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "tunableop", "--out", str(out),
                                   "--torch-version", "2.13.0"])
    assert isinstance(res.exception, UserError) and "nothing to export to tunableop" in str(res.exception)
    assert "offers only Default" in str(res.exception)
    # a hipBLASLt file of a cache tuned with cuBLASLt: refused, nothing written
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "hipblaslt", "--out", str(tmp_path / "h")])
    assert isinstance(res.exception, UserError) and "tuned with cublasLt" in str(res.exception)
    assert not (tmp_path / "h").exists()


def test_tunableop_export_skips_what_it_cannot_spell_and_says_why(tmp_path) -> None:
    dev = {"name": "NVIDIA H100 80GB HBM3", "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    plain = GemmProblem.from_row_major(64, 128, 32, b_transposed=True)
    bias = GemmProblem.from_row_major(64, 128, 32, b_transposed=True, epilogue="bias")
    gelu = GemmProblem.from_row_major(64, 128, 32, b_transposed=True, epilogue="gelu_bias")
    mixed = GemmProblem.from_row_major(64, 128, 32, out_dtype="f32")
    mk = lambda prob: CacheEntry(kind="gemm", problem_key=prob.key(), problem=prob.to_dict(), device=dev,  # noqa: E731
                                 versions={"cublasLt": "13.1.0"}, solution={"config": {"source": "torch"}, "blob": b""},
                                 times={"tuned_ms": 0.01, "default_ms": 0.01})
    res, out = _export(tmp_path, [mk(plain), mk(bias), mk(gelu), mk(mixed)], "2.13.0")
    assert out.read_text().splitlines() == [
        "Validator,PT_VERSION,2.13.0",
        "GemmTunableOp_BFloat16_TN,tn_128_64_32_ld_32_32_128,Default,0.010000",
        "GemmAndBiasTunableOp_BFloat16_TN,tn_128_64_32_ld_32_32_128,Default,0.010000",
    ]
    assert f"{gelu}: skipped, epilogue gelu_bias" in res.output
    assert f"{mixed}: skipped, bf16 inputs with a f32 output" in res.output
    assert "2 rows; 2 GEMM entries skipped" in res.output


def _fields(key: str) -> dict:
    """The row-major fields of a GEMM key (a test helper: m, n, k and the transposes)."""
    parts = key.split("|")
    t, m, n, k = parts[0][-2:], int(parts[1][1:]), int(parts[2][1:]), int(parts[3][1:])
    return {"m": m, "n": n, "k": k, "trans_a": t[0] == "T", "trans_b": t[1] == "T"}


ONLINE_CASES = [
    (["gemm", "--online", "--config", "tiny"], "online tuning needs a GPU"),
    (["attention", "--online", "--", "train.py", "--steps", "2"], "online tuning needs a GPU"),
    (["grouped-gemm", "--online", "--config", "tiny-moe", "model.n_layers=1"], "online tuning needs a GPU"),
    (["gemm", "--online"], "--online needs a run to tune during"),
    (["gemm", "--config", "tiny"], "--config names a run to tune during: add --online"),
    (["attention", "--problem", "1,2,2,64,16,causal", "extra"], "a program to run is for --online"),
]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU refusals")
@pytest.mark.parametrize("argv,said", ONLINE_CASES)
def test_online_tuning_on_a_cpu_is_one_line_and_exit_2(argv: list[str], said: str, tmp_path) -> None:
    from inprocess import completed

    cache = ["--cache", str(tmp_path / "c.json")]
    res = completed(["tune", *argv, *cache] if "--" not in argv else
                    ["tune", *argv[:argv.index("--")], *cache, *argv[argv.index("--"):]])
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and lines[0].startswith("error:"), res.stderr
    assert not (tmp_path / "c.json").exists()  # nothing ran


@pytest.mark.gpu
def test_online_tuning_of_a_config_run_writes_gemm_entries(tmp_path) -> None:
    """``primus-tune gemm --online --config tiny``: the trainer runs under enable(online=True)
    with the GEMM kind only, and the problems it locked are in the cache."""
    import subprocess
    import sys

    cache = tmp_path / "online.json"
    res = subprocess.run([sys.executable, "-m", "primus_perf.cli.tune", "gemm", "--online", "--config", "tiny",
                          "--steps", "40", "--cache", str(cache)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    kinds = {e.kind for e in TuningCache(cache).entries()}
    assert kinds == {"gemm"}, (kinds, res.stdout[-2000:], res.stderr[-2000:])


def test_tunableop_export_names_opaque_cublaslt_algos_and_defaults_to_the_running_torch(tmp_path, monkeypatch) -> None:
    """A cache that stored only the algo (``heur5``, as older tuners did): its attributes are
    read from the algo where cuBLASLt loads (here a stand-in), so the choice is exported, not
    skipped; without --torch-version the running torch's validators are written."""
    from primus_perf.cache import export as ex

    dev = {"name": "NVIDIA H100 80GB HBM3", "vendor": "nvidia", "arch": "sm_90", "compute_units": 132}
    p = GemmProblem.from_row_major(8192, 4096, 4096, b_transposed=True)
    entry = CacheEntry(kind="gemm", problem_key=p.key(), problem=p.to_dict(), device=dev, versions={"cublasLt": "13.1.0"},
                       solution={"config": {"name": "heur5", "source": "cublaslt", "workspace": 4},
                                 "blob": bytes(range(64))}, times={"tuned_ms": 1.0, "default_ms": 1.1})
    attrs = {"ID": 66, "TILE_ID": 18, "SPLITK_NUM": 1, "REDUCTION_SCHEME": 0, "CTA_SWIZZLING": 1,
             "CUSTOM_OPTION": 0, "STAGES_ID": 35, "INNER_SHAPE_ID": 1, "CLUSTER_SHAPE_ID": 2}
    seen = []
    monkeypatch.setattr(ex, "library_decoder", lambda: lambda blob: (seen.append(blob), attrs)[1])
    monkeypatch.setattr(ex, "running_validators", lambda: {"PT_VERSION": "2.14.0", "CUBLASLT_VERSION": "130100"})
    cache, out = tmp_path / "c.json", tmp_path / "t.csv"
    TuningCache(cache).put(entry)
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "tunableop", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert seen == [bytes(range(64))]
    assert out.read_text().splitlines() == [
        "Validator,PT_VERSION,2.14.0", "Validator,CUBLASLT_VERSION,130100",
        "GemmTunableOp_BFloat16_TN,tn_4096_8192_4096_ld_4096_4096_4096,"
        "Gemm_Cublaslt_id_66_tile_18_stages_35_splitk_1_red_0_swizzle_1_custom_0_inner_1_cluster_2,1.000000"]
    res = CliRunner().invoke(app, ["cache", "export", str(cache), "--format", "tunableop", "--out", str(out),
                                   "--torch-version", "banana"])
    assert isinstance(res.exception, UserError) and "'banana' is not a torch release such as 2.14.0" in str(res.exception)


def test_grouped_dry_run_of_a_config_lists_each_problem_once() -> None:
    res = CliRunner().invoke(app, ["grouped-gemm", "--config", "tiny-moe", "model.n_layers=2", "--steps", "1",
                                   "--device", "cpu", "--dry-run"])
    assert res.exit_code == 0, res.output
    keys = [line.split("  ")[1] for line in res.output.splitlines() if "  ggemm:" in line]
    assert keys and len(keys) == len(set(keys)) and f"{len(keys)} unique grouped GEMM problems" in res.output
    assert all(line.endswith("calls)") for line in res.output.splitlines() if "  ggemm:" in line)
