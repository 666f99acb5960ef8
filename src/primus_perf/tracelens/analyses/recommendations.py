"""What to do next: one recommendation per kind of waste the trace shows, each with the time
it could save per step, how that estimate was made, and the facts about the workload it
rests on (:mod:`.workload`): a recommendation whose condition does not hold is not made.

Each row: ``category``, ``lever`` (the setting it changes: ``train.compile=block`` for a
``primus-train`` run, the step tuner's script lever for another program, ``compile=block``,
``micro_batch=8``, ``optimizer=fused``, else a short name; the key of a measured row, matched
by lever name: :data:`LEVER_NAMES`), ``evidence`` (what the
trace shows), ``condition`` (what it rests on: training or inference, the parallel layout,
torch.compile, what the step waits on), ``action`` (the trainer's config key when the
manifest says the run came from ``primus-train``, else code advice), ``command`` (a tuner
command, when one applies), ``estimated_saving_ms`` (per step), ``measured_saving_ms`` (the
step tuner's measurement of the same lever, where the run has one: :data:`MEASURED`) and
``measured_against`` (the setting it was measured against: ``the default`` is the traced one),
``method``, ``changes_numerics`` and ``settings`` (the lever as data, ``{"train.micro_batch": 8}``:
what the step tuner reads; empty for a name). Rows are ranked by the estimated saving, except that
changes of the numerics (FP8) come after every change that keeps them.

The estimates, one per category (each the saving of that change alone; they do not add up
when they touch the same kernels):

- ``fusion``: chains of elementwise and normalization kernels (:mod:`.fusion`): measured
  time minus the time their bytes take at the bandwidth a device reaches (88% of its peak).
- ``optimizer`` (training only): a per-parameter or foreach Adam/AdamW step -> a fused one:
  the step's own kernels less the fused step's time (:func:`fused_adam_s`: its bytes at
  :data:`FUSED_BW` of the HBM peak or its elements at :data:`FUSED_RATE`, the slower; the
  parameters are the weights a forward pass reads, :mod:`.workload`), a third of its time (a
  rule of thumb) where they are not recorded; a fused step on many data-parallel ranks that do
  not shard it -> sharding (each rank updates 1/N); nothing where FSDP or ZeRO already shards it.
- ``data loading``: the host fetching batches (``DataLoader.__next__``) while the GPU
  idles: the step replayed without it (:mod:`.host_idle`), at most the GPU's idle time.
- ``host: syncs``: the step replayed without the syncs' waits.
- ``host: launches``: a host too slow to keep the queue filled (the data loading and the
  syncs kept): for the trainer, a micro-batch twice as large (the replay with the per-token
  GPU events twice as long, per-parameter ones (optimizer, data-parallel collectives) as
  recorded, halved); otherwise the replay without the host's launch time (CUDA graphs'
  bound).
- ``accumulation``: several micro-batches a step (a primus-train run's config, or any trace's
  backward passes per optimizer step): the work done once per micro-batch that a larger one
  at the same global batch does once (:mod:`.micro_batch`).
- ``recompute`` (training only): activation checkpointing, the blocks' forward run again in the
  backward pass (:mod:`..link`: forward ops inside a backward node): those ops' GPU time, which
  keeping the activations saves where they fit in memory.
- ``attention path``: attention off its causal fused path, a mask given or the scores
  materialized, against the fused causal kernel on the same problem (:mod:`.attention_path`).
- ``communication``: the exposed communication (:mod:`.breakdown`), all of it (the upper
  bound), or where FSDP gathers the parameters again in the backward pass, what keeping them
  gathered saves (its all-gathers' exposed time and their share of the gathers' copies), with
  advice by what the collectives move (:mod:`.collectives` roles): data-parallel
  gradients (DDP buckets, FSDP prefetch; a sharded optimizer's reduce-scatter and all-gather
  (:mod:`.sharding`) overlapped with the backward pass and the next forward, with each one's
  exposed share), tensor-parallel activations, MoE tokens
  (expert-parallel dispatch/combine), embedding lookups (DLRM-style all-to-all).
- ``tuning`` (GEMM, grouped GEMM, attention; :mod:`.tune_next`): per problem ``time *
  (1 - roofline fraction / attainable)`` (the kind's trace part's) over the time its kernels run alone (a kernel
  beside a communication kernel shares the GPU: its speed is not the kernel's choice);
  dense bf16/f16 GEMMs on NVIDIA at most :data:`GEMM_TUNING_GAIN` of their time.
- ``memory format``: the NCHW<->NHWC conversions convolution ops launch around their kernels
  (:mod:`.precision`): their time, which a channels_last model does not run.
- ``precision``: fp32 GEMMs and convolutions (:mod:`.precision`): TF32 math, and bf16 (fp16 on
  a device without it) autocast; each problem's FLOPs at the fraction of the roofline it
  reaches now, capped at what the best kernels reach, of the TF32 or 16-bit roof, against its
  time; changes the numerics.
- ``fp8``: bf16/f16 GEMMs with every dimension at least ``FP8_MIN_DIM`` on a device with an
  FP8 peak: training: ``time * (1 - 1/FP8_GEMM_SPEEDUP)`` minus the casts (:func:`fp8_casts`:
  weights per step, activations and gradients per token, at :data:`CAST_BYTES` a element),
  not advised where the data-parallel ranks gather the parameters per layer (FSDP2 measured
  slower);
  inference: the forward GEMMs, activations cast per token, weights once offline.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.base.devices import DevicePeaks, lookup_peaks
from primus_perf.problems import GemmProblem
from primus_perf.tracelens.analyses.attention_path import FUSED_FRACTION, off_path
from primus_perf.tracelens.analyses.breakdown import covered
from primus_perf.tracelens.analyses.fusion import ATTAINABLE_BW, MEMORY_BOUND, fusion_estimate
from primus_perf.tracelens.analyses.hotspots import MODELED, in_steps, problem_keys
from primus_perf.tracelens.analyses.micro_batch import comm_exposure, per_micro_batch
from primus_perf.tracelens.analyses.precision import fp32_work, layout_transposes, low_precision
from primus_perf.tracelens.analyses.sharding import SHARDS_OPTIMIZER, SHARDS_PARAMETERS
from primus_perf.tracelens.analyses.tune_next import tune_next
from primus_perf.tracelens.categories import (
    ATTENTION_BWD,
    ATTENTION_FWD,
    COMMUNICATION,
    OPTIMIZER,
)

# ``tracelens.analyze.Analysis``, which imports this module: no import back
Analysis = Any

COLUMNS = ["category", "lever", "evidence", "condition", "action", "command", "estimated_saving_ms",
           "measured_saving_ms", "measured_against", "method", "changes_numerics", "settings"]
MIN_SAVING_MS = 0.01  # below this a recommendation is noise
# the syncs' cost (the replay without them), as a share of the step, above which the fusion estimate is an
# upper bound of the step's saving (H100: MoE runs with a sync per layer 1.0-3.1%, dense runs under 0.01%)
SYNC_BOUND = 0.005
# dense bf16 GEMMs on NVIDIA: the cuBLASLt heuristic's choice within ~2% of the best candidate
# (H100, cuBLASLt 13.1); tuned caches ran 0.995-1.013x on six held-out programs
GEMM_TUNING_GAIN = 0.02
# attention whose kernels are cuDNN's on NVIDIA: the fastest SDPA backend measured; tuning an H100
# llama3-8b problem (b1 h32 s4096 d128 causal) chose it again at 1.000x (flash 0.56x, Triton 0.72x),
# the benchmark's b16 h16 s1024 d64 too: the same cap as the GEMMs'
ATTENTION_TUNING_GAIN = 0.02
_CUDNN = re.compile(r"cudnn", re.I)
FOREACH_TO_FUSED = 1.5  # the rule of thumb where the parameters' count is not known
# torch's fused Adam/AdamW (``_fused_adamw_``): per parameter element it reads the parameter, its
# gradient and both moments and writes the parameter and both moments
FUSED_ADAM_ACCESSES = 7
# ... and torch's foreach AdamW: decoupled weight decay (2), lerp_ (3), mul_ (2), addcmul_ (3), sqrt
# (2), div_ (2), add_ (2), addcdiv_ (4); Adam has no weight-decay pass
FOREACH_ADAM_ACCESSES = 20
# the fraction of the HBM peak the fused step reaches where its bytes bound it (fp32 parameters):
# 0.76 on an H100 (llama3-8b 4 layers: 53.8 GB in 21.0 ms), 0.68 on an H200 (1.49 G elements, 41.6 GB
# in 12.7 ms; tests/data/traces/h200_dp2)
FUSED_BW = 0.70
# the elements a second it updates where its arithmetic bounds it: bf16 parameters on an H200,
# 2.02 G elements in 12.9 ms (28.3 GB: 46% of the peak)
FUSED_RATE = 1.57e11
# FP8 (torchao float8 tensorwise, under torch.compile): the GEMMs alone 1.5x their bf16 time,
# the casts apart (:func:`fp8_casts`): with them this reproduces the 19.9 ms an H100 llama3-8b
# step (4 layers, seq 4096, micro-batch 2; 88.1 ms of candidate GEMMs) measured (146.0 -> 126.1 ms)
FP8_GEMM_SPEEDUP = 1.5
CAST_BYTES = 3  # per element cast: read bf16, write fp8 (the amax read fused by torch.compile)
FP8_MIN_DIM = 1024
_FP8_DTYPES = ("bf16", "f16")
# step-tuner measurements a run may carry: rows of {"lever", "value"?, "estimate_ms"?, "measured_ms", "kept"?}
MEASURED = "measured"
_OPTIMIZER_CLASS = re.compile(r"^Optimizer\.step#(\w+)\.step")
_FUSED = re.compile(r"fused_adam|FusedAdam|AdamFunctor|FusedOptimizer|fused_sgd|\bFused", re.I)
_TORCH_FUSED = ("Adam", "AdamW", "SGD", "Adagrad")  # torch.optim classes with fused=True


def trainer_config(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The trainer's config when the run came from ``primus-train`` (its manifest records the
    config with ``train`` and ``model`` sections), else None."""
    cfg = manifest.get("config") if isinstance(manifest, dict) else None
    if isinstance(cfg, dict) and isinstance(cfg.get("train"), dict) and isinstance(cfg.get("model"), dict):
        return cfg
    return None


