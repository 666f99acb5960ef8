"""What to do next: one recommendation per kind of waste the trace shows, each with the time
it could save per step and how that estimate was made.

Each row: ``category``, ``evidence`` (what the trace shows), ``action`` (what to change:
the trainer's config key when the trace's manifest says it came from ``primus-train``,
else code advice), ``command`` (a tuner command, when one applies), ``estimated_saving_ms``
(per step), ``method`` and ``changes_numerics``. Rows are ranked by the estimated saving,
except that changes of the numerics (FP8) come after every change that keeps them, whatever
their saving: they need a convergence check before they count.

The estimates, one per category (each the saving of that change alone; they do not add up
when they touch the same kernels):

- ``fusion``: chains of elementwise and normalization kernels (:mod:`.fusion`): measured
  time minus the time their bytes take at the bandwidth a device reaches (88% of its peak).
- ``optimizer``: a per-parameter or foreach optimizer step -> a fused one: a third of its
  time (a rule of thumb: fused Adam(W) is commonly 1.5x the foreach one); a fused step on
  many data-parallel ranks -> sharding (each rank updates 1/N of the parameters).
- ``host: syncs``: the calls that made the host wait for the GPU (:mod:`.host_idle`): the
  step replayed without those waits against the recorded replay.
- ``host: launches``: a host too slow to keep the queue filled: for the trainer, a
  micro-batch twice as large (the replay with GPU events twice as long, halved: per step
  of the original tokens); otherwise the replay without the host's launch time (CUDA
  graphs' bound). Both replays keep the host time the profiler did not add when the
  manifest measured the unprofiled step.
- ``communication``: the exposed communication (:mod:`.breakdown`), all of it: the upper
  bound of overlapping it with compute.
- ``tuning`` (GEMM, grouped GEMM, attention; the rows and commands of :mod:`.tune_next`):
  per problem ``time * (1 - roofline fraction / ATTAINABLE)``: tuning reaches the best
  kernel available, not the datasheet peak.
- ``fp8``: bf16/f16 GEMMs with every dimension at least ``FP8_MIN_DIM`` on a device with an
  FP8 peak: ``time * (1 - 1 / FP8_GEMM_SPEEDUP)``.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.devices import DevicePeaks, lookup_peaks
from primus_perf.problems import GemmProblem
from primus_perf.tracelens.analyses.fusion import ATTAINABLE_BW, MEMORY_BOUND, fusion_estimate
from primus_perf.tracelens.analyses.hotspots import in_steps
from primus_perf.tracelens.analyses.tune_next import tune_next
from primus_perf.tracelens.categories import OPTIMIZER

# ``tracelens.analyze.Analysis``, which imports this module: no import back
Analysis = Any

COLUMNS = ["category", "evidence", "action", "command", "estimated_saving_ms", "method", "changes_numerics"]
MIN_SAVING_MS = 0.01  # below this a recommendation is noise
# fraction of the datasheet peak the best available kernels reach (H100: the best cuBLASLt
# candidate for dense bf16 GEMMs runs at ~0.75-0.82 of it; cuDNN attention, the fastest
# backend measured, 0.56 forward and 0.50 backward; grouped GEMMs between)
ATTAINABLE = {kinds.GEMM.name: 0.8, kinds.GROUPED.name: 0.7, kinds.ATTENTION.name: 0.55}
FOREACH_TO_FUSED = 1.5
# torchao float8 (tensorwise) under torch.compile on an H100, Llama 8B dims, 4 layers, seq
# 4096, micro-batch 2: 146.0 -> 126.1 ms per step with ~88 ms of bf16 GEMMs: the GEMMs
# 1.29x faster, the casts and scaling included
FP8_GEMM_SPEEDUP = 1.29
FP8_MIN_DIM = 1024
_FP8_DTYPES = ("bf16", "f16")


def trainer_config(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The trainer's config when the run came from ``primus-train`` (its manifest records the
    config with ``train`` and ``model`` sections), else None."""
    cfg = manifest.get("config")
    if isinstance(cfg, dict) and isinstance(cfg.get("train"), dict) and isinstance(cfg.get("model"), dict):
        return cfg
    return None


