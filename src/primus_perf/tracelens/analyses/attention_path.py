"""Attention that left the causal fused path, and what that costs against the path it could take.

Two classes, from the op calls and the GPU events (:mod:`..tables`):

- ``masked`` / ``full``: a fused attention call (SDPA's cuDNN, flash or efficient kernels, by
  their names) on self-attention (as many keys as queries, at least :data:`..tables.SCORES_MIN`)
  that is not causal, given an explicit mask (``masked``: the kernel computes and biases every
  score; a mask rules out the causal kernels, which skip the half above the diagonal), or
  given none where the model is a language model (``full``). Seen on an H200 under
  ``torch.compile`` of a whole Hugging Face transformers model (Qwen2 with 7B dims, 4 layers,
  2 x 2,048 tokens a micro-batch, 4 micro-batches): transformers builds the causal mask while
  tracing (in eager it skips it and SDPA takes ``is_causal``), and SDPA ran cuDNN's biased
  kernel, 26.8 ms a step at 25% of the roofline, against 9.8 ms for the causal one in eager;
  compiling the decoder layers instead kept the causal kernel (10.1 ms).
- ``math``: the scores materialized, ``softmax(q k^T) v`` in several kernels (transformers'
  ``attn_implementation="eager"``, SDPA's math fallback): the GPU events of ops on a
  ``[..., s, s]`` tensor (:func:`..tables.scores_ops`: the products, the mask's add, the
  softmax, their gradients) with a softmax among them, and the kernels an attention op ran
  that are not attention kernels. The same H200 step with ``attn_implementation="eager"``:
  421 ms against 337 with SDPA.

Each is estimated against a fused kernel on the same problem: causal where the model is a
language model (a loss over a vocabulary at every position of the micro-batch: an encoder
trained on masked tokens looks the same, and needs its full attention), else full, at the
fraction of the roofline the causal fused kernels reach (:data:`FUSED_FRACTION`, or the
trace's own causal fused calls' where it has some): the saving is the calls' time less that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.base.devices import DevicePeaks
from primus_perf.problems import AttentionProblem
from primus_perf.tracelens.analyses.hotspots import in_steps
from primus_perf.tracelens.categories import ATTENTION_BWD, ATTENTION_FWD, kernel_category
from primus_perf.tracelens.tables import SCORES_MIN

# the fraction of the roofline SDPA's causal fused kernels reach, by pass: cuDNN's on an H200
# (torch 2.11, b2 h28/4 s2048 d128 bf16 causal: forward 0.42, backward 0.32); the best
# attention kernels measured on an H100 reach 0.56 and 0.50 (perf_models.ATTENTION_TRACE.by_pass)
FUSED_FRACTION = {"fwd": 0.42, "bwd": 0.32}
_SOFTMAX = re.compile(r"softmax", re.I)
# the token loss of a language model: its log-softmax (or cross-entropy) over the vocabulary, an
# aten op or a compiled kernel that fused it (``triton_red_fused__log_softmax_...``)
_LOSS_OPS = re.compile(r"log_softmax|cross_entropy|nll_loss")
MIN_VOCAB = 1000
_DIMS = re.compile(r"\d+(?:x\d+)+")


@dataclass
class OffPath:
    """Attention calls off the fused causal path: ``kind`` (``masked``, ``full`` or ``math``),
    the problem, per step its ``time_s`` and ``fused_s`` (the same problem on the fused
    kernel it could take), the ``ops`` that ran it, ``mask`` (the explicit mask's dims, or
    ``added`` where the math path adds one), ``target`` (``causal`` or ``full``) and ``lm``
    (the evidence that the model is a language model, "" none)."""

    kind: str
    problem: AttentionProblem
    time_s: float
    fused_s: float
    ops: str
    mask: str
    target: str
    lm: str

    @property
    def saving_s(self) -> float:
        return max(0.0, self.time_s - self.fused_s)


def _dims(label: str) -> list[list[int]]:
    """The tensors' dims of a shape label (``2x28x2048x2048, 2x1x2048x2048 bf16``)."""
    return [[int(x) for x in m.split("x")] for m in _DIMS.findall(str(label))]


