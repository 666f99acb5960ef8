"""What the trace's workload is, before any advice is given: training or inference, the
parallel layout, whether torch.compile ran, and what each step waits on. Every
recommendation (:mod:`.recommendations`) reads it, and states the facts it rests on.

From the host events of each trace (:func:`trace_markers`: names matched by
:data:`MARKERS`, counted inside the steps) and the analysis's tables:

- ``mode``: ``training`` when the steps run a backward pass (ops inside autograd's
  backward nodes, or backward attention/convolution kernels) or an optimizer step
  (``Optimizer.step#``, fused Adam/SGD), or the run is ``primus-train``'s; ``inference`` when the trace has host ops and
  neither (forward only: serving, evaluation; decode/prefill/sampling annotations are named
  as evidence); ``unknown`` for a trace of GPU events alone without backward kernels.
- ``sharded``: parameters, gradients or optimizer state sharded over the data-parallel
  ranks: FSDP (``FSDP::`` annotations, ``FullyShardedDataParallel``), DeepSpeed ZeRO, the
  run's ``parallel.dp_shard`` > 1, or where none says, the collectives' pattern in a training
  trace (:mod:`.sharding`: gradients reduce-scattered, parameters all-gathered, nothing
  reduced in the forward pass); ``sharding``: what is sharded, ``parameters`` (FSDP, the
  ``dp_shard`` trainer, ZeRO unless its pattern says the optimizer alone, ZeRO-3-like
  gathers in the backward pass) or ``optimizer`` (its state and update only: ZeRO-1/2,
  Megatron's distributed optimizer); ``data_parallel``: the ranks the model is replicated or
  sharded over (the world size over the tensor-parallel size); ``tensor_parallel``: the
  run's ``parallel.tp``, else "yes" (-1) when collectives run inside the model's ops
  (``role`` activations: :mod:`.collectives`), else 1.
- ``expert_parallel``: MoE token exchange (an expert-parallel library's dispatch/combine,
  or an all-to-all in a trace with MoE ops or grouped GEMMs); ``embedding_all_to_all``: an
  all-to-all beside embedding-table ops and no MoE (DLRM-style model-parallel embeddings).
- ``compiled``: the run's ``train.compile``, else True when compiled regions or Inductor
  kernels ran, else None (not known: absent from a trace does not mean off).
- ``data_loading_s``: host time per step fetching batches (``DataLoader.__next__``).
- ``backward_passes`` and ``optimizer_steps`` per step (:mod:`..micro_batches`: the autograd
  engine's passes, told by their nodes' sequence numbers, and the top-level ``Optimizer.step#``
  annotations); ``micro_batches``: passes per optimizer step (more than one: the step
  accumulates gradients); ``micro_batch`` and ``tokens``: the sequences and positions of a
  micro-batch (the embedding's indices, 0 when not recorded); ``parameters``: the elements of
  the weights one forward pass reads (its linear and embedding ops: a tied embedding counts
  twice).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L
from primus_perf.tracelens.analyses.sharding import (
    PATTERN,
    SHARDS_OPTIMIZER,
    SHARDS_PARAMETERS,
    sharding_pattern,
)
from primus_perf.tracelens.arrays import unique_pairs
from primus_perf.tracelens.categories import ATTENTION_BWD, OPTIMIZER
from primus_perf.tracelens.link import Linked
from primus_perf.tracelens.micro_batches import backward_passes

MARKERS: dict[str, re.Pattern[str]] = {k: re.compile(rx, re.I) for k, rx in {
    "optimizer_step": r"^Optimizer\.step#|^aten::_fused_(adam|adamw|sgd|adagrad)",
    "inference": r"decode|prefill|generat|sampl|execute_model|forward_batch|model_runner|LLMEngine|graph_runner"
                 r"|spec_decode|^vllm::|^sglang::",
    "fsdp": r"^FSDP::|FullyShardedDataParallel|^fsdp::|fully_shard",
    "zero": r"DeepSpeedZero|ZeroOptimizer|^zero::|partition_grad",
    "ddp": r"DistributedDataParallel",
    "embedding": r"embedding_bag|SplitLookupFunction|split_embedding|\bTBE\b|torchrec|EmbeddingBag|sparse_lengths",
    "moe": r"\bmoe|moe_|_moe|expert|grouped_mm|deep_ep|token_dispatch|topk_gating|GroupedGemm",
    "compiled": r"CompiledFunction|Torch-Compiled Region|torch_compile|TorchDynamo|^triton_(poi|red|per|tem)_",
}.items()}
_DATA_LOADING = re.compile(r"DataLoader.*__next__")
EXAMPLE = "example:"  # trace_markers keys of a marker's first name seen


def trace_markers(rt: L.RawTrace, lk: Linked) -> Counter:
    """One trace's host events and kernels by marker (:data:`MARKERS`, inside the steps when
    the trace has steps), its backward ops, and the host time of data loading (us)."""
    host = (rt.kind == L.KIND_CPU_OP) | (rt.kind == L.KIND_ANNOTATION)
    gpu_kernel = rt.kind == L.KIND_KERNEL
    rows = (host | gpu_kernel) & ((lk.op_step >= 0) | ~host if lk.steps else True)
    counts = np.bincount(rt.name[rows], minlength=len(rt.names))
    out: Counter = Counter()
    for code in np.flatnonzero(counts).tolist():
        name = rt.names[code]
        for marker, rx in MARKERS.items():
            if rx.search(name):
                out[marker] += int(counts[code])
                out.setdefault(f"{EXAMPLE}{marker}", name)  # type: ignore[arg-type]
        if _DATA_LOADING.search(name):
            out["data_loading_us"] += float(rt.dur[rows & (rt.name == code)].sum())
    out["backward_ops"] += int((lk.op_backward & host & rows).sum())
    out["host_ops"] += int((host & (rt.kind == L.KIND_CPU_OP)).sum())
    passes = backward_passes(rt, lk)
    out["backward_passes"] += sum(passes.per_step.values())
    out["optimizer_steps"] += sum(passes.optimizer_steps.values())
    weights, batch = _forward_weights(rt, lk)
    out["weight_elements"] += weights
    if batch:
        out.setdefault(f"{EXAMPLE}batch", batch)  # type: ignore[arg-type]
    return out


# ops whose input ``index`` is a weight the forward reads once per micro-batch: 2-D for the
# products (a batched one's operands are activations), any for a convolution's
_WEIGHTS = {"aten::linear": 1, "aten::embedding": 0, "aten::matmul": 1, "aten::mm": 1, "aten::addmm": 2}
_CONV_WEIGHTS = {name: 1 for name in ("aten::convolution", "aten::_convolution", "aten::conv1d", "aten::conv2d",
                                      "aten::conv3d", "aten::cudnn_convolution", "aten::miopen_convolution")}


def _forward_weights(rt: L.RawTrace, lk: Linked) -> tuple[int, str]:
    """The elements of the weights that the steps' forward passes read (each linear, embedding,
    convolution or matrix product by a 2-D operand outside a backward node, the outermost of nested ones:
    autocast's inner linear and the product inside a linear are the same weight), and the
    embedding's indices (``2x2048``: the sequences and tokens of a micro-batch), in one check
    per recorded shape."""
    weights = {**_WEIGHTS, **_CONV_WEIGHTS}
    codes = {c: weights[nm] for c, nm in enumerate(rt.names) if nm in weights}
    if not codes:
        return 0, ""
    rows = np.flatnonzero(np.isin(rt.name, np.fromiter(codes, dtype=np.int64)) & (rt.shape >= 0)
                          & (lk.op_step >= 0 if lk.steps else True) & ~lk.op_backward)
    parent = lk.op_parent[rows]
    rows = rows[~((parent >= 0) & np.isin(rt.name[np.clip(parent, 0, None)], np.fromiter(codes, dtype=np.int64)))]
    total, batch = 0, Counter()
    names, shapes, inverse = unique_pairs(rt.name[rows], rt.shape[rows])
    for name, code, n in zip(names.tolist(), shapes.tolist(), np.bincount(inverse, minlength=len(names)).tolist(),
                             strict=True):
        args = rt.shape_args(int(code))
        at = codes[name]
        dims = args.dims if args is not None else []
        w = dims[at] if len(dims) > at else None
        conv = rt.names[name] in _CONV_WEIGHTS
        if isinstance(w, list) and (len(w) >= 3 if conv else len(w) == 2) and all(type(x) is int for x in w):
            total += n * math.prod(w)
        idx = dims[1] if rt.names[name] == "aten::embedding" and len(dims) > 1 else None
        if isinstance(idx, list) and len(idx) == 2 and all(type(x) is int for x in idx):
            batch[f"{idx[0]}x{idx[1]}"] += n
    return total, (batch.most_common(1)[0][0] if batch else "")


def _cfg(manifest: dict[str, Any], section: str, key: str) -> Any:
    cfg = manifest.get("config") if isinstance(manifest, dict) else None
    part = cfg.get(section) if isinstance(cfg, dict) else None
    return part.get(key) if isinstance(part, dict) else None


def compile_on(value: Any) -> bool | None:
    """A run's ``train.compile`` (``"off"``, ``"pointwise"``, ``"block"``, or a bool in older
    runs) as on/off; None when absent."""
    if value is None:
        return None
    return str(value).strip().lower() not in ("off", "false", "0", "none", "")


def workload(markers: Counter, manifest: dict[str, Any], kernels: Any, collective_events: Any,
             grouped_calls: int, world_size: int, rank_steps: int) -> dict[str, Any]:
    """The workload of an analysis (see the module docstring), as a JSON-ready dict with the
    evidence of each fact."""
    k = kernels[kernels["step"] >= 0] if len(kernels) else kernels
    cats = set(map(str, k["category"].unique())) if len(k) else set()
    ex = {m: markers.get(f"{EXAMPLE}{m}") for m in MARKERS}
    names = pd.Series(k["name"].unique().astype(str)) if len(k) else pd.Series([], dtype=str)
    backward = markers["backward_ops"] > 0 or ATTENTION_BWD in cats or bool(
        names.str.contains(r"backward|bwd|wgrad|dgrad", case=False, regex=True).any())
    stepping = markers["optimizer_step"] > 0 or OPTIMIZER in cats
    trainer = isinstance(_cfg(manifest, "train", "micro_batch"), int)  # a primus-train run
    if backward or stepping or trainer:
        mode = "training"
        evidence = ", ".join(x for x in ("a backward pass" if backward else "",
                                          f"an optimizer step ({ex['optimizer_step'] or 'optimizer kernels'})"
                                          if stepping else "", "a primus-train run" if trainer else "") if x)
    elif markers["host_ops"]:
        mode = "inference"
        evidence = "no backward pass and no optimizer step" + (
            f" ({ex['inference']})" if ex["inference"] else "")
    else:
        mode, evidence = "unknown", "GPU events only, no backward kernels"
    c = collective_events if len(collective_events) else None
    roles = Counter(zip(c["collective"], c["role"])) if c is not None else Counter()
    tp = _cfg(manifest, "parallel", "tp")
    groups = c.loc[(c["role"] == "activations") & (c["group_size"] > 1), "group_size"] if c is not None else []
    activations = sum(n for (_, role), n in roles.items() if role == "activations")
    tensor_parallel = (int(tp) if isinstance(tp, int) and tp > 0 else int(groups.mode().iloc[0]) if len(groups)
                       else -1 if activations else 1)
    dp = max(1, world_size // max(1, tensor_parallel))
    shard = _cfg(manifest, "parallel", "dp_shard")
    sharded_by = ("parallel.dp_shard=" + str(shard) if isinstance(shard, int) and shard > 1 else
                  ex["fsdp"] or ex["zero"] or "")
    sharding = SHARDS_PARAMETERS if sharded_by else ""
    if mode == "training" and (not sharded_by or (ex["zero"] and sharded_by == ex["zero"])):
        by_pattern, seen = sharding_pattern(collective_events, rank_steps)
        if by_pattern:  # ZeRO's annotations do not say its stage: the pattern does
            sharding, sharded_by = by_pattern, sharded_by or seen
    tokens = sum(n for (_, role), n in roles.items() if role == "tokens")
    moe_cfg = _cfg(manifest, "model", "moe")
    n_experts = moe_cfg.get("n_experts") if isinstance(moe_cfg, dict) else None
    moe = bool(grouped_calls or markers["moe"] or (isinstance(n_experts, int) and n_experts > 0)
               or roles.get(("dispatch", "tokens")) or roles.get(("combine", "tokens")))
    compiled = compile_on(_cfg(manifest, "train", "compile"))
    if compiled is None and markers["compiled"]:
        compiled = True
    passes, opt_steps = markers["backward_passes"], markers["optimizer_steps"]
    batch = str(markers.get(f"{EXAMPLE}batch") or "")
    return {
        "mode": mode, "mode_evidence": evidence,
        "sharded": bool(sharded_by), "sharded_by": sharded_by, "sharding": sharding,
        "data_parallel": dp, "tensor_parallel": tensor_parallel,
        "expert_parallel": bool(tokens and moe), "moe": moe,
        "embedding_all_to_all": bool(tokens and not moe and markers["embedding"]),
        "embedding_ops": ex["embedding"] or "",
        "compiled": compiled, "compiled_by": "train.compile" if _cfg(manifest, "train", "compile") is not None
        else (ex["compiled"] or ""),
        "ddp": bool(markers["ddp"]),
        "optimizer": ex["optimizer_step"] or "",
        "data_loading_s": markers["data_loading_us"] / 1e6 / max(1, rank_steps),
        "backward_passes": passes / max(1, rank_steps), "optimizer_steps": opt_steps / max(1, rank_steps),
        "micro_batches": round(passes / opt_steps) if passes and opt_steps else 0,
        "parameters": markers["weight_elements"] / passes if passes else 0.0,
        "micro_batch": int(batch.split("x")[0]) if batch else 0, "tokens": int(batch.split("x")[1]) if batch else 0,
    }


def summary(w: dict[str, Any]) -> str:
    """The workload in one line: ``training (a backward pass, ...); 2 data-parallel ranks,
    sharded (FSDP::pre_forward); torch.compile off; data loading 52.0 ms/step``."""
    if not w:
        return ""
    parts = [f"{w['mode']} ({w['mode_evidence']})"]
    layout = []
    if w.get("data_parallel", 1) > 1:
        by = str(w.get("sharded_by") or "").split(":")[0] if str(w.get("sharded_by")).startswith(PATTERN) \
            else w.get("sharded_by")
        what = "optimizer sharded" if w.get("sharding") == SHARDS_OPTIMIZER else "sharded"
        layout.append(f"{w['data_parallel']} data-parallel ranks" + (f", {what} ({by})" if w.get("sharded") else ""))
    tp = w.get("tensor_parallel", 1)
    if tp != 1:
        layout.append(f"tensor parallel {tp}" if tp > 1 else "tensor-parallel collectives")
    if w.get("expert_parallel"):
        layout.append("MoE token exchange")
    elif w.get("moe"):
        layout.append("MoE")
    if w.get("embedding_all_to_all"):
        layout.append("embedding all-to-all")
    parts += layout
    c = w.get("compiled")
    parts.append("torch.compile " + ("on" if c else "off" if c is False else "not seen"))
    if w.get("data_loading_s"):
        parts.append(f"data loading {w['data_loading_s'] * 1e3:.1f} ms/step")
    return "; ".join(parts)
