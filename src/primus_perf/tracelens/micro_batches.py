"""Micro-batches: the backward passes of each step, told by the autograd engine's nodes.

The autograd engine runs a backward pass's nodes (``autograd::engine::evaluate_function: X``)
in decreasing order of their sequence numbers (its ready queue is ordered by them), and a
forward pass numbers the nodes it creates upwards: a node whose sequence number is above the
one before it on its thread starts a new backward pass. Nodes without a number (a leaf's
``AccumulateGrad``) belong to the pass of the node before them on their thread; a node inside
another node (a reentrant checkpoint's nested backward) is part of the outer one's pass. A
step with several passes before its optimizer step accumulates gradients over micro-batches.

Per GPU event, its micro-batch in its step (by its launch's time): inside a pass's window (from
its first node's start to its last node's end) that pass, else the pass that follows (a
micro-batch's forward runs before its backward), the last pass after the last window (the
hooks that run as a backward pass ends: FSDP2's root post-backward callback); -1 outside the
steps, without a launch, or in a step without a backward pass.

All in vector passes over the backward nodes and the GPU events (no per-event Python loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from primus_perf.tracelens import load as L
from primus_perf.tracelens.link import BACKWARD_PREFIX, OPTIMIZER_PREFIX, Linked


@dataclass
class Passes:
    """The backward passes of one trace: per window (one per step and pass) its step, pass
    index, start and end on the host; per step (in ``Linked.steps`` order) the passes and the
    optimizer steps it runs."""

    step: np.ndarray
    index: np.ndarray
    start: np.ndarray
    end: np.ndarray
    per_step: dict[int, int]
    optimizer_steps: dict[int, int]


def _rows(rt: L.RawTrace, lk: Linked, prefix: str) -> np.ndarray:
    codes = np.array([c for c, nm in enumerate(rt.names) if nm.startswith(prefix)], dtype=np.int64)
    op = (rt.kind == L.KIND_CPU_OP) | (rt.kind == L.KIND_ANNOTATION)
    return np.flatnonzero(op & np.isin(rt.name, codes) & (lk.op_step >= 0)) if len(codes) else np.zeros(0, np.int64)


def _top_level(rows: np.ndarray, rt: L.RawTrace) -> np.ndarray:
    """``rows`` that start after every earlier one of their thread has ended (not nested)."""
    keep = [rows[:0]]
    for th in np.unique(rt.thread[rows]).tolist():  # the threads that run optimizer steps: few
        r = rows[rt.thread[rows] == th]
        r = r[np.argsort(rt.ts[r], kind="stable")]
        before = np.r_[-np.inf, np.maximum.accumulate(rt.ts[r] + rt.dur[r])[:-1]]
        keep.append(r[rt.ts[r] >= before])
    return np.concatenate(keep)


def backward_passes(rt: L.RawTrace, lk: Linked) -> Passes:
    """The backward passes of each step (see the module docstring), made once per linked trace
    (the tables and the workload's markers both read them)."""
    made = lk.__dict__.get("_passes")
    if made is None:
        made = lk.__dict__["_passes"] = _passes(rt, lk)
    return made


def _passes(rt: L.RawTrace, lk: Linked) -> Passes:
    empty = np.zeros(0)
    nodes = _rows(rt, lk, BACKWARD_PREFIX)
    if len(nodes):  # a node inside another node belongs to the outer one
        parent = lk.op_parent[nodes]
        nodes = nodes[~((parent >= 0) & lk.op_backward[np.clip(parent, 0, None)])]
    optim = _top_level(_rows(rt, lk, OPTIMIZER_PREFIX), rt)
    opt_steps = {int(s): int(n) for s, n in zip(*np.unique(lk.op_step[optim], return_counts=True), strict=True)}
    if not len(nodes):
        return Passes(empty.astype(np.int64), empty.astype(np.int64), empty, empty, {}, opt_steps)
    step, thread, ts, seq = lk.op_step[nodes], rt.thread[nodes], rt.ts[nodes], rt.seq[nodes].astype(np.int64)
    order = np.lexsort((ts, thread, step))
    nodes, step, thread, ts, seq = nodes[order], step[order], thread[order], ts[order], seq[order]
    group_start = np.r_[True, (step[1:] != step[:-1]) | (thread[1:] != thread[:-1])]
    numbered = seq >= 0
    # the sequence number of the numbered node before each one in its group (-1: none)
    at = np.where(numbered, np.arange(len(seq)), -1)
    last = np.maximum.accumulate(at)
    prev_at = np.r_[-1, last[:-1]]
    first_of_group = np.maximum.accumulate(np.where(group_start, np.arange(len(seq)), 0))
    prev_seq = np.where(prev_at >= first_of_group, seq[np.clip(prev_at, 0, None)], -1)
    new = numbered & (prev_seq >= 0) & (seq > prev_seq)
    count = np.cumsum(new | group_start)  # passes so far, counted from each group's start
    index = count - count[first_of_group]
    # a group without a numbered node tells no pass (a trace without sequence numbers)
    group = np.cumsum(group_start) - 1
    told = np.bincount(group, weights=numbered, minlength=int(group[-1]) + 1)[group] > 0
    nodes, step, ts, index = nodes[told], step[told], ts[told], index[told]
    if not len(nodes):
        return Passes(empty.astype(np.int64), empty.astype(np.int64), empty, empty, {}, opt_steps)
    end = ts + rt.dur[nodes]
    key = step.astype(np.int64) * (int(index.max()) + 1) + index
    keys, inverse = np.unique(key, return_inverse=True)
    w_start = np.full(len(keys), np.inf)
    w_end = np.full(len(keys), -np.inf)
    np.minimum.at(w_start, inverse, ts)
    np.maximum.at(w_end, inverse, end)
    w_step, w_index = keys // (int(index.max()) + 1), keys % (int(index.max()) + 1)
    per_step = {int(s): int(n) for s, n in zip(*np.unique(w_step, return_counts=True), strict=True)}
    return Passes(w_step, w_index, w_start, w_end, per_step, opt_steps)


def micro_batch_of_events(rt: L.RawTrace, lk: Linked, p: Passes) -> np.ndarray:
    """Per GPU event of ``lk``, its micro-batch in its step (see the module docstring), int16."""
    out = np.full(len(lk.gpu), -1, dtype=np.int16)
    if not len(p.step):
        return out
    ok = (lk.launch >= 0) & (lk.step >= 0)
    t = rt.ts[np.clip(lk.launch, 0, None)][ok]
    s = lk.step[ok].astype(np.int64)
    order = np.argsort(p.start, kind="stable")
    ws, we, wstep, wi = p.start[order], p.end[order], p.step[order], p.index[order]
    j = np.searchsorted(ws, t, side="right") - 1
    jj = np.clip(j, 0, None)
    mine = (j >= 0) & (wstep[jj] == s)
    pass_ = np.where(mine, np.where(t <= we[jj], wi[jj], wi[jj] + 1), 0)
    steps = np.array(sorted(p.per_step), dtype=np.int64)
    counts = np.array([p.per_step[int(x)] for x in steps], dtype=np.int64)
    k = np.searchsorted(steps, s)
    has = (k < len(steps)) & (steps[np.clip(k, 0, len(steps) - 1)] == s)
    n = np.where(has, counts[np.clip(k, 0, len(steps) - 1)], 0)
    pass_ = np.where(has, np.minimum(pass_, n - 1), -1)
    out[np.flatnonzero(ok)] = pass_.astype(np.int16)
    return out
