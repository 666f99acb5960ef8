"""Chains of memory-bound kernels that a compiler or a fused kernel could run as one.

A chain is a run of consecutive elementwise and normalization kernels on one stream in one
step (of one rank), in start order, with no other kernel of that stream between them and
at least two op calls. Per chain: kernels, op calls, measured GPU time, the bytes its ops
move (:func:`~..perf_models.model_bytes`: every input read, one output written; a call's
bytes are shared among its kernels by their time), and the time of the kernels whose op
has no bytes model (no recorded shapes).

The estimate (:func:`fusion_estimate`): fused, a chain would move its bytes less its
intermediates at the bandwidth a device reaches in practice, ``ATTAINABLE_BW`` of its
datasheet peak (measured: a device-to-device copy on an H200 ran at 4.23 of its 4.8 TB/s,
``primus-profile preflight``); the saving is the measured time minus that, never below
zero, counted only in the share of the chain's time with no communication kernel beside it
(``shared_us``: a kernel sharing the GPU with NCCL is slowed by it, and what fusing it saves
there is not known; GEMM tuning leaves such time out the same way). The trace records no
dataflow, so the intermediates are assumed: each call of a chain after the first reads what
the call before it wrote (``intermediate``: the smaller of the two, from the calls'
``written`` bytes; next to a call without a bytes model, the other's figure), and fused,
that tensor is not read back; its write is kept (the eager
autograd saves many such tensors for the backward, and a compiler keeps some). A kernel
whose op has no bytes model (a ``cat`` of a tensor list, ops without recorded shapes) adds
no bytes to a chain that has modeled ops (it moves what its neighbours wrote and read: an
intermediate once fused); a chain with no modeled op at all is not estimated (its time
counts as not improvable). A cast inside a GEMM op (autocast's weight cast under
``aten::linear``) is elementwise but no intermediate: it stays out of the chains, as the
GEMM does; so does per-parameter work (``tables.param_shaped``: a gradient's accumulation,
FSDP2's all-gather copy-out), which runs outside any compiled region, and an indexed op
(:data:`INDEXED`: a scatter must finish before what reads it, a gather reads at its index's
pace) ends a chain as a GEMM does. A chain goes on across one GEMM call (its kernels: cuBLAS's memset, autocast's weight cast)
where one side is a single op whose tensor the other side takes in the same shape: the GEMM
is independent of it and a compiler runs it first (SwiGLU's ``silu(gate) * up``: eager runs
the up projection between them; backward, its ``silu_backward`` after the up projection's
gradient GEMMs). A chain between two grouped GEMMs (``experts``: the
GEMMs nearest it on its stream are both grouped) is an expert's activation on rows whose
count per expert changes every step: compiled code leaves it eager (the reference trainer
disables compilation there; a compiled region would recompile for every split), so it is
estimated at nothing.

Checked against ``train.compile=block`` measured by ``primus-tune step`` on H100s
(llama3-8b, seq 4096, 16 sequences a GPU, 8 layers): one GPU 187.8 ms estimated, 215.9
measured; FSDP2 over 2 GPUs 173.1 against 143.5-159.7; over 4 GPUs 111.7 against 159.6 (the
share beside communication grows with the GPUs); 4 layers at micro-batch 2, 12.6 ms a step
against 12.7 (101.7 ms over 16 sequences) and 9.5 for ``train.compile=pointwise``, which
fuses less (``tests/tracelens/test_analysis_next.py``). On MoE runs the GPU time is estimated, not the
step's: one GPU, qwen3-30b-a3b 54.3 ms against 57.0 ms less GPU time compiled, mixtral-8x7b
35.5 against 54.0, while their steps saved 32.6 and 20.7 ms (the host's syncs in every
layer, where compiled regions break their graphs: the advice says so). A Hugging Face
transformers script on an H200 (Qwen2 with 7B dims, 4 layers, 2 x 2,048 tokens x 4
micro-batches, bf16): 26.8 ms estimated, 27 measured compiling each decoder layer.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.tracelens.analyses.breakdown import covered
from primus_perf.tracelens.categories import (
    COMMUNICATION,
    ELEMENTWISE,
    GEMM,
    MODELED,
    NORMALIZATION,
    op_category,
)

COLUMNS = ["rank", "step", "stream", "kernels", "calls", "time_us", "bytes", "intermediate", "unmodeled_us",
           "shared_us", "experts", "ops"]
# indexed ops: a scatter writes where an index says (what reads its output waits for all of it:
# a compiler runs it as a kernel of its own) and a gather reads rows at an index's pace, which
# fusing does not change; either ends a chain, as a GEMM does
INDEXED = frozenset({"aten::index_add", "aten::index_add_", "aten::index_put", "aten::index_put_",
                     "aten::_index_put_impl_", "aten::scatter", "aten::scatter_", "aten::scatter_add",
                     "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_", "aten::index",
                     "aten::index_select", "aten::gather", "aten::take", "aten::embedding_dense_backward"})
MEMORY_BOUND = (ELEMENTWISE, NORMALIZATION)
MAX_OPS_LABEL = 6
ATTAINABLE_BW = 0.88  # of the datasheet HBM bandwidth: an H200's measured device-to-device copy


def _labels(run: np.ndarray, ops: pd.Series) -> pd.Series:
    """Per run (``run`` sorted), its ops' names in order (``aten::`` dropped, consecutive
    repeats once, at most ``MAX_OPS_LABEL`` and a count of the rest)."""
    names = ops.astype(str).str.removeprefix("aten::").to_numpy(dtype=object)
    new_run = np.r_[True, run[1:] != run[:-1]]
    first = new_run | np.r_[True, names[1:] != names[:-1]]
    kept, starts = names[first], np.flatnonzero(new_run[first])

    def label(seq: np.ndarray) -> str:
        more = len(seq) - MAX_OPS_LABEL
        return ", ".join(seq[:MAX_OPS_LABEL].tolist()) + (f" (+{more})" if more > 0 else "")

    return pd.Series([label(x) for x in np.split(kept, starts[1:])], index=run[new_run])


def _first_dims(labels: pd.Series) -> pd.Series:
    """The first tensor's dims of each shape label (``2x2048x18944`` of ``2x2048x18944, ... bf16``)."""
    return labels.astype(str).str.extract(r"^(\d+(?:x\d+)+)", expand=False).fillna("")


