"""Would Triton GEMMs widen the tuner's pool? A probe, not part of the tuner.

For a few of the benchmark's GEMMs (the ones where cuBLASLt's best stays furthest below
the best throughput seen on the device), time ``torch.matmul``, the tuner's cuBLASLt
choice and the best of a grid of Triton tile configs (pointer loads, and TMA tensor
descriptors where this Triton has them), each call timed alone as the tuner times it.
Also samples the GPU's power draw and SM clock while one GEMM runs back to back, to see
whether the device sits at its power limit.

    python benchmarks/gemm/gemm_triton_probe.py --out benchmarks/results/gemm_triton_probe/h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

import torch
import triton
import triton.language as tl

from primus_perf.gate.stats import geomean
from primus_perf.kernels.gemm import GemmRouter
from primus_perf.problems import GemmProblem
from primus_perf.tuner import measure as timing
from primus_perf.tuner.core import tune_problem
from primus_perf.tuner.gemm.plugin import GemmTuner, Operands

SHAPES = [  # tag, M, N, K (row-major x[M,K] @ w[N,K].T, the trainer's forward layout)
    ("8b/o/4k/fwd", 4096, 4096, 4096),
    ("8b/qkv/4k/fwd", 4096, 6144, 4096),
    ("8b/gate_up/16k/fwd", 16384, 28672, 4096),
    ("70b-tp8/o/4k/fwd", 4096, 8192, 1024),
    ("70b-tp8/qkv/4k/fwd", 4096, 1280, 8192),
    ("odd/m128/qkv/fwd", 128, 6144, 4096),
]


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output tile (row, column), in groups of GROUP_M tile rows for L2 reuse."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * grid_n
    first_m = (pid // group) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % group) % size_m, (pid % group) // size_m


@triton.jit
def _mm_ptr(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pm, pn = _tile(M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    pa = a + rm[:, None] * sam + rk[None, :] * sak
    pb = b + rk[:, None] * sbk + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        left = K - k * BK
        x = tl.load(pa, mask=(rm[:, None] < M) & (rk[None, :] < left), other=0.0)
        y = tl.load(pb, mask=(rk[:, None] < left) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(x, y, acc)
        pa += BK * sak
        pb += BK * sbk
    pc = c + rm[:, None] * scm + rn[None, :] * scn
    tl.store(pc, acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _mm_tma(a, w, c, M, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # a: [M, K] row-major, w: [N, K] row-major (c = a @ w.T), c: [M, N]
    pm, pn = _tile(M, N, BM, BN, GROUP_M)
    da = tl.make_tensor_descriptor(a, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    dw = tl.make_tensor_descriptor(w, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    dc = tl.make_tensor_descriptor(c, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        x = da.load([pm * BM, k * BK])
        y = dw.load([pn * BN, k * BK])
        acc = tl.dot(x, y.T, acc)
    dc.store([pm * BM, pn * BN], acc.to(c.dtype.element_ty))


def configs() -> list[dict]:
    out = []
    for bm in (128, 256):
        for bn in (128, 256):
            for bk in (64,):
                for warps in (4, 8):
                    for stages in (3, 4, 5):
                        smem = (bm + bn) * bk * 2 * stages
                        if smem > 220 * 1024 or (bm * bn >= 256 * 256 and warps < 8):
                            continue
                        out.append({"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": warps,
                                    "num_stages": stages})
    return out


def triton_fn(kind: str, cfg: dict, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor):
    M, K = x.shape
    N = w.shape[0]
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
    meta = dict(BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if kind == "tma":
        return _mm_tma[grid](x, w, c, M, N, K, **meta)
    return _mm_ptr[grid](x, w, c, M, N, K, x.stride(0), x.stride(1), w.stride(1), w.stride(0),
                         c.stride(0), c.stride(1), **meta)


def power_trace(seconds: float = 2.0) -> dict:
    """Power draw and SM clock while one large GEMM runs back to back."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    samples: list[str] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            r = subprocess.run(["nvidia-smi", "--query-gpu=power.draw,power.limit,clocks.sm,clocks.max.sm",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True)
            samples.append(r.stdout.strip())
            time.sleep(0.1)

    th = threading.Thread(target=sample)
    th.start()
    t0 = time.time()
    n = 0
    while time.time() - t0 < seconds:
        for _ in range(20):
            torch.matmul(x, x)
        torch.cuda.synchronize()
        n += 20
    stop.set()
    th.join()
    rows = [[float(v) for v in s.split(",")] for s in samples if s and "N/A" not in s]
    if not rows:
        return {"error": "nvidia-smi gave no samples", "raw": samples[:5]}
    tflops = 2 * 8192**3 * n / (time.time() - t0) / 1e12
    return {"gemm": "8192^3 bf16 back to back", "tflops": tflops,
            "power_w_median": statistics.median(r[0] for r in rows), "power_limit_w": rows[0][1],
            "sm_clock_mhz_median": statistics.median(r[2] for r in rows), "sm_clock_max_mhz": rows[0][3],
            "samples": len(rows)}