def language_model(k: pd.DataFrame, tokens: set[int]) -> str:
    """The evidence that the model is a language model: a loss op over ``[positions, vocab]``
    (vocabulary of at least :data:`MIN_VOCAB`) whose positions are a micro-batch's tokens (one
    of ``tokens``), "" where none."""
    op = k["op"].astype("category")
    names = pd.Series(op.cat.categories.astype(str))
    loss = k[op.isin(names[names.str.contains(_LOSS_OPS)]).to_numpy()]
    for label in pd.unique(loss["shape"].astype(str)):
        for d in _dims(label):
            if len(d) >= 2 and d[-1] >= MIN_VOCAB and int(np.prod(d[:-1])) in tokens:
                return (f"a loss over a {d[-1]:,}-entry vocabulary at each of the {int(np.prod(d[:-1])):,} positions "
                        "(a language model's head)")
    return ""


def _fractions(calls: pd.DataFrame, peaks: DevicePeaks | None) -> dict[str, float]:
    """The causal fused calls' own fraction of the roofline by pass, else :data:`FUSED_FRACTION`."""
    out = dict(FUSED_FRACTION)
    if peaks is None or calls.empty:
        return out
    causal = calls[np.array([bool(getattr(p, "causal", False)) for p in calls["problem"]], dtype=bool)
                   & (calls["mask"] == "").to_numpy()]
    for d, g in causal.groupby("direction"):
        peak = peaks.peak_tflops(str(g["dtype"].iloc[0])) or 0.0
        t = float(g["time_us"].sum()) / 1e6
        if peak > 0 and t > 0 and str(d) in out:
            out[str(d)] = min(0.9, float(g["flops"].sum()) / t / (peak * 1e12))
    return out


def _fused_s(p: AttentionProblem, direction: str, calls: float, frac: dict[str, float], peaks: DevicePeaks) -> float:
    flops = p.forward_flops if direction == "fwd" else p.backward_flops
    peak = (peaks.peak_tflops(p.dtype) or 0.0) * 1e12
    return calls * flops / (frac[direction] * peak) if peak > 0 else float("inf")


def _fused_calls(a: Any, k: pd.DataFrame) -> pd.DataFrame:
    """The attention calls (in the steps) whose kernels are fused attention kernels by name."""
    c = a.calls
    c = c[(c["kind"] == kinds.ATTENTION.name) & c["problem"].notna()]
    if c.empty:
        return c.assign(fused=np.zeros(0, dtype=bool))
    names = k.loc[k["call"].isin(c["row"]), ["call", "name"]]
    by_name = {n: kernel_category(str(n)) in (ATTENTION_FWD, ATTENTION_BWD) for n in pd.unique(names["name"])}
    fused = names["name"].map(by_name).astype(bool).groupby(names["call"]).any()
    return c.assign(fused=fused.reindex(c["row"]).fillna(False).to_numpy(dtype=bool))


