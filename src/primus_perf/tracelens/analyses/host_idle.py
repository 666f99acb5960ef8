"""Why the GPU idles on the host's account: synchronizing calls, and a host too slow to keep
the queue filled.

- ``sync_calls``: the runtime calls that made the host wait for the GPU: every
  ``...Synchronize`` call (stream, device, event), and a memcpy call that returned only
  after its own copy ended (``cudaMemcpy``, or ``cudaMemcpyAsync`` into pageable memory,
  which is what ``.item()``, ``.tolist()`` and ``.cpu()`` come down to).
- ``syncs`` (per rank, step and call site): the synchronizing calls, the host's time
  blocked in them, and the GPU idle that follows them: a call during which the queue
  drained leaves the GPU idle from the later of the drain and the call's start until the
  next GPU event starts (one gap counts once, for the call that began it). The call site is
  the host op that synchronized (``aten::item``, ``aten::to``, ... : the outermost of the
  copy/scalar ops around the call) and the op or annotation that called it.
- ``replay`` (per rank and step): the step replayed from the trace, the host's items
  (launches, synchronizing calls, data loading: ``DataLoader.__next__``) in their order with the host time between them, each GPU
  event starting at the later of its launch and the end of its stream's previous event, plus
  the delay it showed after whichever of the two released it (its launch-to-start latency,
  or its gap behind the previous event); four ways:

  - ``replay_s``: as recorded (the check: it reproduces the step's span);
  - ``no_sync_s``: without waiting in the synchronizing calls (the counts or values kept
    on the device): what avoiding the syncs could give;
  - ``no_host_s``: with the host's time between and in launches removed, the syncs and the
    data loading kept: the bound of what launching faster could give (CUDA graphs, fewer and
    larger kernels); syncs still drain the queue, and the host's latency after each and its
    time from there to its next launch (the work on what it read) stay;
  - ``double_gpu_s``: with every GPU event of the forward and backward passes twice as
    long, the optimizer step's as recorded and the host unchanged: a micro-batch twice as
    large (the passes' GPU time linear in the tokens; the optimizer's work is per parameter
    and the host's per step, the same at any micro-batch);
  - ``no_data_s``: with the data loading taking no time: what a faster input pipeline
    could give (worker processes, pinned memory, prefetching).

  When the run's manifest records the unprofiled step time (``overhead``), the host's
  time is first scaled so the recorded replay lasts that long (or as near as a faster host
  gets it: a GPU-bound step's host may shrink to nothing): the profiler slows the
  host, not the GPU, so an unscaled replay would credit the host with time the profiler
  took.

Dependencies between streams (``cudaStreamWaitEvent``) are not replayed: a stream's event
waits only for its launch and its stream; a sync waits for the GPU event it waited for in
the trace (the last to end before it returned), at that event's replayed end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L
from primus_perf.tracelens.arrays import member, order_by_start, unique
from primus_perf.tracelens.link import Linked, by_step
from primus_perf.tracelens.tables import op_label

SYNC_COLUMNS = ["rank", "step", "site", "call", "calls", "wait_s", "idle_after_s"]
REPLAY_COLUMNS = ["rank", "step", "span_s", "replay_s", "no_sync_s", "no_host_s", "double_gpu_s", "no_data_s",
                  "host_scale"]
_SYNC_NAME = re.compile(r"Synchronize")
_DATA_NAME = re.compile(r"DataLoader.*__next__")
_MEMCPY_NAME = re.compile(r"Memcpy")
# host ops that only carry a copy or a scalar to the host: the site is the outermost of them
_COPY_WINDOW_US = 200.0
_SCALE_STEPS = 12  # bisection steps of the host scale: 1/4096 of it
_NO_OP = ""
_COPY_KIND = re.compile(r"\b(HtoD|DtoH|DtoD|HtoH|PtoP)\b")
_COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy", "aten::to", "aten::_local_scalar_dense", "aten::item",
                       "aten::cpu", "aten::tolist", "aten::contiguous", "aten::clone"})


def sync_calls(rt: L.RawTrace, lk: Linked) -> np.ndarray:
    """Rows of the runtime calls that synchronized with the GPU (see the module docstring)."""
    runtime = rt.kind == L.KIND_RUNTIME
    sync = runtime & np.isin(rt.name, [c for c, n in enumerate(rt.names) if _SYNC_NAME.search(n)])
    copies = np.flatnonzero(runtime & np.isin(rt.name, [c for c, n in enumerate(rt.names) if _MEMCPY_NAME.search(n)]))
    if len(copies):  # a copy call that returned after its copy ended waited for it
        mine = member(lk.launch, copies)
        ends = np.full(len(copies), -np.inf)
        np.maximum.at(ends, np.searchsorted(copies, lk.launch[mine]), rt.ts[lk.gpu[mine]] + rt.dur[lk.gpu[mine]])
        sync[copies[np.isfinite(ends) & (ends <= rt.ts[copies] + rt.dur[copies])]] = True
    return np.flatnonzero(sync)


def _site(rt: L.RawTrace, lk: Linked, row: int, by_thread: dict[int, tuple[np.ndarray, np.ndarray]]) -> str:
    """``op`` or ``op in caller`` for the host op around a runtime call ("" outside any op)."""
    th = int(rt.thread[row])
    if th not in by_thread:
        return _NO_OP
    ts, rows = by_thread[th]
    a, b = float(rt.ts[row]), float(rt.ts[row] + rt.dur[row])
    i = int(np.searchsorted(ts, a, side="right")) - 1
    op = int(rows[i]) if i >= 0 else -1
    while op >= 0 and rt.ts[op] + rt.dur[op] < b:  # not around the call: up to one that is
        op = int(lk.op_parent[op])
    chain = []
    while op >= 0:
        name = op_label(rt.names[rt.name[op]])
        if name != "ProfilerStep":
            chain.append(name)
        op = int(lk.op_parent[op])
    if not chain:
        return _NO_OP
    j = 0
    while j + 1 < len(chain) and chain[j] in _COPY_OPS and chain[j + 1] in _COPY_OPS:
        j += 1
    return chain[j] + (f" in {chain[j + 1]}" if j + 1 < len(chain) else "")


def _direction(rt: L.RawTrace, row: int, copies: tuple[np.ndarray, np.ndarray, np.ndarray]) -> str:
    """" (DtoH)" or " (HtoD)": the copy the call made, or the one its thread launched just
    before it (within ``_COPY_WINDOW_US``: the copy a following sync waits for)."""
    ts, thread, label = copies
    i = int(np.searchsorted(ts, rt.ts[row], side="right")) - 1
    while i >= 0 and rt.ts[row] - ts[i] <= _COPY_WINDOW_US:
        if thread[i] == rt.thread[row]:
            return f" ({label[i]})"
        i -= 1
    return ""


def _syncs(rt: L.RawTrace, lk: Linked, rank: int, rows: np.ndarray) -> pd.DataFrame:
    if not len(rows) or not len(lk.gpu):
        return pd.DataFrame(columns=SYNC_COLUMNS)
    steps = lk.op_step[rows] if lk.steps else np.zeros(len(rows), dtype=np.int32)
    ops = lk.op_rows
    by_thread = {}
    for th in unique(rt.thread[rows]).tolist():
        o = ops[rt.thread[ops] == th]
        o = o[order_by_start(rt.ts[o], rt.dur[o])]
        by_thread[th] = (rt.ts[o], o)
    mem = np.flatnonzero((rt.kind[lk.gpu] == L.KIND_MEMCPY) & (lk.launch >= 0))
    m_rows = lk.launch[mem]
    m_kind = [(_COPY_KIND.search(rt.names[rt.name[g]]) or [""])[0] for g in lk.gpu[mem].tolist()]
    o = np.argsort(rt.ts[m_rows], kind="stable")
    copies = (rt.ts[m_rows][o], rt.thread[m_rows][o], np.asarray(m_kind, dtype=object)[o])
    start = rt.ts[lk.gpu]
    order = np.argsort(start, kind="stable")
    s_sorted = start[order]
    busy = np.maximum.accumulate((start + rt.dur[lk.gpu])[order])
    out = []
    gaps: dict[int, tuple[float, int]] = {}  # next event -> (idle, index into out)
    for r, st in zip(rows.tolist(), steps.tolist(), strict=True):
        if lk.steps and st < 0:
            continue
        a, b = float(rt.ts[r]), float(rt.ts[r] + rt.dur[r])
        i = int(np.searchsorted(s_sorted, b, side="right"))
        drained = float(busy[i - 1]) if i > 0 else -np.inf
        wait = max(min(drained, b) - a, 0.0) if i > 0 else 0.0
        idle = 0.0
        if drained <= b and i < len(s_sorted):
            idle = float(s_sorted[i]) - max(drained, a)
        site = _site(rt, lk, r, by_thread)
        site = f"{rt.names[rt.name[r]]} (no op)" if site == _NO_OP else site + _direction(rt, r, copies)
        out.append([rank, st, site, rt.names[rt.name[r]], 1, wait, 0.0])
        if idle > 0 and (i not in gaps or gaps[i][0] < idle):
            gaps[i] = (idle, len(out) - 1)
    for idle, k in gaps.values():
        out[k][6] = idle
    df = pd.DataFrame(out, columns=SYNC_COLUMNS)
    g = df.groupby(["rank", "step", "site", "call"], as_index=False)[["calls", "wait_s", "idle_after_s"]].sum()
    g[["wait_s", "idle_after_s"]] /= 1e6
    return g[SYNC_COLUMNS]


@dataclass
class _Step:
    """One step's host items (launches, synchronizing calls, data loading), in order, and the
    GPU events they launched, in the order the replay releases them (by item, then as
    recorded), as arrays."""

    gap: np.ndarray  # per item: host time before it (not in any earlier item)
    adv: np.ndarray  # per item: its own host time (the part not overlapping earlier items)
    kind: np.ndarray  # per item: _LAUNCH, _SYNC or _DATA
    wait_end: np.ndarray  # per item: for a sync that waited, the recorded end of the GPU event it waited for, else -inf
    # (times of the step from t0, its start on the host)
    waited: np.ndarray  # per item: that event's position among the step's events, -1 if not one of them
    ret: np.ndarray  # per item: for a sync that waited, its return latency after that end
    n_events: np.ndarray  # per item: GPU events it launched
    item: np.ndarray  # per event: its item
    stream: np.ndarray  # per event: its stream, numbered from 0 in the step
    lat: np.ndarray  # per event: its launch-to-start delay, when its launch released it
    after: np.ndarray  # per event: its delay after its stream's previous event, when that released it
    dur: np.ndarray  # per event
    per_step: np.ndarray  # per event: its work is per parameter (not doubled with the tokens)
    prior: np.ndarray  # per stream: the end of its last event before the step's first (from t0), or -inf
    t0: float


_LAUNCH, _SYNC, _DATA = 0, 1, 2


class _Events:
    """Per GPU event of a trace (indexed like ``lk.gpu``), what every step's replay reads:
    computed once per trace. ``per_step``: events whose work is per parameter, not per token
    (the optimizer's, unless given)."""

    def __init__(self, rt: L.RawTrace, lk: Linked, prev: np.ndarray, per_step: np.ndarray | None = None) -> None:
        self.start = rt.ts[lk.gpu]
        self.end = self.start + rt.dur[lk.gpu]
        l_ts = np.where(lk.launch >= 0, rt.ts[np.clip(lk.launch, 0, None)], -np.inf)
        self.p_end = np.where(prev >= 0, self.end[np.clip(prev, 0, None)], -np.inf)
        by_launch = l_ts >= self.p_end  # its launch released it, not its stream
        self.lat = np.where(by_launch, np.maximum(self.start - l_ts, 0.0), 0.0)
        self.after = np.where(by_launch, 0.0, np.maximum(self.start - self.p_end, 0.0))
        self.by_end = np.argsort(self.end, kind="stable")
        self.sorted_end = self.end[self.by_end]
        self.dur = rt.dur[lk.gpu]
        self.per_step = lk.in_optimizer.astype(bool) if per_step is None else per_step
        self.stream = rt.stream[lk.gpu].astype(np.int64)


def _position(values: np.ndarray, of: np.ndarray) -> np.ndarray:
    """The position in ``of`` of each of ``values`` (-1 where absent)."""
    if not len(of):
        return np.full(len(values), -1, dtype=np.int64)
    sorter = np.argsort(of, kind="stable")
    pos = sorter[np.clip(np.searchsorted(of, values, sorter=sorter), 0, len(of) - 1)]
    return np.where(of[pos] == values, pos, -1)


def _prepare(rt: L.RawTrace, lk: Linked, events: np.ndarray, syncs: np.ndarray, data: np.ndarray, t0: float,
             ev: _Events) -> _Step | None:
    launch = lk.launch[events]
    items = unique(np.concatenate([launch[launch >= 0], syncs, data]))
    if not len(items):
        return None
    items = items[np.argsort(rt.ts[items], kind="stable")]
    ts, end = rt.ts[items], rt.ts[items] + rt.dur[items]
    host_end = np.empty(len(end))
    host_end[0], host_end[1:] = t0, end[:-1]
    host_end = np.maximum.accumulate(host_end)
    is_sync = np.isin(items, syncs)
    kind = np.where(is_sync, _SYNC, np.where(np.isin(items, data), _DATA, _LAUNCH)).astype(np.int8)
    ok = launch >= 0
    item = _position(launch[ok], items)
    order = np.argsort(item, kind="stable")  # by item, then as recorded
    e_ok, item = events[ok][order], item[order]
    # what each sync waited for: the GPU event that ended last before it returned, if that
    # ended during the call (else the call did not wait)
    j = np.searchsorted(ev.sorted_end, end, side="right") - 1
    waited = np.where(j >= 0, ev.by_end[np.clip(j, 0, None)], -1)
    waited = np.where(is_sync & (waited >= 0) & (ev.end[np.clip(waited, 0, None)] > ts), waited, -1)
    wait_end = np.where(waited >= 0, ev.end[np.clip(waited, 0, None)], -np.inf)
    ret = np.where(waited >= 0, np.maximum(end - wait_end, 0.0), 0.0)
    streams, stream = np.unique(ev.stream[e_ok], return_inverse=True)
    by_start = events[np.argsort(ev.start[events], kind="stable")]
    seen, first = np.unique(ev.stream[by_start], return_index=True)  # each stream's first event of the step
    prior = ev.p_end[by_start[first]][_position(streams, seen)]
    return _Step(np.maximum(ts - host_end, 0.0), np.maximum(end - np.maximum(ts, host_end), 0.0), kind, wait_end - t0,
                 np.where(waited >= 0, _position(waited, e_ok), -1), ret, np.bincount(item, minlength=len(items)),
                 item, stream.ravel(), ev.lat[e_ok], ev.after[e_ok], ev.dur[e_ok], ev.per_step[e_ok], prior - t0, t0)


def _replay(s: _Step, host: float = 1.0, syncs: bool = True, launches: bool = True, gpu: float = 1.0,
            data: bool = True) -> float:
    """The end of the step's last GPU event when replayed, from the step's start: host time
    scaled by ``host``, the per-token GPU events' durations by ``gpu`` (the per-step ones as
    recorded); ``syncs``:
    whether the synchronizing calls wait; ``launches``: whether the host's time between and in
    launches counts (data loading's own time does, and the host's after a sync); ``data``:
    whether data loading takes its time.

    Between two syncs that wait, the host's clock does not depend on the GPU: each item's
    time is a running sum, and on each stream an event ends at ``max(its launch + delay, the
    previous end + its gap) + its duration``, a running maximum (``E = S + cummax(A + D - S)``
    with ``S`` the running sum of gaps and durations); a sync that waits then sets the clock
    to the replayed end of the event it waited for."""
    n = len(s.kind)
    waits = (s.kind == _SYNC) & np.isfinite(s.wait_end)
    synced = waits & syncs
    skip = (s.kind == _SYNC) & (s.n_events == 0) & (not syncs)  # a pure synchronize call, removed
    is_data = s.kind == _DATA
    after_sync = np.zeros(n, dtype=bool)
    after_sync[1:] = synced[:-1]
    pre = s.gap * host * (launches | after_sync)
    post = np.where(is_data, s.adv * host * data,
                    np.where(skip | synced, 0.0, np.where(waits, s.ret, s.adv) * host * launches))
    dur = np.where(s.per_step, s.dur, s.dur * gpu)
    stream_end = s.prior.copy()
    ended = np.full(len(s.item), np.nan)
    last, clock, a = 0.0, 0.0, 0
    for b in [*np.flatnonzero(synced).tolist(), n - 1]:
        if b < a:
            continue
        gaps = pre[a:b + 1].copy()
        gaps[1:] += post[a:b]
        at = clock + np.cumsum(gaps)  # each item's clock after its own gap
        lo, hi = np.searchsorted(s.item, [a, b + 1])
        for st in unique(s.stream[lo:hi]).tolist():
            idx = lo + np.flatnonzero(s.stream[lo:hi] == st)
            d = dur[idx]
            acc = np.cumsum(s.after[idx] + d)
            end = acc + np.maximum(np.maximum.accumulate(at[s.item[idx] - a] + s.lat[idx] + d - acc), stream_end[st])
            ended[idx], stream_end[st] = end, end[-1]
            last = max(last, float(end.max()))
        if synced[b]:
            w = s.waited[b]
            done = s.wait_end[b] if w < 0 or np.isnan(ended[w]) else ended[w]
            clock = max(float(at[-1]) + (s.adv[b] * host if launches else 0.0), done + s.ret[b])
        else:
            clock = float(at[-1]) + post[b]
        a = b + 1
    return last


def _scale(s: _Step, target: float) -> float:
    """The host scale at which the recorded replay lasts ``target`` (1 when it cannot be
    reached by slowing the host down less)."""
    if _replay(s) <= target:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(_SCALE_STEPS):
        mid = (lo + hi) / 2
        if _replay(s, host=mid) > target:
            hi = mid
        else:
            lo = mid
    return hi


def data_calls(rt: L.RawTrace) -> np.ndarray:
    """Rows of the host spans that fetch a batch (``enumerate(DataLoader)#...__next__``)."""
    codes = [c for c, n in enumerate(rt.names) if _DATA_NAME.search(n)]
    host = (rt.kind == L.KIND_CPU_OP) | (rt.kind == L.KIND_ANNOTATION)
    return np.flatnonzero(host & np.isin(rt.name, codes)) if codes else np.zeros(0, dtype=np.int64)


def trace_idle(rt: L.RawTrace, lk: Linked, rank: int, prev: np.ndarray,
               unprofiled_s: float | None = None, per_step: np.ndarray | None = None
               ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One trace's ``syncs`` and ``replay`` tables (see the module docstring); ``prev``: the
    previous GPU event of each one's stream (-1 for the first); ``per_step``: per GPU event,
    whether its work is per parameter (default: the optimizer's)."""
    rows = sync_calls(rt, lk)
    syncs = _syncs(rt, lk, rank, rows)
    if not len(lk.gpu) or not (lk.launch >= 0).any() or not lk.steps:
        return syncs, pd.DataFrame(columns=REPLAY_COLUMNS)
    out = []
    ev = _Events(rt, lk, prev, per_step)
    g_end = ev.end
    data = data_calls(rt)
    per_step_events, sync_steps, data_steps = by_step(lk.step), by_step(lk.op_step[rows]), by_step(lk.op_step[data])
    none = np.zeros(0, dtype=np.int64)
    for step, t0 in zip(lk.steps, lk.step_windows[:, 0].tolist(), strict=True):
        events = per_step_events.get(step)
        if events is None:
            continue
        s = _prepare(rt, lk, events, rows[sync_steps.get(step, none)], data[data_steps.get(step, none)], t0, ev)
        if s is None:
            continue
        span = float(g_end[events].max()) - t0
        scale = _scale(s, unprofiled_s * 1e6) if unprofiled_s else 1.0
        base, kinds = _replay(s, scale), set(s.kind.tolist())
        # a variant that changes nothing in this step (no syncs, no data loading) is the replay itself
        same = [not kw or ("syncs" in kw and _SYNC not in kinds) or ("data" in kw and _DATA not in kinds)
                for kw in _VARIANTS]
        values = [base if eq else _replay(s, scale, **kw) for kw, eq in zip(_VARIANTS, same, strict=True)]
        out.append((rank, step, span / 1e6, *(v / 1e6 for v in values), scale))
    return syncs, pd.DataFrame(out, columns=REPLAY_COLUMNS)


# the replays of REPLAY_COLUMNS, in order
_VARIANTS: tuple[dict[str, Any], ...] = ({}, {"syncs": False}, {"launches": False}, {"gpu": 2.0}, {"data": False})