def _row(category: str, lever: str | dict[str, Any], evidence: str, condition: str, action: str, saving_ms: float,
         method: str, command: str = "", numerics: bool = False) -> dict[str, Any]:
    """``lever``: the settings advised (key -> JSON-typed value: the row's ``settings``, what the
    step tuner reads; its ``lever`` text is ``key=value`` each), or a name."""
    settings = lever if isinstance(lever, dict) else {}
    text = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items())
    return {"category": category, "lever": text or lever, "evidence": evidence, "condition": condition, "action": action,
            "command": command, "estimated_saving_ms": float(saving_ms), "measured_saving_ms": np.nan,
            "measured_against": None,
            "method": method, "changes_numerics": numerics, "settings": settings}


def _mode(w: dict[str, Any]) -> str:
    mode = w.get("mode", "unknown")
    return f"{'an' if mode[:1] in 'aeiou' else 'a'} {mode} trace ({w.get('mode_evidence', '')})"


def _compile_text(w: dict[str, Any]) -> str:
    c = w.get("compiled")
    return "torch.compile on" + (f" ({w['compiled_by']})" if w.get("compiled_by") else "") if c else \
        "torch.compile off (train.compile)" if c is False else "torch.compile not seen in the trace"


def _fusion(a: Analysis, w: dict[str, Any], peaks: DevicePeaks | None, cfg: dict[str, Any] | None
            ) -> list[dict[str, Any]]:
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
    shared_ms = float(ch["shared_us"].sum()) / 1e3 / per
    experts_ms = float(ch.loc[ch["experts"].astype(bool), "time_us"].sum()) / 1e3 / per if "experts" in ch else 0.0
    rp = _replayed(a)
    syncs = float(a.syncs["calls"].sum()) / per if len(a.syncs) else 0.0
    sync_bound = not rp.empty and _capped(rp, rp["replay_s"] - rp["no_sync_s"]) >= SYNC_BOUND * float(rp["span_s"].mean())
    evidence = (f"elementwise and normalization kernels take {mem_s * 1e3:.1f} ms per step "
                f"({mem_s / total:.0%} of GPU time); {len(ch) / per:.0f} chains of 2+ ops take {chain_ms:.1f} ms "
                f"and move {gb:.1f} GB ({gb / (peaks.hbm_tb_s * ATTAINABLE_BW):.1f} ms at {ATTAINABLE_BW:.0%} of the "
                f"{peaks.hbm_tb_s:g} TB/s peak)"
                + (f"; {shared_ms:.1f} ms of the chains' time runs beside communication kernels and is left out"
                   if shared_ms >= MIN_SAVING_MS else "")
                + (f"; {experts_ms:.1f} ms runs between grouped GEMMs (the experts' activations, on rows whose count "
                   "per expert changes every step: compiled code leaves them eager; a grouped GEMM with the "
                   "activation fused would take them) and is left out" if experts_ms >= MIN_SAVING_MS else "")
                + (f"; most to gain: {top}" if top else ""))
    if sync_bound:
        evidence += (f"; the host makes {syncs:.0f} synchronizing calls a step: a compiled region's graph breaks at each and "
                     "adds host time there, while the GPU waits, so the step saves less than this GPU time")
    compiled = w.get("compiled")
    if cfg is not None and str(cfg["train"].get("compile", "off")).lower() != "block":
        lever = {"train.compile": "block"}
        action = ("set train.compile=block (each transformer block compiled whole: Inductor fuses the chains between "
                  "its GEMMs, RoPE, SwiGLU, RMSNorm and the residual adds; train.compile=pointwise fuses only those "
                  "three and measured about half the saving)")
    elif compiled:
        lever = "fusion"
        action = ("torch.compile is on: the chains left run outside the compiled regions; compile the code around "
                  "them (a whole block), or use fused kernels")
    else:
        lever = {"compile": "block"}
        action = ("torch.compile each transformer block (a Hugging Face model: for layer in model.model.layers: "
                  "layer.compile()): Inductor fuses the chains between its GEMMs (RMSNorm, SwiGLU, RoPE, the residual "
                  "adds); compiling the whole model instead also compiles transformers' attention-mask code, which "
                  "then builds the causal mask and moves SDPA off its causal kernel; or use fused kernels (fused "
                  "RMSNorm/LayerNorm, SwiGLU, RoPE)")
    bw = peaks.hbm_tb_s * ATTAINABLE_BW
    method = ("per chain: measured kernel time minus the time its modeled ops' bytes (every input read, one "
              "output written), less the intermediates a fused kernel does not read back (each call is assumed to "
              f"read what the call before it wrote: the trace records no dataflow), take at {bw:.2f} TB/s "
              f"({ATTAINABLE_BW:.0%} of the {peaks.hbm_tb_s:g} TB/s peak, what a device copy measured); kernels "
              "without a bytes model count as intermediates (a chain with none modeled: not improvable); only the "
              "share of a chain's time with no communication kernel beside it counts; checked against "
              "train.compile=block on H100s (llama3-8b, seq 4096, 16 sequences a GPU, 8 layers): one GPU 187.8 ms "
              "estimated, 215.9 measured; FSDP2 over 2 GPUs 173.1 against 143.5-159.7; over 4 GPUs 111.7 against "
              "159.6; 4 layers at micro-batch 2: 12.6 ms a step against 12.7"
              + ("; an upper bound here: the step waits on the host's syncs, where compiled regions break their "
                 "graphs and add host time that the uncompiled trace cannot show (on H100 MoE runs, one GPU, "
                 "train.compile=block cut the GPU time 57.0 ms a step on qwen3-30b-a3b, estimated 54.3, and 54.0 on "
                 "mixtral-8x7b, estimated 35.5, while the step saved 32.6 and 20.7 ms: its GPU idled longer)"
                 if sync_bound else ""))
    condition = f"chains of 2+ memory-bound op calls on one stream with no other kernel between them; {_compile_text(w)}"
    return [_row("fusion", lever, evidence, condition, action, saving_ms, method)] if saving_ms >= MIN_SAVING_MS else []


def fused_adam_s(elements: float, element_bytes: int, hbm_tb_s: float) -> float:
    """Seconds torch's fused Adam/AdamW step takes over ``elements`` parameter elements of
    ``element_bytes`` each: its bytes (:data:`FUSED_ADAM_ACCESSES` per element) at
    :data:`FUSED_BW` of the HBM peak, or its elements at :data:`FUSED_RATE`, the slower."""
    if elements <= 0 or hbm_tb_s <= 0:
        return 0.0
    return max(FUSED_ADAM_ACCESSES * elements * element_bytes / (FUSED_BW * hbm_tb_s * 1e12), elements / FUSED_RATE)


