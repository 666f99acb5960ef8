"""The host side of a trace: CPU against GPU time per op, kernel launches, and each step's
critical path.

- ``cpu_ops`` (per op name): calls, CPU time inclusive and self (its span minus the spans
  of the ops directly inside it), beside the GPU time of the kernels it launched itself
  and inside it (:mod:`.op_times`). An op with much more CPU than GPU time keeps the host
  busy for little GPU work.
- ``launches`` (per rank and step): runtime calls that launched GPU work
  (``cudaLaunchKernel``, ``cuLaunchKernelEx``, ``cudaGraphLaunch``, ``hipLaunchKernel``,
  memcpy and memset calls, ...), their total and median duration, the launch-to-start
  delay (from the start of the call to the start of its first GPU event: the time the work
  waited in the queue, or for the call itself) as median, 90th percentile and maximum, and
  the queue depth at each launch (GPU events of the device launched before it and not yet
  finished) as median and maximum. ``delay_histogram``: launches per delay bin
  (``DELAY_BINS_US``), over all steps.
- ``critical_path`` (per rank and step): the longest dependent chain that ends at the
  step's last GPU event, found by walking back from it. A GPU event depends on the previous
  event of its stream and on its launch; the walk follows whichever released it last: the
  stream (the event was queued before the previous one ended: the kernels are on the path
  back to back, and the gap between them is ``wait``) or its launch (the event waited for
  the host: the time from the launch call to its start is ``launch``, and the walk
  continues on the launching thread). On the host, the path runs back to the step's start
  (``cpu``) unless a synchronizing call (:func:`.host_idle.sync_calls`: a ``...Synchronize``
  call, or a memcpy that returned only after its copy ended, such as ``cudaMemcpyAsync``
  into pageable memory under ``.item()`` or ``.cpu()``) returned in between: then the host
  waited for the GPU event that ended last before that call returned, and the walk
  continues from that event (the sync's return latency is ``cpu``). A step whose host runs
  far ahead of its GPU (a deep queue) thus has its path on the GPU: the host's time counts
  only where a launch, not the stream, released a GPU event. Dependencies between streams through events (``cudaStreamWaitEvent``) are not
  followed: a kernel held by another stream shows as ``wait``. The path's length is the
  step's start on the host to its last GPU event's end, and ``cpu + launch + gpu + wait``
  add up to it. A host-bound step has most of its path on the host (``cpu``, ``launch``);
  a GPU-bound step in ``gpu``. A trace without launches (GPU events only) has no path.
- ``syncs`` and ``replay``: the synchronizing calls and the step replayed without them or
  without the host's launch time (:mod:`.host_idle`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L
from primus_perf.tracelens.analyses.host_idle import (
    REPLAY_COLUMNS,
    SYNC_COLUMNS,
    sync_calls,
    trace_idle,
)
from primus_perf.tracelens.arrays import order_by_start, unique
from primus_perf.tracelens.link import Linked, by_step
from primus_perf.tracelens.tables import op_label

CPU_OP_COLUMNS = ["op", "calls", "cpu_s", "cpu_self_s"]
LAUNCH_COLUMNS = ["rank", "step", "launches", "launch_s", "launch_p50_us", "delay_p50_us", "delay_p90_us",
                  "delay_max_us", "queue_p50", "queue_max"]
PATH_COLUMNS = ["rank", "step", "path_s", "cpu_s", "launch_s", "gpu_s", "wait_s", "events"]
DELAY_BINS_US = (0.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 1e5, np.inf)


@dataclass
class HostTables:
    """One trace's host-side tables (totals; :func:`combine` makes them per step)."""

    cpu_ops: pd.DataFrame  # op, calls, cpu_us, cpu_self_us
    launches: pd.DataFrame  # LAUNCH_COLUMNS
    delay_counts: np.ndarray  # launches per DELAY_BINS_US bin
    critical_path: pd.DataFrame  # PATH_COLUMNS
    syncs: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=SYNC_COLUMNS))
    replay: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=REPLAY_COLUMNS))


def _cpu_ops(rt: L.RawTrace, lk: Linked) -> pd.DataFrame:
    ops = np.flatnonzero(rt.kind == L.KIND_CPU_OP)
    if lk.steps:
        ops = ops[lk.op_step[ops] >= 0]
    if not len(ops):
        return pd.DataFrame(columns=["op", "calls", "cpu_us", "cpu_self_us"])
    child = np.zeros(len(rt))
    parent = lk.op_parent[ops]
    has = parent >= 0
    np.add.at(child, parent[has], rt.dur[ops][has])
    df = pd.DataFrame({"code": rt.name[ops], "cpu_us": rt.dur[ops],
                       "cpu_self_us": np.maximum(rt.dur[ops] - child[ops], 0.0)})
    g = df.groupby("code").agg(calls=("cpu_us", "size"), cpu_us=("cpu_us", "sum"),
                               cpu_self_us=("cpu_self_us", "sum")).reset_index()
    g["op"] = [op_label(rt.names[c]) for c in g["code"].tolist()]
    return g.groupby("op", as_index=False)[["calls", "cpu_us", "cpu_self_us"]].sum()