def _bridged(k: pd.DataFrame, mem: np.ndarray, new_group: np.ndarray, run: np.ndarray) -> np.ndarray:
    """``run`` with the memory-bound runs on either side of one GEMM call (its kernels, and the
    other kernels of GEMM ops: cuBLAS's memset, autocast's weight cast) joined where one of them is a single call whose tensor
    the other one's first (or last) call takes, in the same shape: an independent GEMM launched
    between an op and the op that reads its output (SwiGLU's ``silu(gate) * up``: eager runs the
    up projection between the silu and the mul; backward, its silu_backward after the up
    projection's gradient GEMMs). A compiler fuses them and runs the GEMM before (see the
    module docstring)."""
    n = len(k)
    if n < 3:
        return run
    gap = ~mem
    gap_start = gap & (np.r_[True, ~gap[:-1]] | new_group)
    seg = np.cumsum(gap_start)
    at = np.flatnonzero(gap)
    if not len(at):
        return run
    call = k["call"].to_numpy()
    gemm = (k["category"] == GEMM).to_numpy()
    # besides the GEMM's kernels, only kernels of a GEMM op (cuBLAS's memset, autocast's weight cast)
    op = k["op"].astype("category")
    of_gemm = np.array([op_category(str(c)) == GEMM for c in op.cat.categories] + [False], dtype=bool)
    other = ~gemm & ~of_gemm[op.cat.codes.to_numpy()]
    g = pd.DataFrame({"seg": seg[at], "at": at, "other": other[at]}).groupby("seg").agg(
        first=("at", "min"), last=("at", "max"), other=("other", "any"))
    gemms = pd.DataFrame({"seg": seg[at][gemm[at]], "call": call[at][gemm[at]]})
    one = gemms.groupby("seg")["call"].agg(["nunique", "min"])
    one = one[(one["nunique"] == 1) & (one["min"] >= 0)].index
    g = g[g.index.isin(one) & ~g["other"] & (g["first"] > 0) & (g["last"] < n - 1)]
    first, last = g["first"].to_numpy(), g["last"].to_numpy()
    ok = mem[first - 1] & mem[last + 1] & ~new_group[first] & ~new_group[last + 1]
    first, last = first[ok], last[ok]
    if not len(first):
        return run
    calls = pd.Series(np.where(call >= 0, call, -1 - np.arange(n)))
    per_run = calls.groupby(run).nunique()
    single = (per_run.reindex(run[first - 1]).to_numpy() == 1) | (per_run.reindex(run[last + 1]).to_numpy() == 1)
    shape = k["shape"].astype("category")
    labels = np.array([*map(str, shape.cat.categories), ""], dtype=object)
    dims = np.array([*_first_dims(pd.Series(labels[:-1], dtype=object)), ""], dtype=object)
    code = shape.cat.codes.to_numpy()
    left, right = code[first - 1], code[last + 1]
    # the left run's last tensor in the right run's first call, or the other way round
    takes = np.array([bool(a) and (a in b or c in d) for a, b, c, d in zip(dims[left], labels[right], dims[right],
                                                                          labels[left], strict=True)], dtype=bool)
    join = single & takes
    if not join.any():
        return run
    starts = np.r_[True, run[1:] != run[:-1]]
    # the GEMM's kernels continue the run on their left, and so does the run on their right
    a, length = first[join], last[join] - first[join] + 2
    offset = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    starts[np.repeat(a, length) + offset] = False
    return np.cumsum(starts)