def probe_shape(tag: str, M: int, N: int, K: int, kinds: list[str], rough_reps: int, final_reps: int) -> dict:
    p = GemmProblem.from_row_major(M, N, K, b_transposed=True)
    res = tune_problem(GemmTuner(), p, budget_s=2.0)
    router = GemmRouter([res.entry])
    ops = Operands(p, seed=7)
    ws = [b.T for b in ops.b]  # the [N, K] weights
    ref = torch.matmul(ops.a[0].float(), ops.b[0].float())
    row: dict = {"tag": tag, "MNK": [M, N, K], "cublaslt_choice": res.chosen, "triton": {}}
    fns = {}
    for kind in kinds:
        for cfg in configs():
            name = f"{kind}:{cfg['BM']}x{cfg['BN']}x{cfg['BK']}w{cfg['num_warps']}s{cfg['num_stages']}"
            try:
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                triton_fn(kind, cfg, ops.a[0], ws[0], out)
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    row["triton"][name] = {"rejected": f"relative error {err:.3g}"}
                    continue
            except Exception as exc:  # a config this Triton or device cannot run
                row["triton"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            fns[name] = (lambda k, c: lambda i: triton_fn(k, c, ops.a[i], ws[i], ops.d[i]))(kind, cfg)
    rough = timing.time_isolated(fns, ops.n, rough_reps, seed=1) if fns else {}
    for name, t in rough.items():
        row["triton"][name] = {"rough_tflops": p.flops / statistics.median(t) / 1e12}
    best = sorted(rough, key=lambda n: statistics.median(rough[n]))[:3]

    def routed(i: int):
        out = router(ops.a[i], ops.b[i])
        return out if out is not None else torch.matmul(ops.a[i], ops.b[i])

    final = {"torch": lambda i: torch.matmul(ops.a[i], ops.b[i]), "cublaslt_tuned": routed}
    final.update({n: fns[n] for n in best})
    t = timing.time_isolated(final, ops.n, final_reps, seed=3)
    row["final"] = {n: {**timing.summarize(v), "tflops": p.flops / statistics.median(v) / 1e12} for n, v in t.items()}
    base = statistics.median(t["torch"])
    row["speedup_vs_torch"] = {n: base / statistics.median(v) for n, v in t.items() if n != "torch"}
    row["best_triton"] = best[0] if best else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/gemm_triton_probe/h100.json")
    ap.add_argument("--kinds", default="ptr,tma")
    ap.add_argument("--rough-reps", type=int, default=6)
    ap.add_argument("--final-reps", type=int, default=30)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "configs": len(configs()), "shapes": []}
    t0 = time.time()
    result["power"] = power_trace()
    print(json.dumps(result["power"]), flush=True)
    for tag, M, N, K in SHAPES:
        try:
            row = probe_shape(tag, M, N, K, args.kinds.split(","), args.rough_reps, args.final_reps)
        except Exception as exc:
            row = {"tag": tag, "error_text": f"{type(exc).__name__}: {exc}"}
        result["shapes"].append(row)
        print(json.dumps({k: row.get(k) for k in ("tag", "best_triton", "speedup_vs_torch", "error_text")}),
              flush=True)
        ok = [r for r in result["shapes"] if r.get("best_triton")]
        if ok:
            result["summary"] = {
                "geomean_best_triton_vs_torch": geomean([r["speedup_vs_torch"][r["best_triton"]] for r in ok]),
                "geomean_cublaslt_tuned_vs_torch": geomean([r["speedup_vs_torch"]["cublaslt_tuned"] for r in ok]),
                "geomean_best_of_both_vs_torch": geomean([max(r["speedup_vs_torch"].values()) for r in ok]),
                "elapsed_s": time.time() - t0,
            }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    print(json.dumps(result.get("summary")), flush=True)


if __name__ == "__main__":
    main()