def off_path(a: Any, peaks: DevicePeaks | None) -> list[OffPath]:
    """The attention off the fused causal path in analysis ``a`` (see the module docstring)."""
    if peaks is None:
        return []
    k = in_steps(a.kernels)
    if k.empty:
        return []
    per = a.rank_steps
    c = _fused_calls(a, k)
    tokens = {int(p.batch * p.seq_q) for p in c["problem"]} if len(c) else set()
    out: list[OffPath] = []
    fused = c[c["fused"]] if len(c) else c
    frac = _fractions(fused, peaks)
    if len(fused):
        self_attn = np.array([p.seq_q == p.seq_kv >= SCORES_MIN and not p.causal for p in fused["problem"]], dtype=bool)
        off = fused[self_attn]
        lm = language_model(k, tokens)
        for _, g in off.groupby("key", sort=False):
            masked = g["mask"].astype(str).max()
            if not (masked or lm):
                continue  # full attention with no mask and no sign of a language model: an encoder's
            p = g["problem"].iloc[0]
            causal = AttentionProblem(**{**p.to_dict(), "causal": True}) if lm else p
            t = float(g["time_us"].sum()) / 1e6 / per
            est = sum(_fused_s(causal, str(d), len(gd) / per, frac, peaks) for d, gd in g.groupby("direction"))
            ops = ", ".join(sorted(set(k.loc[k["call"].isin(g["row"]), "op"].astype(str))))
            out.append(OffPath("masked" if masked else "full", p, t, est, ops, masked, "causal" if lm else "full", lm))
    math = _math_path(a, k, c, frac, peaks, per)
    return out + ([math] if math is not None else [])


def _math_path(a: Any, k: pd.DataFrame, c: pd.DataFrame, frac: dict[str, float], peaks: DevicePeaks,
               per: int) -> OffPath | None:
    """The scores materialized: the kernels of ops on them, and the non-attention kernels of
    attention ops (SDPA's math fallback), with a softmax among them."""
    unfused = c.loc[~c["fused"], "row"] if len(c) else pd.Series([], dtype=np.int64)
    sel = k["scores"].to_numpy(dtype=bool).copy() if "scores" in k.columns else np.zeros(len(k), dtype=bool)
    sel |= k["call"].isin(unfused).to_numpy()
    m = k[sel]
    soft = m["op"].astype(str).str.contains(_SOFTMAX) | m["leaf_op"].astype(str).str.contains(_SOFTMAX)
    if m.empty or not soft.any():
        return None
    shapes = [d for label in pd.unique(m["shape"].astype(str)) for d in _dims(label)]
    scores = [d for d in shapes if len(d) == 4 and d[-1] == d[-2] >= SCORES_MIN]
    if not scores:
        scores = [[d[0], 1, d[1], d[2]] for d in shapes if len(d) == 3 and d[-1] == d[-2] >= SCORES_MIN]
    if not scores:
        return None
    b, h, s, _ = max(scores, key=lambda d: d[1])
    heads = [d[-1] for d in shapes if len(d) >= 3 and d[-2] == s and d[-1] < s]
    if not heads:
        return None
    mask = ""
    for label in pd.unique(m["shape"].astype(str)):  # a mask added to the scores: a second [.., s, s] operand
        d = _dims(label)
        if len(d) >= 2 and len(d[0]) == len(d[1]) == 4 and d[1][-2:] == [s, s] and d[1] != d[0]:
            mask = "x".join(map(str, d[1]))
            break
    lm = language_model(k, {b * s})
    text = m["shape"].astype(str)
    dtype = "bf16" if text.str.contains("bf16").any() else "f16" if text.str.contains(" f16").any() else "f32"
    try:
        p = AttentionProblem(batch=b, heads_q=h, heads_kv=h, seq_q=s, seq_kv=s,
                             head_dim=int(max(set(heads), key=heads.count)), dtype=dtype, causal=bool(lm),
                             layout="bhsd")
    except ValueError:
        return None
    name = m["leaf_op"].astype(str)
    backward = name.str.contains("backward")
    fwd = float(m.loc[(soft & ~backward).to_numpy(), "call"].nunique()) / per
    bwd = float(m.loc[(soft & backward).to_numpy(), "call"].nunique()) / per
    t = float(m["dur_us"].sum()) / 1e6 / per
    est = _fused_s(p, "fwd", fwd, frac, peaks) + _fused_s(p, "bwd", bwd, frac, peaks)
    ops = ", ".join(sorted(set(m["op"].astype(str)))[:6])
    return OffPath("math", p, t, est, ops, mask, "causal" if lm else "full", lm)