def _optimizer(a: Analysis, w: dict[str, Any], cfg: dict[str, Any] | None, peaks: DevicePeaks | None
               ) -> list[dict[str, Any]]:
    k = in_steps(a.kernels)
    k = k[k["category"] == OPTIMIZER]
    if k.empty or w.get("mode") != "training":
        return []
    per = a.rank_steps
    in_step = k["in_optimizer"].to_numpy(dtype=bool) if "in_optimizer" in k.columns else np.ones(len(k), dtype=bool)
    outside_s = float(k.loc[~in_step, "dur_us"].sum()) / 1e6 / per
    if in_step.any():  # the optimizer step's own kernels (gradient clipping's foreach kernels stay)
        k = k[in_step]
    t_s = float(k["dur_us"].sum()) / 1e6 / per
    names = " ".join(map(str, k["name"].unique()))
    ops = " ".join(map(str, k["op"].unique()))
    n = len(k) / per
    m = _OPTIMIZER_CLASS.search(str(w.get("optimizer") or ""))
    cls = m.group(1) if m else ""
    if _FUSED.search(f"{names} {ops} {cls}"):
        style = "fused"
    elif "multi_tensor_apply" in names or "_foreach_" in ops:
        style = "foreach"
    else:
        style = "per-parameter"
    evidence = (f"optimizer kernels take {t_s * 1e3:.1f} ms per step ({n:.0f} kernels per step, a {style} "
                f"{cls or 'optimizer'} step)"
                + (f"; {outside_s * 1e3:.1f} ms of foreach kernels outside the step (gradient clipping, a norm) "
                   "stay as they are" if outside_s * 1e3 >= MIN_SAVING_MS else ""))
    if style != "fused":
        if cls not in _TORCH_FUSED and not (cfg is not None and not cls):
            return []  # no fused implementation in torch to point at
        lever = {"train.optimizer": "fused"} if cfg is not None else {"optimizer": "fused"}
        action = ("set train.optimizer=fused" if cfg is not None
                  else f"use a fused optimizer step: torch.optim.{cls or 'AdamW'}(..., fused=True)")
        condition = (f"{_mode(w)}; a {style} {cls or 'optimizer'} step, which torch also implements fused")
        elements = float(w.get("parameters") or 0.0)
        if w.get("sharding") == SHARDS_PARAMETERS:
            elements /= max(1, int(w.get("data_parallel") or 1))  # each rank steps its shards
        size = 2 if re.search(r"BFloat16|Half|\bbf16|\bf16", names) else 4
        if cls in ("Adam", "AdamW", "") and elements > 0 and peaks is not None and peaks.hbm_tb_s > 0:
            # at least its share of the foreach step's accesses at the foreach kernels' own speed (a
            # count of the parameters that misses some: convolutions' or fused ops' weights)
            floor_s = t_s * FUSED_ADAM_ACCESSES / (FOREACH_ADAM_ACCESSES - (2 if cls == "Adam" else 0))
            fused_s = max(fused_adam_s(elements, size, peaks.hbm_tb_s), floor_s)
            saving = max(0.0, t_s - fused_s)
            if saving * 1e3 < MIN_SAVING_MS:
                return []
            evidence += (f"; {elements / 1e9:.2f} G parameter elements of {size} bytes a rank (the weights one forward "
                         f"pass reads{', sharded' if w.get('sharding') == SHARDS_PARAMETERS else ''}): a fused step "
                         f"{fused_s * 1e3:.1f} ms")
            method = (f"the step's kernels as measured less the fused step's time: the larger of its bytes "
                      f"({FUSED_ADAM_ACCESSES} accesses an element: the parameter, its gradient and both moments read, "
                      f"the parameter and the moments written) at {FUSED_BW:.0%} of the {peaks.hbm_tb_s:g} TB/s peak "
                      f"(what torch's fused AdamW reached with fp32 parameters: 76% on an H100, 68% on an H200) and its "
                      f"elements at {FUSED_RATE / 1e9:.0f} G a second (what it reached with bf16 parameters on an H200, "
                      "where its arithmetic bounds it), and at least the fused step's share of the foreach step's "
                      f"accesses ({FUSED_ADAM_ACCESSES} of {FOREACH_ADAM_ACCESSES} an element) at the foreach kernels' "
                      "speed; the parameters are the weights the forward's linear, matmul, embedding and convolution ops "
                      "read (a tied embedding counted twice); checked on an H200 (Qwen2 7B dims, 4 layers, "
                      "bf16): foreach 26.6 ms of kernels, fused 12.9 measured, 12.9 estimated; the step 12 ms shorter"
                      + ("; an upper bound here: compiled code hides some weights' ops (an embedding's lookup fused into "
                         "a kernel), so fewer parameters are counted and the fused step comes out faster"
                         if w.get("compiled") else ""))
            return [_row("optimizer", lever, evidence, condition, action, saving * 1e3, method)]
        saving = t_s * (1 - 1 / FOREACH_TO_FUSED)
        if saving * 1e3 < MIN_SAVING_MS:
            return []
        return [_row("optimizer", lever, evidence, condition, action, saving * 1e3,
                     f"rule of thumb, not measured on this trace: a fused step {FOREACH_TO_FUSED:g}x the {style} one "
                     "(one pass over each parameter's state instead of one per op; the parameters' count is not "
                     "recorded here: no linear, matmul or embedding op with shapes)")]
    dp = int(w.get("data_parallel") or 1)
    if dp <= 1 or w.get("sharded"):  # nothing to shard, or already sharded (FSDP, ZeRO)
        return []
    saving = t_s * (1 - 1 / dp)
    action = ("set parallel.dp_shard=" + str(dp) + " (FSDP2: parameters, gradients and optimizer state sharded)"
              if cfg is not None else "shard the optimizer state over the data-parallel ranks (ZeRO-1 / FSDP: each "
              "rank updates 1/N of the parameters)")
    condition = (f"{_mode(w)}; {dp} data-parallel ranks, each updating every parameter (no FSDP/ZeRO sharding "
                 "seen" + (", DDP" if w.get("ddp") else "") + ")")
    return [_row("optimizer", f"parallel.dp_shard={dp}" if cfg is not None else "sharding", evidence, condition,
                 action, saving * 1e3,
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
    can exceed; ``idle_before_s``: the idle in the replay itself, from the step's start on the
    host (the data loading before a step's first kernel is idle there, and in the step before
    it by the temporal breakdown)."""
    if a.host_replay.empty or a.temporal.empty:
        return pd.DataFrame()
    m = a.host_replay.merge(a.temporal[["rank", "step", "idle_s", "busy_s"]], on=["rank", "step"], how="left")
    m["idle_s"] = m["idle_s"].fillna(0.0)
    m["idle_before_s"] = (m["replay_s"] - m["busy_s"].fillna(0.0)).clip(lower=0.0)
    return m


def _capped(m: pd.DataFrame, saving: pd.Series, idle: str = "idle_s") -> float:
    return float(np.minimum(saving.clip(lower=0.0), m[idle]).mean())


_REPLAY = ("per step, the step replayed from the trace (the host's launches, syncs and data loading in order, each "
           "GPU event at the later of its launch and its stream's previous event) ")


def _data_loading(a: Analysis, w: dict[str, Any]) -> list[dict[str, Any]]:
    rp = _replayed(a)
    data_s = float(w.get("data_loading_s") or 0.0)
    if rp.empty or data_s <= 0:
        return []
    saving = _capped(rp, rp["replay_s"] - rp["no_data_s"], "idle_before_s")
    if saving * 1e3 < MIN_SAVING_MS:
        return []
    idle = float(rp["idle_s"].mean())
    evidence = (f"the host spends {data_s * 1e3:.1f} ms per step in DataLoader.__next__ while the GPU idles "
                f"{idle * 1e3:.1f} ms per step")
    action = ("load batches in worker processes ahead of the step: DataLoader(num_workers=N > 0, pin_memory=True, "
              "persistent_workers=True, prefetch_factor=2), and .to(device, non_blocking=True)")
    return [_row("data loading", "data loading", evidence, "the step waits for the next batch on the host", action,
                 saving * 1e3, _REPLAY + "with the data loading taking no time, against the recorded replay, at most "
                 f"the step's GPU idle time; {_replay_note(rp)}; mean over steps")]


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
    return [_row("host: syncs", "syncs", evidence, "the GPU idles after calls that make the host wait for it", action,
                 saving * 1e3, _REPLAY + "with the syncs not waiting, against the same replay with them, at most the "
                 f"step's GPU idle time; {_replay_note(rp)}; mean over steps")]


def _accumulates(cfg: dict[str, Any], w: dict[str, Any]) -> bool:
    """The run accumulates gradients over micro-batches (its global batch is more than one
    micro-batch per data-parallel rank): the micro-batch is then not the optimizer's batch."""
    t = cfg["train"]
    gb, mb = t.get("global_batch"), t.get("micro_batch")
    return isinstance(gb, int) and isinstance(mb, int) and gb > mb * int(w.get("data_parallel") or 1)


def _accumulation(a: Analysis, w: dict[str, Any], cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A larger micro-batch at the same global batch where the step accumulates gradients over
    several micro-batches (:mod:`.micro_batch`): a primus-train run's config says so (advised
    twice its micro-batch), any other trace by its backward passes per optimizer step (advised
    all of them in one: the micro-batch times the passes)."""
    if w.get("mode") != "training":
        return []
    traced = int(w.get("micro_batches") or 0)
    if cfg is not None:
        if not _accumulates(cfg, w):
            return []
        t = cfg["train"]
        gb, mb, dp = int(t["global_batch"]), int(t["micro_batch"]), int(w.get("data_parallel") or 1)
        if gb % (2 * mb * dp):
            return []  # a doubled micro-batch does not divide the global batch
        m, k, new_mb = gb // (mb * dp), 2, 2 * mb
        lever = {"train.micro_batch": new_mb}
    else:
        if traced < 2:
            return []
        mb = int(w.get("micro_batch") or 0)
        m, k, new_mb = traced, traced, mb * traced
        lever = {"micro_batch": new_mb} if mb else "micro_batch"
    sharded = w.get("sharding") == SHARDS_PARAMETERS
    cost = per_micro_batch(a, m, k, _replayed(a), sharded, placed=traced == m)
    if cost.saved_ms < MIN_SAVING_MS:
        return []
    top = ", ".join(f"{str(op).removeprefix('aten::')} {ms:.1f} ms" for op, ms in cost.by_op.head(3).items())
    dp = int(w.get("data_parallel") or 1)
    if cfg is not None:
        told = (f"{m} micro-batches a step (global batch {gb} = micro-batch {mb} x {m}"
                + (f" x {dp} data-parallel ranks" if dp > 1 else "") + ")")
    else:
        told = (f"{m} backward passes per optimizer step (the autograd engine's passes, told by their nodes' "
                f"sequence numbers): gradients accumulated over {m} micro-batches"
                + (f" of {mb} sequences of {w.get('tokens')} tokens" if mb else ""))
    evidence = (told + f"; per-parameter work outside the optimizer step takes {cost.param_ms:.1f} ms per step"
                + (f" ({top})" if top else "") + ": the gradients' accumulation, the weights' casts"
                + (", FSDP's copies into and out of its collectives' buffers" if sharded else "")
                + ", once per micro-batch"
                + (f"; the parameters' collectives (FSDP's all-gathers and reduce-scatters, once per micro-batch) are "
                   f"exposed {cost.comm_ms:.1f} ms per step" if cost.comm_ms else "")
                + (f"; the GPU idles {cost.sync_ms:.1f} ms per step waiting on the host once per micro-batch"
                   + (f" (syncs: {', '.join(cost.syncs[:2])}" + ("; launches" if cost.placed else "") + ")"
                      if cost.syncs else " (launches)")
                   if cost.sync_ms >= MIN_SAVING_MS else ""))
    condition = (f"{_mode(w)} that accumulates gradients over {m} micro-batches (the global batch, the "
                 "optimizer's, stays the same)")
    if cfg is not None:
        action = (f"set train.micro_batch={new_mb} (now {mb}; {m // 2} micro-batches of the same global batch): the "
                  "per-micro-batch work per step halves; each doubling that fits in memory halves what is left "
                  "(primus-tune step measures which fits)")
    else:
        now = f" (now {mb} x {m})" if mb else ""
        action = (f"run the {m} micro-batches as one{now}, where it fits in memory: micro-batch "
                  f"{new_mb or str(m) + 'x'} with 1 accumulation step, the same global batch; in a script, "
                  f"mb = primus_perf.knob(\"micro_batch\", {mb or 1}) and the accumulation steps derived from it, so that "
                  "`primus-tune step -- train.py` measures which micro-batch fits and wins; with the Hugging Face "
                  f"Trainer, per_device_train_batch_size={new_mb or 'N'} and gradient_accumulation_steps=1; each "
                  "doubling that fits saves part of it")
    placed = ("each GPU event in its micro-batch (the backward pass whose window holds its launch, or the forward "
              "before it)" if cost.placed else "the work spread evenly over the micro-batches")
    method = ("per step, the work done once per micro-batch: the memory-bound kernels, outside the optimizer step, "
              "of ops on a parameter's shape (the weights of linear and embedding ops, the shapes the optimizer's ops "
              "take) or inside FSDP's hooks"
              + (", the parameters' collectives' exposed time (no compute beside them)" if sharded else "")
              + ", and the GPU's idle time the host causes once per micro-batch (the step replayed without its syncs "
              "made once per micro-batch, and, where the trace shows its micro-batches, without its launch time; at "
              "most the step's idle time); "
              f"{m} micro-batches merged {k} at a time do the work of the first of each group: saved = the total less "
              f"that ({placed}); not counted: the GEMMs' efficiency at {k} times the rows, the host's launches per "
              "token; checked on an H200 (Qwen2 7B dims, 4 layers, 2 x 2,048 tokens x 4 micro-batches, a Hugging Face "
              "script): one GPU 18.5 ms estimated, 21 measured; FSDP2 over 2 GPUs 94.6 against 79"
              + ("; the trainer's: llama3-8b 4 layers on H100s estimated 120.9 ms, measured 113.6" if cfg is not None
                 else ""))
    return [_row("accumulation", lever, evidence, condition, action, cost.saved_ms, method)]


def _recompute(a: Analysis, w: dict[str, Any], cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Activation checkpointing: the GPU time of the forward ops run again in the backward pass,
    which a run that keeps the activations does not spend (a primus-train run's recompute, else
    the script's own: transformers' gradient checkpointing, a checkpoint wrapper)."""
    k = in_steps(a.kernels)
    if w.get("mode") != "training" or "recomputed" not in k.columns:
        return []
    again = k[k["recomputed"].to_numpy(dtype=bool) & (k["category"] != COMMUNICATION).to_numpy()]  # a gather stays
    saved_ms = float(again["dur_us"].sum()) / 1e3 / a.rank_steps if len(again) else 0.0
    now = str(cfg["train"].get("recompute")) if cfg is not None else ""
    now = {"True": "full", "False": "none"}.get(now, now)  # an older config's boolean
    if saved_ms < MIN_SAVING_MS or now == "none":
        return []  # a primus-train run without recompute: not the trainer's to turn off
    total = float(k["dur_us"].sum()) / 1e3 / a.rank_steps or 1.0
    by_op = again.groupby("op")["dur_us"].sum().sort_values(ascending=False).head(3) / 1e3 / a.rank_steps
    top = ", ".join(f"{str(op).removeprefix('aten::')} {ms:.1f} ms" for op, ms in by_op.items())
    evidence = (f"the backward pass runs the forward again (activation checkpointing): the forward's ops inside "
                f"the backward's nodes launch {len(again) / a.rank_steps:.0f} GPU events per step taking "
                f"{saved_ms:.1f} ms ({saved_ms / total:.0%} of the GPU time)" + (f": {top}" if top else ""))
    condition = (f"{_mode(w)} whose backward pass recomputes activations; keeping them needs the memory of every "
                 "block's activations until the backward pass")
    if cfg is not None:
        lever: dict[str, Any] = {"train.recompute": "none"}
        action = ("set train.recompute=none" + (f" (now {now})" if now in ("selective", "full") else "") +
                  " where the activations fit in memory; with a smaller "
                  "micro-batch if they do not (primus-tune step measures both together)")
    else:
        lever = {"recompute": "off"}
        action = ("turn activation checkpointing off where the activations fit in memory: transformers' "
                  "model.gradient_checkpointing_disable(), or TrainingArguments(gradient_checkpointing=False) with "
                  "the Trainer; a checkpoint wrapper or torch.utils.checkpoint call of your own, removed; "
                  "`primus-tune step -- train.py` measures recompute=off (transformers' gradient checkpointing) "
                  "beside the micro-batch, a run out of memory a dropped trial")
    method = ("the GPU time of the events launched under a forward op inside a backward node (an op with an autograd "
              "sequence number of its own, not its node's: the forward recorded again for a backward to come), "
              "communication left out (a parameter gathered again stays); not counted: a larger micro-batch the "
              "memory could hold instead; not seen: a compiled region's recomputation (inside its compiled "
              "backward); checked on an H200 trace (Qwen2 7B dims, 4 layers, 2 x 2,048 tokens x 4 micro-batches, "
              "the Hugging Face Trainer with gradient_checkpointing): estimated 52.7 ms, the step tuner's trial of "
              "recompute=off measured 57.0 (1.147x on a 443.5 ms step)")
    return [_row("recompute", lever, evidence, condition, action, saved_ms, method)]


def _host_launch(a: Analysis, w: dict[str, Any], cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    rp = _replayed(a)
    if rp.empty:
        return []
    bound = _capped(rp, rp["replay_s"] - rp["no_host_s"])
    doubled = _capped(rp, rp["replay_s"] - rp["double_gpu_s"] / 2)
    mb = cfg["train"].get("micro_batch") if cfg is not None else None
    use_mb = isinstance(mb, int) and mb > 0 and w.get("mode") == "training" and not _accumulates(cfg, w)
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
                + f"; with the host's launch time gone (syncs and data loading kept) the step would be "
                  f"{bound * 1e3:.1f} ms shorter")
    waits = "the GPU idles while the host launches (not waiting on syncs or data loading)"
    if use_mb:
        action = (f"set train.micro_batch={2 * mb} (now {mb}): the host's work per step stays, each launch carries "
                  "twice the work (if it fits in memory); CUDA graphs (torch.compile mode='reduce-overhead') need the "
                  "syncs gone first")
        method = (_REPLAY + "with every per-token GPU event twice as long, the per-parameter ones (optimizer, "
                  "data-parallel collectives) as recorded and the host unchanged, halved (per step of the original "
                  f"tokens), against the recorded replay, at most the step's GPU idle time; {_replay_note(rp)}; mean "
                  "over steps")
        return [_row("host: launches", f"train.micro_batch={2 * mb}", evidence,
                     f"{_mode(w)} without gradient accumulation (the micro-batch is the optimizer's batch); {waits}",
                     action, saving * 1e3, method)]
    action = ("capture the step in CUDA graphs (torch.cuda.graphs, torch.compile(mode='reduce-overhead'); a "
              "sync in the step breaks the capture) or run a larger batch so each launch carries more work")
    method = (_REPLAY + "with the host's time between and in launches removed, the syncs and the data loading kept, "
              f"against the recorded replay, at most the step's GPU idle time: the bound for launching faster; "
              f"{_replay_note(rp)}; mean over steps")
    return [_row("host: launches", "cuda graphs", evidence, waits, action, saving * 1e3, method)]


def _communication(a: Analysis, w: dict[str, Any], cfg: dict[str, Any] | None) -> list[dict[str, Any]]:
    if a.temporal.empty:
        return []
    exposed = float(a.temporal["exposed_comm_s"].mean())
    if exposed * 1e3 < MIN_SAVING_MS:
        return []
    lever, saving_ms = "communication", exposed * 1e3
    ev = a.collective_events
    by = pd.Series(dtype=np.float64)
    if len(ev):
        e = ev[ev["step"] >= 0]
        by = e.groupby(["role", "collective"])["dur_us"].sum().sort_values(ascending=False) / 1e3 / a.rank_steps
    top = "; ".join(f"{coll} ({role}) {ms:.1f} ms" for (role, coll), ms in by.head(3).items())
    roles = {role for role, _ in by.index} if len(by) else set()
    evidence = (f"{exposed * 1e3:.1f} ms per step of communication is not overlapped by compute "
                f"({exposed / float(a.temporal['span_s'].mean()):.0%} of the step)" + (f"; by collective: {top}" if top
                                                                                         else ""))
    actions, facts = [], []
    if "tokens" in roles and w.get("expert_parallel"):
        facts.append("MoE token exchange (expert parallelism)")
        actions.append("keep expert-parallel groups inside a node (NVLink/xGMI) and overlap dispatch/combine with "
                       "the shared expert or the next micro-batch")
    elif "tokens" in roles and w.get("embedding_all_to_all"):
        facts.append(f"an embedding all-to-all beside embedding-table ops ({w.get('embedding_ops')}), no MoE")
        actions.append("pipeline the sparse all-to-all with the dense compute (TorchRec's TrainPipelineSparseDist "
                       "fetches and distributes the next batch's embeddings during this one) and balance the tables' "
                       "sharding plan (row-wise for the large tables) so no rank's all-to-all waits for another's")
    elif "tokens" in roles:
        facts.append("an all-to-all that is neither MoE nor embedding lookups")
        actions.append("overlap the all-to-all with independent compute (a separate stream, the next micro-batch)")
    method = "all of the exposed communication: the upper bound, reached only when it is hidden entirely"
    if "parameters" in roles and w.get("mode") == "training" and (w.get("sharded") or w.get("data_parallel", 1) > 1):
        if w.get("sharding") == SHARDS_OPTIMIZER:
            ex = _exposed_by_collective(a)
            rs, ag = (float(ex.get(("parameters", c), 0.0)) for c in ("reduce_scatter", "all_gather"))
            evidence += (f"; exposed: the gradients' reduce-scatter {rs:.1f} ms, the parameters' all-gather {ag:.1f} ms "
                         "per step")
            method += (f", here the gradients' reduce-scatter {rs:.2f} ms (behind the backward pass) and the parameters' "
                       f"all-gather {ag:.2f} ms (behind the forward): each collective's time that no compute kernel "
                       "overlaps, in proportion to the exposed total")
            facts.append(f"data parallelism with a sharded optimizer ({w['sharded_by']})")
            actions.append("overlap the gradients' reduce-scatter with the backward pass, bucket by bucket as their "
                           "gradients are ready (Megatron: --use-distributed-optimizer --overlap-grad-reduce, "
                           "--ddp-bucket-size; DeepSpeed ZeRO-1/2: overlap_comm: true, reduce_bucket_size; by hand: each "
                           "bucket's reduce-scatter launched with async_op=True from a post-accumulate-grad hook), and the "
                           "parameters' all-gather with the next forward (Megatron: --overlap-param-gather; DeepSpeed: "
                           "allgather_bucket_size; by hand: each bucket's all-gather waited on in a forward pre-hook of "
                           "the first layer that uses it); buckets large enough to reach the links' bandwidth, small "
                           "enough that the first starts early in the pass")
        elif w.get("sharded"):
            facts.append(f"sharded data parallelism ({w['sharded_by']})")
            actions.append("prefetch the next blocks' all-gathers (FSDP2 set_modules_to_forward_prefetch / "
                           "parallel.fsdp_prefetch) and keep the last blocks gathered after forward "
                           "(reshard_after_forward=False / parallel.fsdp_reshard_after_forward=false)")
            regather = _regather(a, w)
            if regather is not None:
                lever = {"parallel.fsdp_reshard_after_forward": False} if cfg is not None else {"fsdp_reshard": False}
                saving_ms, how, what = regather
                evidence += "; " + what
                method = how + "; " + method.replace("all of the exposed communication: the upper bound",
                                                     "the exposed communication, all of it, bounds what overlap gains")
        else:
            facts.append(f"{w.get('data_parallel', 1)} data-parallel ranks reducing gradients")
            actions.append("overlap gradient reduction with the backward pass (DDP bucket_cap_mb, no "
                           "find_unused_parameters; with gradient accumulation, no_sync on all but the last micro-batch)")
    if "activations" in roles:
        facts.append("collectives inside the model's ops (tensor or sequence parallelism)")
        actions.append("keep tensor parallelism inside a node and overlap its collectives with compute "
                       "(sequence parallelism, async TP)")
    if not actions:
        actions.append("overlap communication with compute (separate streams, larger buckets)")
    if cfg is not None:
        tp = (cfg.get("parallel") or {}).get("tp", 1) if isinstance(cfg.get("parallel"), dict) else 1
        actions.append(f"check the layout: parallel.tp={tp} over {a.world_size} ranks")
    condition = "; ".join(facts) or "communication kernels that run with no compute beside them"
    return [_row("communication", lever, evidence, condition, "; ".join(actions), saving_ms, method)]


# FSDP2's copies around its all-gathers: the shards into the flat buffer, the gathered buffer out
# into the parameters (tables.param_shaped: launched in its hooks)
GATHER_COPIES = ("aten::_foreach_copy_", "aten::split_with_sizes_copy")


def _regather(a: Analysis, w: dict[str, Any]) -> tuple[float, str, str] | None:
    """Where FSDP gathers the parameters again in the backward pass (``reshard_after_forward``,
    FSDP2's default): what keeping them gathered from the forward saves per step, the
    backward's all-gathers' exposed time and their share of the gathers' copies, with its
    method and evidence; None where the backward gathers nothing."""
    if w.get("sharding") != SHARDS_PARAMETERS:
        return None
    ev = a.collective_events
    if ev.empty or "phase" not in ev.columns:
        return None
    ag = ev[(ev["collective"] == "all_gather") & (ev["role"] == "parameters") & (ev["step"] >= 0)]
    backward = float((ag["phase"] == "backward").sum())
    if not backward:
        return None
    share = backward / len(ag)
    ex = comm_exposure(a)
    exposed_ms = float(ex.loc[(ex["collective"] == "all_gather") & (ex["phase"] == "backward"), "exposed_ms"].sum())
    k = in_steps(a.kernels)
    copies = k[k["param_shaped"].to_numpy(dtype=bool) & k["leaf_op"].isin(GATHER_COPIES).to_numpy()]
    copies_ms = float(copies["dur_us"].sum()) / 1e3 / a.rank_steps
    saving = exposed_ms + share * copies_ms
    what = (f"the backward pass gathers the parameters again ({backward / a.rank_steps:.0f} of "
            f"{len(ag) / a.rank_steps:.0f} all-gathers a step: reshard after forward): exposed {exposed_ms:.1f} ms, "
            f"and {share:.0%} of the gathers' copies into and out of their buffers ({copies_ms:.1f} ms a step)")
    how = ("keeping the blocks gathered from forward to backward (reshard_after_forward=False) saves the backward's "
           "all-gathers' exposed time and their share of the gathers' copies (the time their kernels take beside "
           "compute is not counted); the gathered blocks stay in memory through the backward pass: check it fits; "
           "checked on 2 H200s (FSDP2, Qwen2 7B dims, 4 layers, 4 micro-batches): 17.2 ms estimated, 17 measured")
    return saving, how, what


def _exposed_by_collective(a: Analysis) -> pd.Series:
    """Exposed communication per step (ms) by (role, collective) (:func:`.micro_batch.comm_exposure`)."""
    ex = comm_exposure(a)
    return ex.groupby(["role", "collective"])["exposed_ms"].sum() if len(ex) else pd.Series(dtype=np.float64)


def _trace_arg(a: Analysis) -> str:
    paths = [Path(t) for t in a.traces]
    parents = {p.parent for p in paths}
    if len(paths) > 1 and len(parents) == 1 and (next(iter(parents)) / "manifest.json").exists():
        return shlex.quote(str(next(iter(parents))))
    return " ".join(shlex.quote(str(p)) for p in paths)


def _alone(a: Analysis) -> pd.Series:
    """Per problem key: the fraction of its kernels' time with no communication kernel running
    beside them (a GEMM that shares the GPU with NCCL is slowed by it, whatever its choice)."""
    k = in_steps(a.kernels)
    k = k[k["category"].isin((*MODELED, COMMUNICATION))]
    if k.empty or a.calls.empty or not (k["category"] == COMMUNICATION).any():
        return pd.Series(dtype=np.float64)
    out: dict[str, list[float]] = {}
    for _, kr in k.groupby("rank"):
        comm = kr[kr["category"] == COMMUNICATION]
        work = kr[kr["category"] != COMMUNICATION]
        start = work["ts_us"].to_numpy(dtype=np.float64)
        overlap = covered(comm["ts_us"].to_numpy(dtype=np.float64), (comm["ts_us"] + comm["dur_us"]).to_numpy(np.float64),
                          start, start + work["dur_us"].to_numpy(dtype=np.float64))
        for kk, d, o in zip(problem_keys(work, a.calls), work["dur_us"].to_numpy(), overlap, strict=True):
            t = out.setdefault(kk, [0.0, 0.0])
            t[0] += d
            t[1] += o
    return pd.Series({kk: 1.0 - o / d if d > 0 else 1.0 for kk, (d, o) in out.items() if kk})


def _tuning(a: Analysis, peaks: DevicePeaks | None) -> list[dict[str, Any]]:
    t = tune_next(a.problem_tables(), top=1_000_000)
    if t.empty or in_steps(a.kernels).empty:
        return []
    att = t["kind"].map(attainable).astype(np.float64)
    alone = _alone(a).reindex(t["key"]).fillna(1.0).to_numpy()
    gap = (1 - t["pct_roofline"].astype(np.float64) / att).clip(lower=0.0).fillna(0.0)
    t = t.assign(alone=alone, saving=t["time_s"] * alone * gap)
    for kind, part in kinds.with_part("trace").items():  # each pass against what its kernels reach
        rows, p = t["kind"] == kind, a.problem_tables().get(kind, pd.DataFrame())
        if part.by_pass and rows.any() and len(p) and "direction" in p.columns:
            roof = p["direction"].map(part.by_pass).fillna(part.attainable)
            per = (p["time_s"] * (1 - p["pct_roofline"].astype(np.float64) / roof).clip(lower=0.0).fillna(0.0))
            by_key = per.groupby(p["key"]).sum()
            t.loc[rows, "saving"] = by_key.reindex(t.loc[rows, "key"]).fillna(0.0).to_numpy() * t.loc[rows, "alone"]
    nvidia = peaks is not None and peaks.vendor == "nvidia"
    out = []
    for kind, g in t.groupby("kind", sort=False):
        saving = float(g["saving"].sum())
        capped = ""
        if kind == kinds.GEMM.name and nvidia:
            dense = float((g["time_s"] * g["alone"]).sum()) * GEMM_TUNING_GAIN
            if saving > dense:
                saving, capped = dense, (f"; at most {GEMM_TUNING_GAIN:.0%} of the GEMMs' time on NVIDIA (the cuBLASLt "
                                         "heuristic's choice is within ~2% of the best candidate on an H100; tuned "
                                         "caches ran 0.995-1.013x)")
        if kind == kinds.ATTENTION.name and nvidia:
            k = in_steps(a.kernels)
            k = k[k["category"].isin((ATTENTION_FWD, ATTENTION_BWD))]
            cudnn = float(k.loc[k["name"].astype(str).str.contains(_CUDNN), "dur_us"].sum())
            bound = float((g["time_s"] * g["alone"]).sum()) * ATTENTION_TUNING_GAIN
            if cudnn >= 0.9 * float(k["dur_us"].sum()) > 0 and saving > bound:
                saving, capped = bound, (f"; at most {ATTENTION_TUNING_GAIN:.0%} of the attention's time: its kernels "
                                         "are cuDNN's, the fastest SDPA backend measured on NVIDIA (an H100 llama3-8b "
                                         "problem, b1 h32 s4096 d128 causal, tuned to cuDNN again at 1.000x)")
        if saving * 1e3 < MIN_SAVING_MS:
            continue
        g = g.sort_values("saving", ascending=False)
        below = g[g["saving"] > 0]
        best = below.iloc[0]
        label = kinds.get(str(kind)).title if str(kind) in kinds.names() else str(kind)
        shared = float((g["time_s"] * (1 - g["alone"])).sum())
        evidence = (f"{len(below)} {label} problem(s) below {attainable(str(kind)):.0%} of the roofline take "
                    f"{below['time_s'].sum() * 1e3:.1f} ms per step; most to gain: {best['label']} at "
                    f"{best['pct_roofline']:.0%} ({best['time_s'] * 1e3:.2f} ms); one problem alone: {best['command']}"
                    + (f"; {shared * 1e3:.1f} ms of their time runs beside communication kernels and is left out"
                       if shared * 1e3 >= MIN_SAVING_MS else ""))
        condition = f"{label} kernels that run alone on the GPU below what the best kernels reach"
        out.append(_row(f"tuning: {kind}", f"tuning: {kind}", evidence, condition, f"tune the trace's {label} problems",
                        saving * 1e3,
                        f"per problem: time its kernels run with no communication beside them x (1 - roofline fraction "
                        f"/ {_roof_text(str(kind))}), the fraction of the datasheet peak the best available kernels "
                        "reach; problems without a roof count 0" + capped,
                        command=f"primus-tune {str(kind).replace('_', '-')} --trace {_trace_arg(a)}"))
    return out


_SDPA_OP = "aten::scaled_dot_product_attention"


def _attention_path(a: Analysis, w: dict[str, Any], peaks: DevicePeaks | None, cfg: dict[str, Any] | None
                    ) -> list[dict[str, Any]]:
    """Attention off the fused causal path (:mod:`.attention_path`): what it costs against the
    fused kernel it could run, and why it left it."""
    out = []
    for o in off_path(a, peaks):
        if o.saving_s * 1e3 < MIN_SAVING_MS:
            continue
        p, ms, fused_ms = o.problem, o.time_s * 1e3, o.fused_s * 1e3
        shape = f"b{p.batch} h{p.heads_q} s{p.seq_q} d{p.head_dim} {p.dtype}"
        compiled = bool(w.get("compiled"))
        if o.kind == "math":
            sdpa = _SDPA_OP in o.ops
            evidence = (f"the attention's scores are materialized ({p.batch}x{p.heads_q}x{p.seq_q}x{p.seq_kv}"
                        + (f", a {o.mask} mask added" if o.mask else "") + f"): {o.ops} take {ms:.1f} ms per step, "
                        f"forward and backward, where a fused {o.target} kernel would take {fused_ms:.1f}")
            if sdpa:
                why = ("SDPA fell back to its math path: no fused kernel took these inputs (fp32 inputs, a head dim "
                       "above 256 or not a multiple of 8, an arbitrary mask with dropout), or sdpa_kernel forced it")
                action = ("give SDPA inputs its fused kernels take (bf16/fp16, no explicit mask where is_causal=True "
                          "says it) and let it choose, or pick one: torch.nn.attention.sdpa_kernel([SDPBackend."
                          "CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]) (the step tuner's sdpa lever)")
                lever = {"sdpa": "cudnn" if peaks is not None and peaks.vendor == "nvidia" else "flash"}
            else:
                why = ("the model's own attention code multiplies, masks and softmaxes the scores in separate kernels "
                       "(Hugging Face transformers: attn_implementation=\"eager\")")
                action = ("use a fused attention: Hugging Face transformers, attn_implementation=\"sdpa\" (or "
                          "\"flash_attention_2\"); your own code, torch.nn.functional.scaled_dot_product_attention(q, k, "
                          "v, is_causal=True)")
                lever = "attn_implementation=sdpa"
        else:
            evidence = (f"{o.ops} run {shape} {'with an explicit ' + o.mask + ' mask' if o.mask else 'without causal masking'}"
                        f" on self-attention: {ms:.1f} ms per step, where the fused {o.target} kernel would take "
                        f"{fused_ms:.1f}")
            if o.mask and compiled:
                why = ("under torch.compile, Hugging Face transformers builds the causal mask inside the compiled region "
                       "(in eager it skips it where nothing is padded and SDPA runs is_causal=True), and SDPA runs the "
                       "masked kernel over every score")
                action = ("compile the decoder layers rather than the whole model (for layer in model.model.layers: "
                          "layer.compile()): the mask is then built in eager code, skipped, and SDPA runs its causal "
                          "kernel; or pass attention_mask=None where no sequence is padded")
                lever = {"compile": "block"} if cfg is None else "attention: causal"
            elif o.mask:
                why = "the model passes an explicit mask (a padding mask, or a causal mask built by hand)"
                action = ("pass no mask where no sequence is padded and is_causal=True for a decoder; pack padded "
                          "sequences (varlen attention) rather than masking them")
                lever = "attention: causal"
            else:
                why = "scaled_dot_product_attention is called with is_causal=False"
                action = "pass is_causal=True: a decoder attends to earlier positions only, and the causal kernels skip half the scores"
                lever = "attention: causal"
        evidence += f"; {why}"
        condition = (f"self-attention ({p.seq_q} queries and keys); " + (o.lm if o.lm else
                     "no language model's loss seen: compared with the full fused kernel"))
        frac = " and ".join(f"{FUSED_FRACTION[d]:.2f} {d}" for d in FUSED_FRACTION)
        method = (f"the calls' kernel time per step less the {o.target} problem's FLOPs at the fraction of the roofline "
                  f"SDPA's causal fused kernels reach ({frac}: cuDNN's on an H200, or this trace's own causal calls'); "
                  "checked on an H200 (Qwen2 7B dims, b2 h28/4 s2048 d128, 4 layers, 4 micro-batches): the whole model "
                  "compiled ran cuDNN's masked kernel 26.8 ms a step, estimated 9.9 ms on the causal path, which ran "
                  "9.8 in eager; transformers' eager attention's kernels 95.5 ms, estimated 9.9, the step 84 ms slower "
                  "than with SDPA")
        out.append(_row("attention path", lever, evidence, condition, action, o.saving_s * 1e3, method))
    return out


def attainable(kind: str) -> float:
    """The fraction of the datasheet peak the best available kernels of ``kind`` reach (its trace part's)."""
    return kinds.get(kind).part("trace").attainable


def _roof_text(kind: str) -> str:
    by_pass = kinds.get(kind).part("trace").by_pass
    if by_pass:
        return " or ".join(f"{v:g} {d}" for d, v in by_pass.items()) + " (each pass)"
    return f"{attainable(kind):g}"


def fp8_casts(g: pd.DataFrame, training: bool = True) -> tuple[float, float]:
    """Elements cast to FP8 per step for GEMM problems ``g`` (rows of a GEMM problem table):
    (per parameter, per token). For each forward GEMM ``x[M, K] @ W[N, K]^T``: in training the
    weight (N*K, per step), the input (M*K) and the output's gradient (M*N), each once and once
    transposed; in inference the input only (the weights are cast once, offline)."""
    fwd = g[g["direction"] == "fwd"]
    weights = tokens = 0.0
    for p, calls in zip(fwd["problem"], fwd["calls"].astype(np.float64), strict=True):
        m, n, k = p.row_major_shapes()[:3]
        weights += calls * n * k
        tokens += calls * (m * k + m * n if training else m * k)
    return (2 * weights, 2 * tokens) if training else (0.0, tokens)


def _fp8(a: Analysis, w: dict[str, Any], peaks: DevicePeaks | None, cfg: dict[str, Any] | None
         ) -> list[dict[str, Any]]:
    g = a.gemm_problems
    if peaks is None or peaks.peak_tflops("f8e4m3") is None or g.empty or in_steps(a.kernels).empty:
        return []
    big = np.array([isinstance(p, GemmProblem) and min(p.m, p.n, p.k) >= FP8_MIN_DIM for p in g["problem"]], dtype=bool)
    c = g[big & g["dtype"].isin(_FP8_DTYPES).to_numpy()]
    training = w.get("mode") == "training"
    if not training:
        c = c[c["direction"] == "fwd"]
    if c.empty or (training and w.get("sharding") == SHARDS_PARAMETERS):
        # sharded parameters: FSDP2 over 2 H100s (llama3-8b, 8 layers) measured compile + FP8
        # tensorwise 0.82x of compile alone at micro-batch 1, no gain at micro-batch 2 (the casts of the
        # gathered weights and the amax reduction cost more than the GEMMs save); a sharded optimizer
        # alone gathers nothing per layer
        return []
    t_s = float(c["time_s"].sum())
    per_param, per_token = fp8_casts(c, training)
    bw = peaks.hbm_tb_s * ATTAINABLE_BW * 1e12
    cast_s = (per_param + per_token) * CAST_BYTES / bw
    saving = t_s * (1 - 1 / FP8_GEMM_SPEEDUP) - cast_s
    if saving * 1e3 < MIN_SAVING_MS:
        return []
    ratio = peaks.peak_tflops("f8e4m3") / (peaks.peak_tflops(str(c["dtype"].iloc[0])) or 1)
    evidence = (f"{len(c)} bf16/f16 GEMM problem(s) with every dimension >= {FP8_MIN_DIM} take {t_s * 1e3:.1f} ms "
                f"per step on a device with an FP8 peak of {peaks.peak_tflops('f8e4m3'):g} TFLOP/s ({ratio:.0f}x bf16); "
                f"their FP8 casts move {(per_param + per_token) * CAST_BYTES / 1e9:.2f} GB per step "
                f"({cast_s * 1e3:.1f} ms; {per_param / max(per_param + per_token, 1):.0%} of it per parameter, the same "
                "at any micro-batch)")
    method = (f"the candidates' time x (1 - 1/{FP8_GEMM_SPEEDUP:g}) (the FP8 GEMMs alone) minus the casts at "
              f"{CAST_BYTES} bytes an element and {ATTAINABLE_BW:.0%} of the HBM peak: this reproduces the 19.9 ms an H100 "
              "llama3-8b step measured with torchao float8 tensorwise under torch.compile")
    if not training:
        return [_row("fp8", "fp8 inference", evidence, f"{_mode(w)}: forward GEMMs, the weights cast once offline",
                     "serve FP8 weights (an FP8 checkpoint, or the engine's FP8 quantization such as vLLM's "
                     "quantization='fp8'); FP8 changes the numerics: check the outputs against an evaluation set",
                     saving * 1e3, method, numerics=True)]
    compiled = w.get("compiled")
    condition = (f"{_mode(w)}; no parameters gathered per layer (FSDP)"
                 + (" (the optimizer alone is sharded)" if w.get("sharding") == SHARDS_OPTIMIZER else "")
                 + f"; {_compile_text(w)}")
    if compiled is False:
        lever = ({"train.fp8": "tensorwise", "train.compile": "pointwise"} if cfg is not None
                 else {"fp8": "tensorwise", "compile": "block"})
        action = ("set train.compile=pointwise train.fp8=tensorwise: FP8 pays only with its casts fused (in eager, FP8 "
                  "layer groups measured 0.82-0.95x of bf16); FP8 changes the numerics: compare the loss curve"
                  if cfg is not None else "torch.compile the model and train its linear layers in FP8 (torchao "
                  "float8 tensorwise): in eager the casts cost more than the GEMMs save; compare the loss curve")
    else:
        lever = {"train.fp8": "tensorwise"} if cfg is not None else {"fp8": "tensorwise"}
        action = ("set train.fp8=tensorwise (FP8 GEMMs change the numerics: compare the loss curve)" if cfg is not None
                  else "train the linear layers in FP8 (torchao float8 under torch.compile; FP8 GEMMs change the "
                  "numerics: compare the loss curve)")
    return [_row("fp8", lever, evidence, condition, action, saving * 1e3, method + "; the estimate assumes the casts "
                 "fused by torch.compile", command="primus-tune loop --fp8", numerics=True)]


def _precision(a: Analysis, w: dict[str, Any], peaks: DevicePeaks | None) -> list[dict[str, Any]]:
    """fp32 GEMMs and convolutions: TF32 math, and a 16-bit type (:mod:`.precision`)."""
    if peaks is None or in_steps(a.kernels).empty:
        return []
    cap = attainable(kinds.GEMM.name)
    f = fp32_work(a.calls, a.kernels, peaks, a.rank_steps, cap)
    if f.empty:
        return []
    total = float(in_steps(a.kernels)["dur_us"].sum()) / 1e6 / a.rank_steps or 1.0
    fp32_s = float(f["time_s"].sum())
    by_kind = ", ".join(f"{kind} {t * 1e3:.1f} ms" for kind, t in f.groupby("kind", sort=False)["time_s"].sum().items())
    frac = f["fraction"].dropna().clip(upper=1.0)
    tf32_ms = float(f.loc[f["tf32"], "time_s"].sum()) * 1e3
    evidence = (f"{len(f)} fp32 GEMM/convolution problem(s) take {fp32_s * 1e3:.1f} ms per step ({fp32_s / total:.0%} of "
                f"GPU time: {by_kind}), at {frac.min():.0%}-{frac.max():.0%} of their roofline"
                + (f"; {tf32_ms:.1f} ms of it already on TF32 tensor cores" if tf32_ms >= MIN_SAVING_MS else
                   "; none on TF32 tensor cores"))

    def method(roof: str) -> str:
        return (f"per problem: its FLOPs at the fraction of the roofline its kernels reach now (at most {cap:.0%}, what "
                f"the best kernels reach) of {roof}, min(peak, intensity x {peaks.hbm_tb_s:g} TB/s), against its kernels' "
                "time less the layout transposes among them; an estimate, not a measurement: a kernel's fraction of a "
                "higher roof is usually lower")

    rows = []
    tf32 = peaks.peak_tflops("tf32")
    todo = f[~f["tf32"]]
    saving = float((todo["time_s"] - todo["tf32_s"]).sum())
    if tf32 and saving * 1e3 >= MIN_SAVING_MS:
        rows.append(_row("precision", "tf32", evidence, f"{_mode(w)}; fp32 math on a device whose TF32 tensor peak is "
                         f"{tf32:g} TFLOP/s ({tf32 / peaks.peak_tflops('f32'):.0f}x its fp32 peak)",
                         "allow TF32 for fp32 matmuls and convolutions: torch.backends.cuda.matmul.allow_tf32 = True "
                         "(torch.set_float32_matmul_precision('high')) and torch.backends.cudnn.allow_tf32 = True; the "
                         "tensors stay fp32, the products round to TF32's 10-bit mantissa"
                         + ("; on ROCm, only where the torch build maps it to hipBLASLt's xf32 (MI300-series): check "
                            "the kernels' names after the change" if peaks.vendor == "amd" else ""),
                         saving * 1e3, method(f"the TF32 roof ({tf32:g} TFLOP/s)"), numerics=True))
    low = low_precision(peaks)
    saving = float((f["time_s"] - f["low_s"]).sum())
    if low and saving * 1e3 >= MIN_SAVING_MS:
        name = {"bf16": "torch.bfloat16", "f16": "torch.float16"}[low]
        if w.get("mode") == "inference":
            action = f"run the model in {low} (model.to({name}), or torch.autocast with dtype={name})"
        else:
            action = (f"train under torch.autocast(device_type='cuda', dtype={name}) around the forward and the loss "
                      "(the weights and the optimizer's state stay fp32)"
                      + (", with torch.amp.GradScaler (the device has no bf16)" if low == "f16" else "")
                      + "; compare the loss curve")
        peak = peaks.peak_tflops(low) or 0.0
        rows.append(_row("precision", f"{low} autocast", evidence, f"{_mode(w)}; fp32 math on a device whose {low} "
                         f"tensor peak is {peak:g} TFLOP/s ({peak / peaks.peak_tflops('f32'):.0f}x its fp32 peak)",
                         action, saving * 1e3, method(f"the {low} roof ({peak:g} TFLOP/s, 2-byte operands)"),
                         numerics=True))
    return rows


def _kernel_label(name: str) -> str:
    """A kernel's name without its return type, template and parameters
    (``cudnn::ops::nchwToNhwcKernel``)."""
    return re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0]


def _memory_format(a: Analysis) -> list[dict[str, Any]]:
    """Convolutions that convert NCHW tensors to NHWC and back around their kernels: channels_last."""
    t_s, n, names = layout_transposes(a.kernels, a.rank_steps)
    if t_s * 1e3 < MIN_SAVING_MS:
        return []
    total = float(in_steps(a.kernels)["dur_us"].sum()) / 1e6 / a.rank_steps or 1.0
    evidence = (f"convolution ops launch {n} NCHW<->NHWC layout conversions per step taking {t_s * 1e3:.1f} ms "
                f"({t_s / total:.0%} of GPU time): {', '.join(_kernel_label(x) for x in names[:2])}")
    return [_row("memory format", "channels_last", evidence, "convolutions whose kernels run on NHWC tensors while "
                 "the model's are NCHW", "use the channels_last memory format: model.to(memory_format="
                 "torch.channels_last) and each batch x.to(memory_format=torch.channels_last), so the convolution "
                 "kernels read and write NHWC directly", t_s * 1e3,
                 "the conversions' kernel time, which a channels_last model does not run (an upper bound: an op "
                 "without an NHWC kernel converts back, and the input is converted once per step)")]


# the step tuner's lever names (tuner/step/levers.py) by the trainer's config key: a measured row
# names a lever either way (a script's ``micro_batch``, primus-train's ``train.micro_batch``)
LEVER_NAMES = {"train.compile": "compile", "train.micro_batch": "micro_batch", "train.optimizer": "optimizer",
               "train.fp8": "fp8", "train.recompute": "recompute", "parallel.fsdp_reshard_after_forward": "fsdp_reshard",
               "parallel.fsdp_prefetch": "fsdp_prefetch", "tuning.cache": "kernel_cache",
               "model.moe.grouped_gemm_backend": "grouped_backend"}


def lever_parts(text: str) -> frozenset[str]:
    """A lever's settings (``key=value`` each, or a key alone, in any order), keys by their lever
    name: how a measurement names the lever it measured, and a recommendation the lever it advises."""
    out = set()
    for part in text.lower().split():
        key, sep, value = part.partition("=")
        out.add(f"{LEVER_NAMES.get(key, key)}={value}" if sep else LEVER_NAMES.get(key, key))
    return frozenset(out)


def measured_rows(manifest: dict[str, Any], measured: list[Any]) -> list[dict[str, Any]]:
    """The step tuner's measurements of a run (``measured``: rows read beside the trace,
    :func:`..inputs.read_measured`), each with its lever (every ``key=value`` the candidate
    changed, a companion included), the setting it was measured against, the measured
    saving in ms per step, the speedup and what became of it (``status``: kept, dropped, ...)."""
    rows = list(measured) + (list(manifest.get(MEASURED)) if isinstance(manifest.get(MEASURED), list) else [])
    out = []
    for r in rows:
        if isinstance(r, dict) and isinstance(r.get("lever"), str) and isinstance(r.get("measured_ms"), (int, float)):
            changes, v = r.get("changes"), r.get("value")
            if isinstance(changes, dict) and changes:
                lever = " ".join(f"{k}={val}" for k, val in changes.items()).lower()
            else:
                lever = r["lever"] if v is None else f"{r['lever']}={v}".lower()
            speedup, kept = r.get("speedup"), r.get("kept")
            out.append({"lever": lever, "against": str(r.get("against") or "the default"),
                        "measured_ms": float(r["measured_ms"]),
                        "speedup": float(speedup) if isinstance(speedup, (int, float)) and speedup is not True
                        and speedup is not False else None,
                        "status": str(r.get("status") or ("kept" if kept is True else "dropped" if kept is False
                                                          else ""))})
    return out


def _with_measured(df: pd.DataFrame, rows: list[dict[str, Any]]) -> pd.DataFrame:
    """``measured_saving_ms`` of each recommendation whose lever the step tuner measured as it
    stands (the same ``key=value`` settings, none missing, none more: FP8 with compile is not
    compile measured alone), against the default where it was (the setting the trace ran),
    else against the first incumbent it was measured on; ``measured_against`` says which (a
    saving measured on another setting is not the one the estimate is of: compile on an MoE
    measured 36 ms at micro-batch 8, where 115 ms was estimated at the traced micro-batch 1)."""
    if not rows or df.empty:
        return df
    by: dict[frozenset[str], tuple[float, str]] = {}
    for r in sorted(rows, key=lambda r: r["against"] != "the default"):
        by.setdefault(lever_parts(r["lever"]), (r["measured_ms"], r["against"]))
    found = [by.get(lever_parts(str(v)), (np.nan, None)) for v in df["lever"]]
    return df.assign(measured_saving_ms=[m for m, _ in found], measured_against=[w for _, w in found])


def recommend(a: Analysis) -> pd.DataFrame:
    """The recommendations of an analysis, ranked (see the module docstring)."""
    peaks = lookup_peaks(str(a.device.get("name", "")))
    cfg = trainer_config(a.manifest)
    w = a.workload
    rows = [*_fusion(a, w, peaks, cfg), *_optimizer(a, w, cfg, peaks), *_data_loading(a, w), *_host_syncs(a),
            *_host_launch(a, w, cfg), *_accumulation(a, w, cfg), *_recompute(a, w, cfg), *_communication(a, w, cfg),
            *_attention_path(a, w, peaks, cfg), *_tuning(a, peaks),
            *_memory_format(a), *_precision(a, w, peaks), *_fp8(a, w, peaks, cfg)]
    if not rows:
        return pd.DataFrame(columns=COLUMNS)
    df = pd.DataFrame(rows, columns=COLUMNS)
    df = _with_measured(df, measured_rows(a.manifest, a.measured))
    return df.sort_values(["changes_numerics", "estimated_saving_ms"], ascending=[True, False], kind="stable",
                          ignore_index=True)