def _launches(rt: L.RawTrace, lk: Linked, rank: int) -> tuple[pd.DataFrame, np.ndarray]:
    ok = lk.launch >= 0
    if lk.steps:
        ok &= lk.step >= 0
    counts = np.zeros(len(DELAY_BINS_US) - 1, dtype=np.int64)
    if not ok.any():
        return pd.DataFrame(columns=LAUNCH_COLUMNS), counts
    gpu = lk.gpu[ok]
    launch = lk.launch[ok]
    first = pd.Series(rt.ts[gpu]).groupby(launch).min()  # each launch's first GPU event
    rows = first.index.to_numpy(dtype=np.int64)
    l_ts = rt.ts[rows]
    delay = np.maximum(first.to_numpy() - l_ts, 0.0)
    step = pd.Series(lk.step[ok] if lk.steps else np.zeros(int(ok.sum()), dtype=np.int32)).groupby(launch).first()
    step = step.to_numpy()
    # queue depth: GPU events of the device launched before the call and not finished at it
    all_ok = lk.launch >= 0
    launched = np.sort(rt.ts[lk.launch[all_ok]])
    ended = np.sort(rt.ts[lk.gpu[all_ok]] + rt.dur[lk.gpu[all_ok]])
    queue = np.maximum(np.searchsorted(launched, l_ts, side="left") - np.searchsorted(ended, l_ts, side="right"), 0)
    counts += np.histogram(delay, bins=np.asarray(DELAY_BINS_US))[0]
    df = pd.DataFrame({"step": step, "dur": rt.dur[rows], "delay": delay, "queue": queue})
    by = df.groupby("step")
    g = by.agg(launches=("dur", "size"), launch_us=("dur", "sum"), launch_p50_us=("dur", "median"),
               delay_p50_us=("delay", "median"), delay_max_us=("delay", "max"), queue_p50=("queue", "median"),
               queue_max=("queue", "max"))
    g["delay_p90_us"] = by["delay"].quantile(0.9)  # one vectorized pass (a lambda per step: 0.36 s per GB)
    g = g.reset_index()
    g["rank"] = rank
    g["launch_s"] = g.pop("launch_us") / 1e6
    return g[LAUNCH_COLUMNS], counts


class _Walk:
    """The critical-path walk of one trace (see the module docstring)."""

    def __init__(self, rt: L.RawTrace, lk: Linked) -> None:
        self.start = rt.ts[lk.gpu]
        self.end = self.start + rt.dur[lk.gpu]
        self.launch = lk.launch
        self.l_ts = np.where(lk.launch >= 0, rt.ts[np.clip(lk.launch, 0, None)], -np.inf)
        self.l_thread = np.where(lk.launch >= 0, rt.thread[np.clip(lk.launch, 0, None)], -1)
        # the previous GPU event of each one's stream (by start), -1 for the first
        stream = rt.stream[lk.gpu].astype(np.int64)
        order = order_by_start(self.start, group=stream)
        prev = np.full(len(order), -1, dtype=np.int64)
        same = np.r_[False, stream[order][1:] == stream[order][:-1]]
        prev[order[1:]] = np.where(same[1:], order[:-1], -1)
        self.prev = prev
        self.by_end = np.argsort(self.end, kind="stable")
        self.sorted_end = self.end[self.by_end]
        syncs = sync_calls(rt, lk)
        self.syncs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for th in unique(rt.thread[syncs]).tolist():
            s = syncs[rt.thread[syncs] == th]
            e = rt.ts[s] + rt.dur[s]
            o = np.argsort(e)
            self.syncs[th] = (rt.ts[s][o], e[o])

    def _released_by(self, sync_ts: float, sync_end: float) -> int:
        """The GPU event that ended last before a sync returned, if it ended during it."""
        i = int(np.searchsorted(self.sorted_end, sync_end, side="right")) - 1
        if i < 0 or self.sorted_end[i] <= sync_ts:
            return -1
        return int(self.by_end[i])

    def step(self, events: np.ndarray, t0: float) -> tuple[float, float, float, float, int]:
        """(cpu, launch, gpu, wait) microseconds and events on the path of one step whose GPU
        events are ``events`` (indices into the trace's GPU events) and host start ``t0``."""
        cpu = launch = gpu = wait = 0.0
        n = 0
        e = int(events[np.argmax(self.end[events])])
        t = float(self.end[e])
        while True:  # on the GPU at event e, t = its end
            s = float(self.start[e])
            if s <= t0:
                gpu += max(t - t0, 0.0)
                return cpu, launch, gpu, wait, n + 1
            gpu += t - s
            n += 1
            p = int(self.prev[e])
            pe = float(self.end[p]) if p >= 0 else -np.inf
            lt = float(self.l_ts[e])
            if p >= 0 and pe > t0 and pe >= lt:  # queued before the stream freed: the stream released it
                wait += max(s - pe, 0.0)
                e, t = p, min(pe, s)
                continue
            if self.launch[e] < 0 or lt <= t0:  # the path starts here
                cpu += max(s - t0, 0.0)
                return cpu, launch, gpu, wait, n
            launch += max(s - lt, 0.0)
            t, th = min(lt, s), int(self.l_thread[e])
            ts_, te_ = self.syncs.get(th, (np.zeros(0), np.zeros(0)))
            j = int(np.searchsorted(te_, t, side="right")) - 1
            while True:  # on the host at t; syncs of a thread do not overlap: each ends before the next starts
                if j < 0 or te_[j] <= t0:
                    cpu += max(t - t0, 0.0)
                    return cpu, launch, gpu, wait, n
                cpu += t - te_[j]
                r = self._released_by(float(ts_[j]), float(te_[j]))
                if r >= 0 and self.end[r] > t0:
                    cpu += float(te_[j] - self.end[r])
                    e, t = r, float(self.end[r])
                    break
                cpu += float(te_[j] - max(ts_[j], t0))  # the sync did not wait for the GPU: host time
                t, j = float(ts_[j]), j - 1
                if t <= t0:
                    return cpu, launch, gpu, wait, n