def _row(category: str, evidence: str, action: str, saving_ms: float, method: str, command: str = "",
         numerics: bool = False) -> dict[str, Any]:
    return {"category": category, "evidence": evidence, "action": action, "command": command,
            "estimated_saving_ms": float(saving_ms), "method": method, "changes_numerics": numerics}


def _fusion(a: Analysis, peaks: DevicePeaks | None, cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    k = in_steps(a.kernels)
    mem_s = float(k.loc[k["category"].isin(MEMORY_BOUND), "dur_us"].sum()) / 1e6 / a.rank_steps
    ch = a.chains
    if ch.empty or peaks is None or peaks.hbm_tb_s <= 0:
        return []
    per = a.rank_steps
    save = fusion_estimate(ch, peaks.hbm_tb_s)
    saving_ms = float(save.sum()) / 1e3 / per
    chain_ms = float(ch["time_us"].sum()) / 1e3 / per
    gb = float(ch["bytes"].sum()) / 1e9 / per
    total = float(k["dur_us"].sum()) / 1e6 / per or 1.0
    by_ops = save.groupby(ch["ops"]).sum().sort_values(ascending=False) / 1e3 / per
    top = "; ".join(f"{ops} ({ms:.2f} ms)" for ops, ms in by_ops.head(3).items() if ms > 0)
    evidence = (f"elementwise and normalization kernels take {mem_s * 1e3:.1f} ms per step "
                f"({mem_s / total:.0%} of GPU time); {len(ch) / per:.0f} chains of 2+ ops take {chain_ms:.1f} ms "
                f"and move {gb:.1f} GB ({gb / (peaks.hbm_tb_s * ATTAINABLE_BW):.1f} ms at {ATTAINABLE_BW:.0%} of the "
                f"{peaks.hbm_tb_s:g} TB/s peak)"
                + (f"; most to gain: {top}" if top else ""))
    train = cfg["train"] if cfg else None
    if train is not None and not train.get("compile", False):
        action = "set train.compile=true (Inductor fuses RoPE, SwiGLU and RMSNorm into one kernel each)"
    elif train is not None:
        action = ("train.compile is on: the chains left run outside the compiled RoPE, SwiGLU and RMSNorm; "
                  "fuse them (compile the code around them, or a fused kernel)")
    else:
        action = ("torch.compile the model's elementwise and norm code (a block, or the regions around the "
                  "chains), or use fused kernels (fused RMSNorm/LayerNorm, SwiGLU, RoPE)")
    bw = peaks.hbm_tb_s * ATTAINABLE_BW
    method = ("per chain: measured kernel time minus the time its modeled ops' bytes (every input read, one "
              f"output written) take at {bw:.2f} TB/s ({ATTAINABLE_BW:.0%} of the {peaks.hbm_tb_s:g} TB/s peak, "
              "what a device copy measured); kernels without a bytes model count as intermediates (a chain with "
              "none modeled: not improvable); no intermediate tensor between modeled ops is assumed removed (the "
              "trace records no dataflow), which under-counts; checked against an H100 llama3-8b run (4 layers, "
              "seq 4096, mb 2) where train.compile=true measured 9.5 ms per step")
    return [_row("fusion", evidence, action, saving_ms, method)] if saving_ms >= MIN_SAVING_MS else []


def _optimizer(a: Analysis, cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    k = in_steps(a.kernels)
    k = k[k["category"] == OPTIMIZER]
    if k.empty:
        return []
    per = a.rank_steps
    t_s = float(k["dur_us"].sum()) / 1e6 / per
    names = " ".join(map(str, k["name"].unique())).lower()
    ops = " ".join(map(str, k["op"].unique())).lower()
    n = len(k) / per
    if "fused_adam" in ops or "fused_adam" in names or "fusedadam" in names or "_fused_sgd" in ops:
        style = "fused"
    elif "multi_tensor_apply" in names or "_foreach_" in ops:
        style = "foreach"
    else:
        style = "per-parameter"
    evidence = f"optimizer kernels take {t_s * 1e3:.1f} ms per step ({n:.0f} kernels per step, a {style} step)"
    if style != "fused":
        fused = "torch.optim.AdamW(..., fused=True)" if style == "foreach" else "fused=True (or foreach=True)"
        saving = t_s * (1 - 1 / FOREACH_TO_FUSED)
        return [_row("optimizer", evidence, f"use a fused optimizer step: {fused}", saving * 1e3,
                     f"rule of thumb, not measured on this trace: a fused step {FOREACH_TO_FUSED:g}x the {style} one "
                     "(one pass over each parameter's state instead of one per op)")]
    dp = a.world_size
    if cfg is not None:
        tp = int(cfg.get("parallel", {}).get("tp", 1) or 1)
        dp = max(1, a.world_size // max(tp, 1))
    if dp <= 1:
        return []
    saving = t_s * (1 - 1 / dp)
    action = ("shard the optimizer state over the data-parallel ranks (ZeRO-1 / FSDP: each rank updates 1/N "
              "of the parameters)")
    return [_row("optimizer", evidence, action, saving * 1e3,
                 f"the fused step's time divided by the {dp} data-parallel ranks (the update itself shrinks N times; "
                 "the added reduce-scatter/all-gather replace an all-reduce of the same bytes)")]


def _us(v: float) -> str:
    return f"{v:.1f} us" if v < 1000 else f"{v / 1e3:.1f} ms"


_GROUPED_SITE = ("primus_perf::grouped_gemm", "aten::_grouped_mm", "aten::bincount")


def _replay_note(rp: pd.DataFrame) -> str:
    scale = float(rp["host_scale"].mean())
    if scale >= 0.999:
        return "the host's recorded time"
    return (f"the host's time scaled by {scale:.2f} so the recorded replay lasts the unprofiled step time of the "
            "run's manifest (the profiler slows the host, not the GPU)")


def _replayed(a: Analysis) -> pd.DataFrame:
    """The host replays with each step's GPU idle time (``idle_s``): what no host-side change
    can exceed."""
    if a.host_replay.empty or a.temporal.empty:
        return pd.DataFrame()
    m = a.host_replay.merge(a.temporal[["rank", "step", "idle_s"]], on=["rank", "step"], how="left")
    m["idle_s"] = m["idle_s"].fillna(0.0)
    return m


def _capped(m: pd.DataFrame, saving: pd.Series) -> float:
    return float(np.minimum(saving.clip(lower=0.0), m["idle_s"]).mean())


def _host_syncs(a: Analysis) -> list[dict[str, Any]]:
    rp, sy = _replayed(a), a.syncs
    if rp.empty or sy.empty:
        return []
    saving = _capped(rp, rp["replay_s"] - rp["no_sync_s"])
    if saving * 1e3 < MIN_SAVING_MS:
        return []
    per = a.rank_steps
    by = sy.groupby("site")[["calls", "wait_s", "idle_after_s"]].sum() / per
    by = by.sort_values(["idle_after_s", "calls"], ascending=False)
    top = "; ".join(f"{site}: {r.calls:.0f} per step, {r.idle_after_s * 1e3:.2f} ms idle after"
                    for site, r in by.head(3).iterrows())
    evidence = (f"{by['calls'].sum():.0f} synchronizing calls per step (host waits {by['wait_s'].sum() * 1e3:.1f} ms); "
                f"the GPU idles {by['idle_after_s'].sum() * 1e3:.1f} ms per step after them (the queue drains while "
                f"the host waits, then refills): {top}")
    action = ("avoid the synchronizing calls: keep the values on the device (no .item(), .tolist(), .cpu() or "
              "tensors built from host lists inside the step; log the loss every N steps), or move them off the "
              "critical path (non_blocking copies into pinned memory, waited on later through an event)")
    if any(g in str(site) for site in by.index for g in _GROUPED_SITE):
        evidence += ("; the grouped GEMM takes its per-expert token counts on the host: the counts are read back "
                     "and the group offsets copied in, a sync each, in every MoE layer, forward and backward")
        action += ("; for the grouped GEMM: pass the group offsets as a device tensor (the cumulative sum of "
                   "the device counts: torch._grouped_mm takes them so), so no count reaches the host")
    return [_row("host: syncs", evidence, action, saving * 1e3,
                 "per step, the step replayed from the trace (the host's launches and syncs in order, each GPU event at "
                 "the later of its launch and its stream's previous event) with the syncs not waiting, against the "
                 f"same replay with them, at most the step's GPU idle time; {_replay_note(rp)}; mean over steps")]


def _host_launch(a: Analysis, cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    rp = _replayed(a)
    if rp.empty:
        return []
    bound = _capped(rp, rp["replay_s"] - rp["no_host_s"])
    doubled = _capped(rp, rp["replay_s"] - rp["double_gpu_s"] / 2)
    mb = cfg["train"].get("micro_batch") if cfg is not None else None
    use_mb = isinstance(mb, int) and mb > 0
    saving = doubled if use_mb else bound
    if saving * 1e3 < MIN_SAVING_MS:
        return []
    lt, cp = a.launches, a.critical_path
    launches = float(lt["launches"].sum()) / a.rank_steps if len(lt) else 0.0
    k = in_steps(a.kernels)
    small = float(k["dur_us"].median()) if len(k) else 0.0
    evidence = (f"{launches:.0f} launches per step, median GPU event {_us(small)}"
                + (f", launch-to-start median {_us(lt['delay_p50_us'].median())}, queue depth median "
                   f"{lt['queue_p50'].median():.0f}" if len(lt) else "")
                + (f"; {(cp['cpu_s'] + cp['launch_s']).mean() * 1e3:.1f} ms of the {cp['path_s'].mean() * 1e3:.1f} ms "
                   "critical path is on the host" if len(cp) else "")
                + f"; with the host's launch time gone (syncs kept) the step would be {bound * 1e3:.1f} ms shorter")
    method = ("per step, the step replayed from the trace (the host's launches and syncs in order, each GPU event at "
              "the later of its launch and its stream's previous event) ")
    if use_mb:
        action = (f"set train.micro_batch={2 * mb} (now {mb}): the host's work per step stays, each launch carries "
                  "twice the work (if it fits in memory); CUDA graphs (torch.compile mode='reduce-overhead') need the "
                  "syncs gone first")
        method += ("with every GPU event twice as long and the host unchanged, halved (per step of the original "
                   f"tokens), against the recorded replay, at most the step's GPU idle time; {_replay_note(rp)}; mean over "
                   "steps")
    else:
        action = ("capture the step in CUDA graphs (torch.cuda.graphs, torch.compile(mode='reduce-overhead'); a "
                  "sync in the step breaks the capture) or run a larger micro-batch so each launch carries more work")
        method += (f"with the host's time between and in launches removed, the syncs kept, against the recorded "
                   f"replay, at most the step's GPU idle time: the bound for launching faster; {_replay_note(rp)}; mean "
                   "over steps")
    return [_row("host: launches", evidence, action, saving * 1e3, method)]


def _communication(a: Analysis, cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    if a.temporal.empty:
        return []
    exposed = float(a.temporal["exposed_comm_s"].mean())
    if exposed * 1e3 < MIN_SAVING_MS:
        return []
    cb = a.collective_bandwidth
    top = ""
    collectives: set[str] = set()
    if len(cb):
        by = cb.groupby("collective")["time_s"].sum().sort_values(ascending=False)
        collectives = set(by.index[:3])
        top = "; ".join(f"{c} {t * 1e3:.1f} ms" for c, t in by.head(3).items())
    evidence = (f"{exposed * 1e3:.1f} ms per step of communication is not overlapped by compute "
                f"({exposed / float(a.temporal['span_s'].mean()):.0%} of the step)" + (f"; by collective: {top}" if top else ""))
    actions = []
    if collectives & {"all_to_all", "all_to_allv"}:
        actions.append("keep expert-parallel groups inside a node (NVLink/xGMI) and overlap dispatch/combine with "
                       "the shared expert or the next micro-batch")
    if collectives & {"all_reduce", "reduce_scatter", "all_gather"}:
        actions.append("overlap gradient reduction with the backward pass (DDP bucket_cap_mb, FSDP prefetch) and "
                       "keep tensor parallelism inside a node")
    if not actions:
        actions.append("overlap communication with compute (separate streams, larger buckets)")
    if cfg is not None:
        actions.append(f"check the layout: parallel.tp={cfg.get('parallel', {}).get('tp', 1)} over "
                       f"{a.world_size} ranks")
    return [_row("communication", evidence, "; ".join(actions), exposed * 1e3,
                 "all of the exposed communication: the upper bound, reached only when it is hidden entirely")]


def _trace_arg(a: Analysis) -> str:
    paths = [Path(t) for t in a.traces]
    parents = {p.parent for p in paths}
    if len(paths) > 1 and len(parents) == 1 and (next(iter(parents)) / "manifest.json").exists():
        return shlex.quote(str(next(iter(parents))))
    return " ".join(shlex.quote(str(p)) for p in paths)


def _tuning(a: Analysis) -> list[dict[str, Any]]:
    t = tune_next(a.problem_tables(), top=1_000_000)
    if t.empty or in_steps(a.kernels).empty:
        return []
    att = t["kind"].map(ATTAINABLE).astype(np.float64)
    t = t.assign(saving=t["time_s"] * (1 - t["pct_roofline"].astype(np.float64) / att).clip(lower=0.0).fillna(0.0))
    out = []
    for kind, g in t.groupby("kind", sort=False):
        saving = float(g["saving"].sum())
        if saving * 1e3 < MIN_SAVING_MS:
            continue
        g = g.sort_values("saving", ascending=False)
        below = g[g["saving"] > 0]
        best = below.iloc[0]
        label = kinds.get(str(kind)).title if str(kind) in kinds.names() else str(kind)
        evidence = (f"{len(below)} {label} problem(s) below {ATTAINABLE[str(kind)]:.0%} of the roofline take "
                    f"{below['time_s'].sum() * 1e3:.1f} ms per step; most to gain: {best['label']} at "
                    f"{best['pct_roofline']:.0%} ({best['time_s'] * 1e3:.2f} ms); one problem alone: {best['command']}")
        out.append(_row(f"tuning: {kind}", evidence, f"tune the trace's {label} problems",
                        saving * 1e3,
                        f"per problem: time x (1 - roofline fraction / {ATTAINABLE[str(kind)]:g}), the fraction of the "
                        "datasheet peak the best available kernels reach; problems without a roof count 0",
                        command=f"primus-tune {str(kind).replace('_', '-')} --trace {_trace_arg(a)}"))
    return out


def _fp8(a: Analysis, peaks: DevicePeaks | None) -> list[dict[str, Any]]:
    g = a.gemm_problems
    if peaks is None or peaks.peak_tflops("f8e4m3") is None or g.empty or in_steps(a.kernels).empty:
        return []
    big = [isinstance(p, GemmProblem) and min(p.m, p.n, p.k) >= FP8_MIN_DIM for p in g["problem"]]
    c = g[np.asarray(big, dtype=bool) & g["dtype"].isin(_FP8_DTYPES)]
    if c.empty:
        return []
    t_s = float(c["time_s"].sum())
    saving = t_s * (1 - 1 / FP8_GEMM_SPEEDUP)
    evidence = (f"{len(c)} bf16/f16 GEMM problem(s) with every dimension >= {FP8_MIN_DIM} take {t_s * 1e3:.1f} ms "
                f"per step on a device with an FP8 peak of {peaks.peak_tflops('f8e4m3'):g} TFLOP/s "
                f"({peaks.peak_tflops('f8e4m3') / (peaks.peak_tflops(str(c['dtype'].iloc[0])) or 1):.0f}x bf16)")
    return [_row("fp8", evidence, "try the FP8 path (FP8 GEMMs change the numerics: compare the loss curve)",
                 saving * 1e3,
                 f"the candidates' time x (1 - 1/{FP8_GEMM_SPEEDUP:g}): torchao float8 tensorwise under torch.compile "
                 "made an H100 Llama 8B (4 layers) step's GEMMs 1.29x faster, casts included",
                 command="primus-tune loop --fp8", numerics=True)]


def recommend(a: Analysis) -> pd.DataFrame:
    """The recommendations of an analysis, ranked (see the module docstring)."""
    peaks = lookup_peaks(str(a.device.get("name", "")))
    cfg = trainer_config(a.manifest)
    rows = [*_fusion(a, peaks, cfg), *_optimizer(a, cfg), *_host_syncs(a), *_host_launch(a, cfg),
            *_communication(a, cfg), *_tuning(a),
            *_fp8(a, peaks)]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.DataFrame(rows, columns=COLUMNS)
    return df.sort_values(["changes_numerics", "estimated_saving_ms"], ascending=[True, False], kind="stable",
                          ignore_index=True)