def chains(kernels: pd.DataFrame, calls: pd.DataFrame) -> pd.DataFrame:
    """The chains of every rank and step (see the module docstring)."""
    cols = ["rank", "step", "stream", "ts_us", "dur_us", "category", "call", "op", "shape"]
    k = kernels.loc[kernels["step"] >= 0, cols + (["param_shaped"] if "param_shaped" in kernels.columns else [])]
    if k.empty:
        return pd.DataFrame(columns=COLUMNS)
    k = k.sort_values(["rank", "step", "stream", "ts_us"], kind="stable").reset_index(drop=True)
    mem = k["category"].isin(MEMORY_BOUND).to_numpy().copy()
    # a cast inside a GEMM op (autocast's weight cast) is not an intermediate fusion removes:
    # it stays out of the chains, as the GEMM does
    op = k["op"].astype("category")
    modeled = np.array([op_category(str(c)) in MODELED for c in op.cat.categories] + [False], dtype=bool)
    mem &= ~modeled[op.cat.codes.to_numpy()]  # code -1 (no op): the appended False
    if "param_shaped" in k.columns:  # per-parameter work (a gradient's accumulation, FSDP2's copies): no compiler fuses it
        mem &= ~k["param_shaped"].to_numpy(dtype=bool)
    mem &= ~op.isin(INDEXED).to_numpy()
    group = k[["rank", "step", "stream"]].to_numpy()
    new_group = np.r_[True, (group[1:] != group[:-1]).any(axis=1)]
    run = np.cumsum(new_group | np.r_[True, mem[1:] != mem[:-1]])
    run = _bridged(k, mem, new_group, run)
    m = k[mem].copy()
    if m.empty:
        return pd.DataFrame(columns=COLUMNS)
    m["run"] = run[mem]
    # between two grouped GEMMs (the GEMMs nearest before and after it on its stream in its step):
    # an expert's activation on rows whose count per expert changes every step (see the docstring)
    grouped_rows = calls.loc[calls["kind"] == kinds.GROUPED.name, ["rank", "row"]]
    grouped = (pd.MultiIndex.from_frame(k[["rank", "call"]]).isin(pd.MultiIndex.from_frame(grouped_rows))
               if len(grouped_rows) else np.zeros(len(k), dtype=bool))
    at = np.arange(len(k))
    gemm = (k["category"] == GEMM).to_numpy()
    group_id = np.cumsum(new_group)
    prev_gemm = np.maximum.accumulate(np.where(gemm, at, -1))
    next_gemm = np.minimum.accumulate(np.where(gemm, at, len(k))[::-1])[::-1]
    ok = (prev_gemm >= 0) & (next_gemm < len(k))
    p, n = np.clip(prev_gemm, 0, len(k) - 1), np.clip(next_gemm, 0, len(k) - 1)
    experts = ok & grouped[p] & grouped[n] & (group_id[p] == group_id) & (group_id[n] == group_id)
    m["experts"] = experts[mem]
    memory = calls[calls["kind"] == "memory"]
    call_bytes = memory.groupby(["rank", "row"])["bytes"].first()
    call_written = (memory.groupby(["rank", "row"])["written"].first() if "written" in memory.columns
                    else pd.Series(np.nan, index=call_bytes.index))
    call_time = k[k["call"] >= 0].groupby(["rank", "call"])["dur_us"].sum()
    idx = pd.MultiIndex.from_arrays([m["rank"], m["call"]])
    b = call_bytes.reindex(idx).to_numpy(dtype=np.float64)
    t = call_time.reindex(idx).to_numpy(dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        m["bytes"] = np.where(np.isfinite(b) & (t > 0), b * m["dur_us"].to_numpy() / t, 0.0)
    m["unmodeled_us"] = np.where(np.isfinite(b), 0.0, m["dur_us"].to_numpy())
    m["shared_us"] = 0.0
    comm = kernels[(kernels["category"] == COMMUNICATION).to_numpy()]
    for rank, c in comm.groupby("rank", sort=False):  # each kernel's time beside its rank's communication kernels
        mine = (m["rank"] == rank).to_numpy()
        start = m.loc[mine, "ts_us"].to_numpy(dtype=np.float64)
        cs = c["ts_us"].to_numpy(dtype=np.float64)
        m.loc[mine, "shared_us"] = covered(cs, cs + c["dur_us"].to_numpy(dtype=np.float64), start,
                                           start + m.loc[mine, "dur_us"].to_numpy(dtype=np.float64))
    m["call_id"] = np.where(m["call"] >= 0, m["call"], -1 - np.arange(len(m)))
    m["intermediate"] = 0.0
    # each call after the first reads what the call before it wrote (up to what it reads): fused, that
    # tensor is not read back (the trace records no dataflow: assumed, see the module docstring)
    first = m.drop_duplicates(["run", "call_id"])
    w = call_written.reindex(pd.MultiIndex.from_arrays([first["rank"], first["call"]])).to_numpy(dtype=np.float64)
    b = call_bytes.reindex(pd.MultiIndex.from_arrays([first["rank"], first["call"]])).to_numpy(dtype=np.float64)
    same_run = np.r_[False, first["run"].to_numpy()[1:] == first["run"].to_numpy()[:-1]]
    link = np.zeros(len(first))
    if len(first) > 1:
        # a call without a bytes model (NaN) takes its neighbour's figure: it moves what they wrote and
        # read (an intermediate once fused, as above); NaN only where neither is known
        link[1:] = np.fmin(w[:-1], b[1:] - w[1:])
    link = np.where(same_run & np.isfinite(link), np.maximum(link, 0.0), 0.0)
    m.loc[first.index, "intermediate"] = link
    g = m.groupby("run", sort=False).agg(rank=("rank", "first"), step=("step", "first"), stream=("stream", "first"),
                                         kernels=("dur_us", "size"), calls=("call_id", "nunique"),
                                         time_us=("dur_us", "sum"), bytes=("bytes", "sum"),
                                         intermediate=("intermediate", "sum"), unmodeled_us=("unmodeled_us", "sum"),
                                         shared_us=("shared_us", "sum"), experts=("experts", "first"))
    g["ops"] = _labels(m["run"].to_numpy(), m["op"])
    return g[g["calls"] >= 2].reset_index(drop=True)[COLUMNS]


def fusion_estimate(ch: pd.DataFrame, hbm_tb_s: float) -> pd.Series:
    """Per chain, the time fusion would save in microseconds on a device with a datasheet
    bandwidth of ``hbm_tb_s`` (see the module docstring)."""
    if ch.empty or hbm_tb_s <= 0:
        return pd.Series(0.0, index=ch.index)
    unmodeled = ch["unmodeled_us"].where(ch["bytes"] <= 0, 0.0)  # a chain without a modeled op: not improvable
    moved = (ch["bytes"] - ch.get("intermediate", 0.0)).clip(lower=0.0)  # an intermediate is not read back
    fused = moved / (hbm_tb_s * ATTAINABLE_BW * 1e12) * 1e6 + unmodeled
    alone = 1.0 - (ch["shared_us"] / ch["time_us"].where(ch["time_us"] > 0)).fillna(0.0).clip(0.0, 1.0)
    eager = ch["experts"].astype(bool) if "experts" in ch.columns else False
    return ((ch["time_us"] - fused) * alone).clip(lower=0.0).where(~eager, 0.0)