def _critical_path(rt: L.RawTrace, lk: Linked, rank: int, walk: _Walk | None) -> pd.DataFrame:
    if walk is None:  # no GPU work, or no launches (a GPU-only trace)
        return pd.DataFrame(columns=PATH_COLUMNS)
    if lk.steps:
        windows = dict(zip(lk.steps, lk.step_windows[:, 0].tolist(), strict=True))
        steps = lk.step
    else:
        host = np.flatnonzero(rt.kind != L.KIND_KERNEL)
        windows = {0: float(rt.ts[host].min()) if len(host) else float(walk.start.min())}
        steps = np.zeros(len(lk.gpu), dtype=np.int32)
    rows = []
    per_step = by_step(steps)
    for step, t0 in windows.items():
        events = per_step.get(step)
        if events is None:
            continue
        cpu, launch, gpu, wait, n = walk.step(events, t0)
        total = cpu + launch + gpu + wait
        rows.append((rank, step, total / 1e6, cpu / 1e6, launch / 1e6, gpu / 1e6, wait / 1e6, n))
    return pd.DataFrame(rows, columns=PATH_COLUMNS)


def trace_host(rt: L.RawTrace, lk: Linked, rank: int, unprofiled_s: float | None = None,
               per_param: np.ndarray | None = None) -> HostTables:
    """One trace's host tables (``rank`` is provisional until :func:`combine` sets it);
    ``unprofiled_s``: the run's step time without the profiler, when its manifest has it
    (the replays are scaled to it); ``per_param``: per GPU event, whether its work is per
    parameter (the optimizer's, data-parallel collectives: the same at any micro-batch)."""
    launches, counts = _launches(rt, lk, rank)
    walk = _Walk(rt, lk) if len(lk.gpu) and (lk.launch >= 0).any() else None
    prev = walk.prev if walk is not None else np.full(len(lk.gpu), -1, dtype=np.int64)
    syncs, replay = trace_idle(rt, lk, rank, prev, unprofiled_s, per_param)
    return HostTables(_cpu_ops(rt, lk), launches, counts, _critical_path(rt, lk, rank, walk), syncs, replay)


def cpu_vs_gpu(per_trace: Sequence[pd.DataFrame], op_times: pd.DataFrame, per_step: int) -> pd.DataFrame:
    """Per op name, per step: calls, CPU time (inclusive, self) and GPU time (self,
    inclusive: :mod:`.op_times`), by CPU time, largest first."""
    df = pd.concat([d for d in per_trace if len(d)], ignore_index=True) if any(len(d) for d in per_trace) else None
    cols = [*CPU_OP_COLUMNS, "gpu_self_s", "gpu_s"]
    if df is None:
        return pd.DataFrame(columns=cols)
    df = df.groupby("op", as_index=False)[["calls", "cpu_us", "cpu_self_us"]].sum()
    out = pd.DataFrame({"op": df["op"], "calls": df["calls"] / per_step, "cpu_s": df["cpu_us"] / 1e6 / per_step,
                        "cpu_self_s": df["cpu_self_us"] / 1e6 / per_step})
    gpu = op_times.set_index("op")[["self_s", "inclusive_s"]] if len(op_times) else None
    out["gpu_self_s"] = out["op"].map(gpu["self_s"]).fillna(0.0) if gpu is not None else 0.0
    out["gpu_s"] = out["op"].map(gpu["inclusive_s"]).fillna(0.0) if gpu is not None else 0.0
    return out.sort_values("cpu_s", ascending=False, ignore_index=True)[cols]


def delay_histogram(counts: Sequence[np.ndarray]) -> pd.DataFrame:
    """Launches per launch-to-start delay bin, summed over traces."""
    total = np.sum(counts, axis=0) if len(counts) else np.zeros(len(DELAY_BINS_US) - 1, dtype=np.int64)
    lo, hi = DELAY_BINS_US[:-1], DELAY_BINS_US[1:]
    return pd.DataFrame({"lo_us": lo, "hi_us": hi, "launches": total.astype(np.int64)})
