"""A file that holds the traces of several ranks, split into one trace per rank.

Tools that merge the traces of a job into one file for a timeline viewer keep every event
and tell the ranks apart in one of three ways, tried in this order:

- the rank in each event's ``args.rank`` (TraceLens's trace fusion, which also offsets the
  ``pid``, correlation and flow ids by the rank and writes no ``deviceProperties``);
- the rank in a process id written as a string (``"[TP03] 4121"``: :data:`RANK_IN_PID`);
- process ids offset by the rank times a power of ten: a GPU event's ``pid`` is its device
  index in a trace of one rank, so GPU events whose ``pid`` is not their ``args.device``
  give the offset (``pid - device = rank x 10^k``), and every ``pid`` its rank (``pid // 10^k``).

An event without a rank of its own takes its thread's (the rank most of the thread's events
have); events left without one are dropped, with a count in the note. The events of each
rank are linked on their own (correlation ids may repeat across ranks); a file of one rank
is returned as it is.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pandas as pd

from primus_perf.tracelens import load as L

# a rank written in a process id by the tools that merge traces (SGLang's merger: "[TP03] 4121")
RANK_IN_PID: tuple[re.Pattern[str], ...] = (
    re.compile(r"^\s*\[(?:TP|DP|PP|EP|CP|rank)[ _-]?(\d{1,6})\]", re.I),
    re.compile(r"^\s*rank[ _-]?(\d{1,6})\b", re.I),
)


_PID_MAX = 1 << 62  # a larger process id (a fuzzed or corrupt one) says no rank


def _pid_ranks(threads: list[tuple[int | str, int | str]]) -> np.ndarray:
    """Per thread code, the rank its process id names (:data:`RANK_IN_PID`), -1 if none."""
    out = np.full(len(threads), -1, dtype=np.int64)
    for i, (pid, _tid) in enumerate(threads):
        if isinstance(pid, str):
            m = next((m for rx in RANK_IN_PID if (m := rx.search(pid))), None)
            if m:
                out[i] = int(m.group(1))
    return out


def _offset_ranks(rt: L.RawTrace) -> np.ndarray:
    """Per thread code, the rank of process ids offset by rank x 10^k (see the module
    docstring); all -1 when the GPU events' pids are their devices (one rank)."""
    none = np.full(len(rt.threads), -1, dtype=np.int64)
    pid = np.array([p if isinstance(p, int) and 0 <= p < _PID_MAX else -1 for p, _ in rt.threads] or [-1],
                   dtype=np.int64)
    gpu = np.flatnonzero(np.isin(rt.kind, L.GPU_KINDS) & (rt.device >= 0))
    if not len(gpu):
        return none
    gpu_pid = pid[rt.thread[gpu]]
    off = gpu_pid - rt.device[gpu]
    off = off[(gpu_pid >= 0) & (off != 0)]
    if not len(off) or (off < 0).any():
        return none
    g = int(np.gcd.reduce(off))
    scale = 10 ** int(math.log10(g)) if g > 0 else 0
    while scale > 1 and g % scale:
        scale //= 10
    if scale <= int(rt.device[gpu].max()):
        return none
    by_thread = np.where(pid >= 0, pid // scale, -1)[: len(rt.threads)]
    host = np.flatnonzero((rt.kind == L.KIND_CPU_OP) | (rt.kind == L.KIND_RUNTIME))
    on_gpu, on_host = set(np.unique(by_thread[rt.thread[gpu]]).tolist()), set(np.unique(by_thread[rt.thread[host]]).tolist())
    if len(on_gpu) < 2 or (len(host) and on_gpu != on_host):  # each rank has its host and its GPU, else no offsets
        return none
    return by_thread


def _thread_fill(rank: np.ndarray, thread: np.ndarray, n_threads: int) -> np.ndarray:
    """``rank`` with each -1 replaced by its thread's most common rank (-1 if none)."""
    known = rank >= 0
    if known.all() or not known.any():
        return rank
    pairs = pd.DataFrame({"t": thread[known], "r": rank[known]}).value_counts().reset_index()
    best = pairs.drop_duplicates("t")  # value_counts sorts by count: the first row of a thread is its mode
    by_thread = np.full(n_threads, -1, dtype=np.int64)
    by_thread[best["t"].to_numpy()] = best["r"].to_numpy()
    return np.where(known, rank, by_thread[thread])


def event_ranks(rt: L.RawTrace) -> tuple[np.ndarray | None, str]:
    """Each event's rank (-1: none found) and how the ranks were told apart, or (None, "")
    for a trace of one rank."""
    n_threads = max(1, len(rt.threads))
    if rt.event_rank is not None:
        return _thread_fill(rt.event_rank.astype(np.int64), rt.thread, n_threads), "each event's args.rank"
    by_pid = _pid_ranks(rt.threads)
    how = "the rank in each process id"
    if not (by_pid >= 0).any():
        by_pid, how = _offset_ranks(rt), "process ids offset by the rank"
    if not (by_pid >= 0).any():
        return None, ""
    return by_pid[rt.thread], how


def _part(rt: L.RawTrace, keep: np.ndarray, thread_keep: np.ndarray, rank: int, first: bool) -> L.RawTrace:
    """The events ``keep`` of ``rt`` as the trace of ``rank`` (its loader counts on the first part only)."""
    new_row = np.cumsum(keep) - 1
    res = rt.resources
    res = res[keep[res["row"].to_numpy()]].assign(row=lambda r: new_row[r["row"].to_numpy()]).reset_index(drop=True)
    mem = rt.memory
    if len(mem):
        mem = mem[thread_keep[mem["thread"].to_numpy(dtype=np.int64)]].reset_index(drop=True)
    cols = {f: getattr(rt, f)[keep] for f in ("kind", "name", "thread", "ts", "dur", "correlation", "stream", "device",
                                              "seq", "shape")}
    return replace(rt, **cols, event_rank=None, resources=res, memory=mem,
                   distributed={**rt.distributed, "rank": rank},
                   fixes=rt.fixes if first else type(rt.fixes)(), unread=rt.unread if first else type(rt.unread)(),
                   dropped=rt.dropped if first else type(rt.dropped)())


def split_ranks(rt: L.RawTrace) -> tuple[list[L.RawTrace], str]:
    """The trace of each rank a file holds (``[rt]`` for one rank) and a note saying how
    they were told apart (empty for one rank)."""
    rank, how = event_ranks(rt)
    if rank is None:
        return [rt], ""
    ranks = np.unique(rank[rank >= 0])
    if len(ranks) <= 1:
        if len(ranks) == 1 and rt.rank is None:
            rt.distributed = {**rt.distributed, "rank": int(ranks[0])}
        return [rt], ""
    thread_rank = np.full(max(1, len(rt.threads)), -1, dtype=np.int64)
    thread_rank[rt.thread] = rank  # a thread's events are one rank's (the last written where they are not)
    parts = [_part(rt, rank == r, thread_rank == r, int(r), i == 0) for i, r in enumerate(ranks.tolist())]
    lost = int((rank < 0).sum())
    names = f"{ranks[0]}-{ranks[-1]}" if len(ranks) == ranks[-1] - ranks[0] + 1 else ", ".join(map(str, ranks))
    note = (f"{rt.path}: one file of {len(ranks)} ranks ({how}: a merged trace, as TraceLens's trace fusion "
            f"writes it), analyzed as ranks {names}" + (f"; {lost:,} event(s) of no rank left out" if lost else ""))
    return parts, note
