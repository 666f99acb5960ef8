"""The trace analysis facade: ``analyze(paths) -> Analysis`` of pandas DataFrames.

The pipeline: :mod:`.inputs` finds the trace files (one per rank, or the run folder of
``primus-profile run``), :mod:`.load` reads each into columns, :mod:`.link` links ops,
launches and GPU events, :mod:`.tables` categorizes the GPU events (:mod:`.categories`)
and models the op calls (:mod:`.perf_models`), and :mod:`.analyses` computes one table per
analysis.

``Analysis`` holds (every table per step: the mean over the profiled steps of every rank;
``calls`` are op calls):

- ``kernels``: one row per GPU event (see :mod:`.tables`), times in microseconds; the events
  of an all-to-allv share one shape (:func:`.analyses.collectives.pool_variable_sizes`).
- ``breakdown``: seconds per (rank, step, category); ``temporal``: the step time (``span_s``)
  and its compute, exposed communication, exposed memcpy and idle per (rank, step)
  (:mod:`.analyses.breakdown`).
- ``hotspots``: per (category, op, shape): calls, kernels, time, share, FLOPs, TFLOP/s,
  TB/s, fraction of the roofline (:mod:`.analyses.hotspots`).
- ``problems_by_kind``: the unique problems of each kind of the registry
  (:mod:`.analyses.problems`), also read as ``Analysis.<kind>_problems`` (the kind's
  ``table``: ``gemm_problems``, ...); :meth:`Analysis.problem_tables` returns them by kind.
- ``op_times``: per op name, self and inclusive GPU time (:mod:`.analyses.op_times`).
- ``rank_summary`` and ``collectives``: per-rank medians and collective start skew
  (:mod:`.analyses.collectives`).
- ``collective_events`` (one row per communication GPU event: collective, message bytes,
  group size, the rank's input and output bytes), ``collective_bandwidth`` (per collective
  and size: algorithm and bus bandwidth, skew) and ``collective_ranks`` (per collective and
  rank: time, bytes and bandwidth per step) (:mod:`.analyses.collectives`); ``world_size``.
- ``expert_load``: per MoE layer, tokens per expert over the profiled steps, when the run's
  manifest recorded them (:mod:`.analyses.expert_load`; empty otherwise).
- ``wall_steps``: the host (wall-clock) time of each ``ProfilerStep`` (:mod:`.analyses.step_times`).
- ``totals``: per-step figures; ``step_time_s`` is the median step span;
  ``outside_steps_gpu_s``: GPU time outside the profiled steps (total, see :mod:`.link`).
- ``chains``: runs of elementwise and normalization kernels a compiler could fuse, with the
  bytes they move (:mod:`.analyses.fusion`).
- ``cpu_ops`` (CPU against GPU time per op), ``launches`` (launch calls, launch-to-start
  delays and queue depth per step), ``launch_delays`` (a histogram of those delays) and
  ``critical_path`` (each step's critical path: its length and its CPU, launch, GPU and
  wait parts), ``syncs`` (per step and call site: the calls that made the host wait for the
  GPU and the GPU idle after them) and ``host_replay`` (each step replayed without those
  waits, and without the host's launch time) (:mod:`.analyses.host`, :mod:`.analyses.host_idle`).
- ``recommendations``: what to do next, ranked by the time it could save per step
  (:mod:`.analyses.recommendations`).
- :meth:`Analysis.kernel_efficiency` and :meth:`Analysis.memory`: per kernel name, the launch
  resources and occupancy Kineto records; and the memory view of a trace recorded with
  ``profile_memory`` (:mod:`.analyses.kernel_efficiency`, :mod:`.analyses.memory`). Both
  read the trace files a second time (:mod:`.analyses.extras`), on the first call.
- ``notes``: what the reader should know once: values the loader converted or dropped,
  GPU work outside the steps, missing shapes or CPU ops.

Many traces (ranks) are analyzed in parallel processes (``jobs``). One big trace is decoded
by as many processes as there are idle CPUs (each reads its pieces of an uncompressed file
itself), and with a CPU to spare its host tables (the critical path, the replays) are made
in a forked process while this one makes the others (``HOST_ASIDE_EVENTS``, up to
``HOST_ASIDE_MAX_EVENTS``): the same tables, sooner (a 1 GB trace on 2 cores: 6.7-7.9 s).

A trace recorded without shapes still gives categories (from kernel names) with FLOPs
unknown; a CPU-only trace (no GPU events) gives its problems with the ops' CPU time.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from primus_perf import kinds
from primus_perf.base.devices import lookup_peaks
from primus_perf.base.errors import TraceError
from primus_perf.tracelens import load as L
from primus_perf.tracelens.analyses import breakdown as B
from primus_perf.tracelens.analyses import host as H
from primus_perf.tracelens.analyses.collectives import (
    PARAMETERS,
    bandwidth,
    collective_skew,
    pool_variable_sizes,
    rank_bandwidth,
    rank_summary,
    trace_collectives,
    world_size,
)
from primus_perf.tracelens.analyses.expert_load import expert_load
from primus_perf.tracelens.analyses.extras import Extras, trace_extras
from primus_perf.tracelens.analyses.fusion import chains as fusion_chains
from primus_perf.tracelens.analyses.hotspots import hotspots, in_steps
from primus_perf.tracelens.analyses.kernel_efficiency import kernel_efficiency
from primus_perf.tracelens.analyses.memory import memory_view
from primus_perf.tracelens.analyses.op_times import op_times, trace_op_times
from primus_perf.tracelens.analyses.problems import KIND_COLUMNS, problem_table
from primus_perf.tracelens.analyses.recommendations import COLUMNS as RECOMMENDATION_COLUMNS
from primus_perf.tracelens.analyses.recommendations import recommend
from primus_perf.tracelens.analyses.step_times import host_steps
from primus_perf.tracelens.analyses.workload import trace_markers, workload
from primus_perf.tracelens.categories import (
    ATTENTION_BWD,
    ATTENTION_FWD,
    COMMUNICATION,
    COMPUTE,
    CONVOLUTION,
    GEMM,
)
from primus_perf.tracelens.device_arch import Inferred
from primus_perf.tracelens.inputs import discover
from primus_perf.tracelens.link import Linked, link
from primus_perf.tracelens.ranks import split_ranks
from primus_perf.tracelens.tables import TraceTables, kernel_table, trace_tables

ANALYSIS_SCHEMA = "primus-perf-analysis/1"
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.I)
_INPUT = {"export": False}  # a field that is an input of a table, not a table (export.analysis_tables)
_CATEGORICAL = ("name", "kind", "category", "op", "shape", "leaf_op", "fwd_op")


@dataclass
class Analysis:
    """The result of :func:`analyze` (see the module docstring)."""

    traces: list[str]
    device: dict[str, Any]
    ranks: list[int]
    steps: list[int]
    kernels: pd.DataFrame
    hotspots: pd.DataFrame
    breakdown: pd.DataFrame
    temporal: pd.DataFrame
    op_times: pd.DataFrame
    rank_summary: pd.DataFrame
    collectives: pd.DataFrame
    totals: dict[str, Any]
    manifest: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    collective_events: pd.DataFrame = field(default_factory=pd.DataFrame)
    collective_bandwidth: pd.DataFrame = field(default_factory=pd.DataFrame)
    collective_ranks: pd.DataFrame = field(default_factory=pd.DataFrame)
    wall_steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    world_size: int = 1
    expert_load: pd.DataFrame = field(default_factory=pd.DataFrame)
    cpu_ranks: list[int] = field(default_factory=list)  # ranks without GPU events beside ranks with them
    workload: dict[str, Any] = field(default_factory=dict)  # .analyses.workload
    chains: pd.DataFrame = field(default_factory=pd.DataFrame)
    cpu_ops: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=[*H.CPU_OP_COLUMNS, "gpu_self_s",
                                                                                "gpu_s"]))
    launches: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=H.LAUNCH_COLUMNS))
    launch_delays: pd.DataFrame = field(default_factory=lambda: H.delay_histogram([]))
    critical_path: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=H.PATH_COLUMNS))
    syncs: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=H.SYNC_COLUMNS))
    host_replay: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=H.REPLAY_COLUMNS))
    recommendations: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=RECOMMENDATION_COLUMNS))
    # what kernel_efficiency() and memory() read (.analyses.extras, every rank): not tables of their own
    launch_resources: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False, metadata=_INPUT)
    memory_events: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False, metadata=_INPUT)
    memory_ops: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False, metadata=_INPUT)
    calls: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False, metadata=_INPUT)  # modeled op calls
    # the step tuner's measurements of this run (inputs.STEP_PLAN, or the manifest's "measured")
    measured: list[Any] = field(default_factory=list)
    # kind name -> its problem table (every kind of the registry)
    problems_by_kind: dict[str, pd.DataFrame] = field(
        default_factory=lambda: {name: pd.DataFrame(columns=cols) for name, cols in KIND_COLUMNS.items()})

    def __getattr__(self, name: str) -> Any:
        """``<kind>_problems`` (a kind's ``table``): that kind's problem table."""
        if name != "problems_by_kind" and name.endswith("_problems"):
            tables = self.__dict__.get("problems_by_kind", {})
            if name[: -len("_problems")] in tables:
                return tables[name[: -len("_problems")]]
        raise AttributeError(f"'Analysis' object has no attribute {name!r}")

    @property
    def n_steps(self) -> int:
        """Profiled steps per rank (1 for a trace without step markers)."""
        return max(1, len(self.steps))

    @property
    def rank_steps(self) -> int:
        """(rank, step) pairs: what every per-step figure is divided by."""
        return self.n_steps * max(1, len(self.ranks) - len(self.cpu_ranks))

    @property
    def versions(self) -> dict[str, str]:
        """Library versions of the run (from the manifest of ``primus-profile run``)."""
        v = self.manifest.get("versions")
        return {str(k): str(x) for k, x in v.items()} if isinstance(v, dict) else {}

    def wall_step(self) -> tuple[float | None, str]:
        """The step's wall-clock time (seconds) and where it comes from: the run's manifest
        (``step_time_s``: the median of the profiled steps as ``primus-profile run`` timed them),
        else the median host span of the trace's ProfilerStep markers; (None, "") without
        either. A CPU run's step time (its trace has no GPU step to measure)."""
        v = self.manifest.get("step_time_s")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) and v > 0:
            return float(v), "the median profiled step in manifest.json"
        if len(self.wall_steps):
            return float(self.wall_steps["wall_s"].median()), "the median ProfilerStep span in the trace"
        return None, ""

    def problem_tables(self) -> dict[str, pd.DataFrame]:
        """The problem tables by kind name (every kind of ``primus_perf.kinds``)."""
        return dict(self.problems_by_kind)

    def kernel_efficiency(self) -> pd.DataFrame:
        """Per kernel name: launches and time per step, grid, block, registers, shared memory,
        blocks per SM, occupancy and a flag (:mod:`.analyses.kernel_efficiency`); empty when
        the trace records no launch resources."""
        x = self.__dict__.setdefault("_details", {})
        if "efficiency" not in x:
            x["efficiency"] = kernel_efficiency(self.launch_resources, float(in_steps(self.kernels)["dur_us"].sum()),
                                                self.rank_steps)
        return x["efficiency"]

    def memory(self) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
        """``(curve, peaks, by_op)`` of a trace recorded with ``profile_memory``
        (:mod:`.analyses.memory`); empty tables otherwise."""
        x = self.__dict__.setdefault("_details", {})
        if "memory_view" not in x:
            x["memory_view"] = memory_view(self.memory_events, self.memory_ops)
        return x["memory_view"]

    def category_seconds(self) -> pd.Series:
        """GPU event seconds per step by category, largest first."""
        by = self.breakdown.groupby("category")["seconds"].sum() / self.rank_steps
        return by.sort_values(ascending=False)

    def to_json(self, top: int = 50, details: bool = False) -> dict[str, Any]:
        """A JSON-ready summary: device, steps, breakdown (category -> seconds per step),
        the problems, totals, the recommendations, and the temporal, per-rank, hotspot,
        collective and host-side tables; with ``details`` also the kernel-efficiency table
        and the memory view (peaks, allocations per op), which read the traces again."""
        extra: dict[str, Any] = {}
        if details:
            _curve, peaks, by_op = self.memory()
            extra = {"kernel_efficiency": records(self.kernel_efficiency().head(top)),
                     "memory_peaks": records(peaks), "memory_by_op": records(by_op.head(top))}
        return {
            "schema": ANALYSIS_SCHEMA,
            "traces": self.traces,
            "device": self.device,
            "versions": self.versions,
            "manifest": self.manifest,
            "ranks": self.ranks,
            "steps": self.steps,
            "breakdown": {k: float(v) for k, v in self.category_seconds().items()},
            "temporal": records(self.temporal),
            **{kinds.get(kind).table: records(df) for kind, df in self.problem_tables().items()},
            "hotspots": records(self.hotspots.head(top)),
            "op_times": records(self.op_times.head(top)),
            "ranks_summary": records(self.rank_summary),
            "collectives": records(self.collectives),
            "collective_bandwidth": records(unknown_as_null(self.collective_bandwidth, COLLECTIVE_SIZES)),
            "collective_ranks": records(unknown_as_null(self.collective_ranks, COLLECTIVE_SIZES)),
            "expert_load": records(self.expert_load),
            "workload": self.workload,
            "recommendations": records(self.recommendations),
            "cpu_ops": records(self.cpu_ops.head(top)),
            "launches": records(self.launches),
            "launch_delays": records(self.launch_delays),
            "critical_path": records(self.critical_path),
            "syncs": records(self.syncs),
            "host_replay": records(self.host_replay),
            **extra,
            "totals": self.totals,
            "notes": self.notes,
        }


def _plain(v: Any) -> Any:
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return f if np.isfinite(f) else None
    if isinstance(v, np.bool_):
        return bool(v)
    if hasattr(v, "to_dict"):  # a problem
        return v.to_dict()
    return v


# sizes the collective tables write as -1 when the trace does not record them
COLLECTIVE_SIZES = ("bytes", "group_size", "in_bytes", "out_bytes")


def unknown_as_null(df: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """``df`` with the negative values (-1: unknown) of ``columns`` as None (null in JSON)."""
    cols = [c for c in columns if c in df.columns and len(df) and (df[c] < 0).any()]
    return df.assign(**{c: df[c].astype(object).where(df[c] >= 0, None) for c in cols}) if cols else df


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts (NaN -> None, problems -> their dicts)."""
    return [{str(k): _plain(v) for k, v in rec.items()} for rec in df.to_dict(orient="records")]


def _rank_of(recorded: int | None, path: Path, index: int, taken: set[int]) -> int:
    r = recorded if recorded is not None else _provisional_rank(path, index)
    while r in taken:
        r += 1
    return r


def _notes(tables: list[TraceTables], kernels: pd.DataFrame, steps: list[int]) -> list[str]:
    notes = []
    if not any(t.has_cpu_ops for t in tables):
        notes.append("no CPU ops in the trace: categories come from kernel names; FLOPs and problems unknown")
    elif not any(t.has_shapes for t in tables):
        notes.append("the trace has no recorded shapes (record_shapes=False): FLOPs and problems unknown")
    if kernels.empty:
        notes.append("no GPU events in the trace: problem times are the ops' CPU times; TFLOP/s, TB/s and % of "
                     "roofline are not shown (they need the device's kernel time)")
    if not steps:
        notes.append("no ProfilerStep markers: the whole trace is treated as one step")
    return notes


def _device_name(tables: list[TraceTables], manifest: dict[str, Any], cpu_only: bool) -> tuple[str, Inferred | None]:
    """The device: as the traces name it, else the run's manifest, else inferred from the
    kernel names (:mod:`.device_arch`, said so), else unknown; and the inference, if used."""
    name = next((t.device_name for t in tables if t.device_name), None)
    if name is not None:
        return name, None
    dev = manifest.get("device")
    name = str(dev.get("name", "") if isinstance(dev, dict) else dev or "")
    inferred = next((t.inferred_device for t in tables if t.inferred_device is not None), None)
    if name or inferred is None:
        return name or ("cpu" if cpu_only else "unknown"), None
    return inferred.name, inferred


def _totals(kernels: pd.DataFrame, calls: pd.DataFrame, temporal: pd.DataFrame, per_step: int,
            flops_known: bool) -> dict[str, Any]:
    k = in_steps(kernels)

    def seconds(mask: Any) -> float:
        return float(k.loc[mask, "dur_us"].sum()) / 1e6 / per_step

    def flops(kind: str, cats: tuple[str, ...]) -> float | None:
        # unknown (None), not zero, when no op could be modeled (no shapes, or ops without a
        # model) while kernels of the kind ran
        f = calls.loc[(calls["kind"] == kind) & calls["flops"].notna(), "flops"]
        if not flops_known or (f.empty and k["category"].isin(cats).any()):
            return None
        return int(f.sum()) / per_step

    busy = float(temporal["busy_s"].sum()) if len(temporal) else float(k["dur_us"].sum()) / 1e6
    return {
        **{f"{kind}_flops_per_step": flops(kind, part.categories) for kind, part in kinds.with_part("trace").items()},
        "convolution_flops_per_step": flops("convolution", (CONVOLUTION,)),
        "gpu_busy_s_per_step": busy / per_step,
        "gpu_kernel_s_per_step": seconds(slice(None)),
        "compute_kernel_s_per_step": seconds(k["category"].isin(COMPUTE)),
        "gemm_s_per_step": seconds(k["category"] == GEMM),
        "attention_s_per_step": seconds(k["category"].isin((ATTENTION_FWD, ATTENTION_BWD))),
        "step_time_s": float(temporal["span_s"].median()) if len(temporal) else None,
        "events": len(kernels),
    }


@dataclass
class _TraceResult:
    """What one trace contributes (computed in a worker process when ``jobs`` > 1)."""

    tables: TraceTables
    op_totals: pd.DataFrame
    rank: int | None
    fixes: Counter
    unread: Counter  # category -> duration events the loader did not read
    events: int
    collectives: pd.DataFrame  # one row per communication GPU event (``trace_collectives``)
    walls: pd.DataFrame  # host time per ProfilerStep (``host_steps``)
    host: H.HostTables | Future  # CPU ops, launches, critical path (``trace_host``; a future: made aside)
    distributed: dict[str, Any]  # the trace's distributedInfo
    extras: Extras  # launch resources, memory events (``trace_extras``)
    dropped: Counter  # reason -> events the loader dropped
    markers: Counter  # the workload's markers (``workload.trace_markers``)
    notes: list[str] = field(default_factory=list)  # what the reader should know of this file


def _analyze_file(path: Path, rank: int, unprofiled_s: float | None = None, workers: int = 1) -> list[_TraceResult]:
    """Load one trace file and analyze each rank it holds (one, unless several ranks were
    merged into it: :mod:`.ranks`). ``rank`` is provisional (:func:`analyze` assigns the
    final ranks once all traces are read), a merged file's ranks are its own;
    ``unprofiled_s``: the run's step time without the profiler, for the host replays;
    ``workers``: processes that decode a big file."""
    parts, note = split_ranks(L.load(path, workers=workers))
    out = []
    while parts:  # each rank's events are let go once its tables are made
        rt = parts.pop(0)
        out.append(_analyze_trace(rt, rt.rank if note else rank, unprofiled_s, workers))
        del rt
    if note:
        out[0].notes.append(note)
    return out


def _analyze_trace(rt: L.RawTrace, rank: int, unprofiled_s: float | None = None, workers: int = 1) -> _TraceResult:
    """Link and tabulate one rank's trace (see :func:`_analyze_file`)."""
    lk = link(rt)
    kernels = kernel_table(rt, lk, rank)
    comm = trace_collectives(rt, lk, kernels)
    # per-parameter GPU work (the optimizer's, data-parallel collectives): the same at any micro-batch
    per_param = lk.in_optimizer.astype(bool)
    if len(comm):
        rows = np.flatnonzero((kernels["category"] == COMMUNICATION).to_numpy())
        per_param[rows[(comm["role"] == PARAMETERS).to_numpy()]] = True
    aside = workers > 1 and HOST_ASIDE_EVENTS <= len(rt) <= HOST_ASIDE_MAX_EVENTS
    host: H.HostTables | Future | None = _host_aside(rt, lk, rank, unprofiled_s, per_param) if aside else None
    tables = trace_tables(rt, lk, rank, kernels)
    pool_variable_sizes(tables.kernels, comm)
    if host is None:
        host = H.trace_host(rt, lk, rank, unprofiled_s, per_param)
    return _TraceResult(tables, trace_op_times(rt, lk), rt.rank, rt.fixes, rt.unread, len(rt), comm,
                        host_steps(lk, rank), host, dict(rt.distributed), trace_extras(rt, lk, tables.kernels),
                        rt.dropped, trace_markers(rt, lk))


# a trace of at least this many kept events, analyzed in this process with a CPU to spare, has
# its host tables made in a forked process while this one makes the others and goes on; not
# above the maximum, where the two processes' memory counts (a 10 GB trace, 21.7 M kept events:
# the forked process keeps its own copy of the columns once this one lets them go, 5.2 GB summed
# over the two; waiting for it before letting them go, 3.8 GB and 89.5 s, against 3.4 GB and
# 91.3 s in one process)
HOST_ASIDE_EVENTS = 1_000_000
HOST_ASIDE_MAX_EVENTS = 8_000_000
_ASIDE: tuple = ()  # what the forked process reads (inherited, not pickled)


def _host_from_fork() -> H.HostTables:
    return H.trace_host(*_ASIDE)


def _host_aside(rt: L.RawTrace, lk: Linked, rank: int, unprofiled_s: float | None, per_param: np.ndarray) -> Future:
    """:func:`.host.trace_host` in a forked process: a future of its tables (see HOST_ASIDE_EVENTS)."""
    global _ASIDE
    _ASIDE = (rt, lk, rank, unprofiled_s, per_param)
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
    try:
        future = pool.submit(_host_from_fork)  # forks now: the child sees _ASIDE
    finally:
        _ASIDE = ()
        pool.shutdown(wait=False)
    return future


def _host(r: _TraceResult) -> H.HostTables:
    """A trace's host tables, waiting for the forked process that makes them."""
    if isinstance(r.host, Future):
        try:
            r.host = r.host.result()
        except BrokenProcessPool as exc:  # killed (out of memory?): said in one line
            raise TraceError(f"the process making the host tables ended abnormally ({exc}); analyze with "
                             "less other work on the machine") from None
    return r.host


def _unprofiled_step(manifest: dict[str, Any]) -> float | None:
    """The run's median step time without the profiler, when its manifest measured it."""
    overhead = manifest.get("overhead") if isinstance(manifest, dict) else None
    v = overhead.get("unprofiled_median_s") if isinstance(overhead, dict) else None
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def _provisional_rank(path: Path, index: int) -> int:
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else index


def _traces(paths: list[Path], jobs: int, progress: Callable[[str], None] | None,
            unprofiled_s: float | None = None) -> list[list[_TraceResult]]:
    """Each trace file's results (one per rank it holds), in the order of ``paths``: in this
    process (``jobs`` 1) or in ``jobs`` worker processes (the same results: each trace is
    analyzed alone)."""
    log = progress or (lambda _msg: None)
    if jobs <= 1 or len(paths) <= 1:
        out = []
        for i, p in enumerate(paths):
            log(f"analyzing {p}")
            out.append(_analyze_file(p, _provisional_rank(p, i), unprofiled_s, idle_cpus()))
        return out
    gc.freeze()  # forked workers then leave this process's objects (pages) shared instead of copying them
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_analyze_file, p, _provisional_rank(p, i), unprofiled_s)
                       for i, p in enumerate(paths)]
            out = []
            for p, f in zip(paths, futures, strict=True):
                out.append(f.result())
                log(f"analyzed {p}")
            return out
    finally:
        gc.unfreeze()


def idle_cpus() -> int:
    """CPUs no other work is using now, at least 1: the processes that decode one big trace
    (more than that only compete for a CPU)."""
    try:
        with open("/proc/loadavg") as f:
            text: str | None = f.read()
    except OSError:
        text = None
    return max(1, (os.cpu_count() or 1) - int(busy_cpus(os.getloadavg()[0], text) + 0.5))


def busy_cpus(load_1min: float, proc_loadavg: str | None) -> float:
    """CPUs other work uses: the lesser of the 1-minute load average and the tasks running
    now besides this one (Linux's ``/proc/loadavg``, its fourth field ``running/total``), so
    that work which has just ended does not count for a minute."""
    try:
        running = int(str(proc_loadavg).split()[3].split("/")[0]) - 1
    except (ValueError, IndexError):
        return load_1min
    return min(load_1min, max(0, running))


def default_jobs(n_traces: int) -> int:
    """Worker processes for ``n_traces`` traces: one per trace, at most one per CPU."""
    return max(1, min(n_traces, os.cpu_count() or 1))


def _outside_note(kernels: pd.DataFrame, has_steps: bool) -> tuple[float, list[str]]:
    """Seconds of GPU work outside the profiled steps, and its note."""
    out = kernels[kernels["step"] < 0]
    if not has_steps or out.empty:
        return 0.0, []
    secs = float(out["dur_us"].sum()) / 1e6
    return secs, [f"outside steps: {len(out):,} GPU events ({secs * 1e3:,.3f} ms) without a launch inside the "
                  "profiled steps (queued before profiling started, or launched outside the steps) are left out "
                  "of the per-step figures"]


def analyze(paths: Sequence[str | Path] | str | Path, *, progress: Callable[[str], None] | None = None,
            jobs: int | None = None) -> Analysis:
    """Analyze one or more traces (files or run folders); see the module docstring. The
    traces of many ranks are analyzed in ``jobs`` processes (default: one per trace, at
    most one per CPU); the result does not depend on ``jobs``."""
    inputs = discover(paths)
    n_jobs = default_jobs(len(inputs.traces)) if jobs is None else max(1, int(jobs))
    per_file = _traces(inputs.traces, n_jobs, progress, _unprofiled_step(inputs.manifest))
    pairs = [(path, res) for path, results in zip(inputs.traces, per_file, strict=True) for res in results]
    results = [res for _, res in pairs]
    tables: list[TraceTables] = []
    op_totals: list[pd.DataFrame] = []
    ranks: list[int] = []
    fixes: Counter = Counter()
    unread: Counter = Counter()
    dropped: Counter = Counter()
    for i, (path, res) in enumerate(pairs):
        rank = _rank_of(res.rank, path, i, set(ranks))
        ranks.append(rank)
        res.tables.kernels["rank"] = np.int64(rank)
        res.tables.calls["rank"] = np.int64(rank)
        for frame in (res.collectives, res.walls):
            if "rank" in frame:
                frame["rank"] = np.int64(rank)
        for frame in (res.extras.kernels, res.extras.memory, res.extras.ops):
            frame["rank"] = np.int64(rank)
        tables.append(res.tables)
        op_totals.append(res.op_totals)
        fixes.update(res.fixes)
        unread.update(res.unread)
        dropped.update(res.dropped)
    if not any(t.has_cpu_ops or len(t.kernels) for t in tables):
        raise TraceError(f"nothing to analyze: no operators or GPU events in {', '.join(map(str, inputs.traces))}")
    kernels = pd.concat([t.kernels for t in tables], ignore_index=True)
    for c in _CATEGORICAL:
        kernels[c] = kernels[c].astype("category")
    # ranks without GPU events beside ranks with them (a CPU-only trace among GPU traces): their
    # CPU times are not GPU times, so they are left out of the per-step figures
    cpu_ranks = [r for r, t in zip(ranks, tables, strict=True) if not len(t.kernels)] if len(kernels) else []
    measured = [r for r in ranks if r not in cpu_ranks]
    calls = pd.concat([t.calls for t, r in zip(tables, ranks, strict=True) if r not in cpu_ranks], ignore_index=True)
    steps = sorted({s for t in tables for s in t.steps})
    outside_s, outside_notes = _outside_note(kernels, bool(steps))
    load, load_notes = expert_load(inputs.manifest)
    notes = [*inputs.notes, *(n for r in results for n in r.notes), *L.dropped_notes(dropped), *L.fix_notes(fixes),
             *L.unread_notes(unread), *outside_notes, *_notes(tables, kernels, steps), *load_notes]
    comm_events = pd.concat([r.collectives for r in results], ignore_index=True)
    if not steps:
        kernels["step"] = 0
        calls["step"] = 0
    device_name, inferred = _device_name(tables, inputs.manifest, kernels.empty)
    if inferred is not None:
        notes.append(inferred.note)
    peaks = lookup_peaks(device_name)
    per_step = max(1, len(steps)) * max(1, len(measured))
    if cpu_ranks:
        notes.append(f"rank(s) {', '.join(map(str, cpu_ranks))}: no GPU events (a CPU-only trace beside GPU traces); "
                     f"left out of the per-step figures, which are over rank(s) {', '.join(map(str, measured))}")
    device_time = not kernels.empty  # roofline figures only from kernel time
    temporal = B.temporal(kernels)
    flops_known = any(t.has_cpu_ops and t.has_shapes for t in tables)
    totals = _totals(kernels, calls, temporal, per_step, flops_known)
    totals["outside_steps_gpu_s"] = outside_s
    ops = op_times(op_totals, per_step)
    a = Analysis(
        traces=[str(f) for f in inputs.traces],
        device={"name": device_name, "peaks": peaks.key if peaks else None, "vendor": peaks.vendor if peaks else None,
                **({"inferred_from": f"kernel names ({inferred.arch})"} if inferred is not None else {})},
        ranks=sorted(ranks),
        steps=steps,
        kernels=kernels,
        hotspots=hotspots(kernels, calls, peaks, per_step),
        problems_by_kind={kind: problem_table(calls, kind, peaks, per_step, device_time) for kind in kinds.names()},
        breakdown=B.categories(kernels),
        temporal=temporal,
        op_times=ops,
        rank_summary=rank_summary(temporal),
        collectives=collective_skew(kernels),
        totals=totals,
        manifest=inputs.manifest,
        notes=notes,
        collective_events=comm_events,
        collective_bandwidth=bandwidth(comm_events, max(1, len(steps))),
        collective_ranks=rank_bandwidth(comm_events, max(1, len(steps))),
        wall_steps=pd.concat([r.walls for r in results], ignore_index=True),
        world_size=world_size([r.distributed for r in results], len(ranks)),
        expert_load=load,
        cpu_ranks=cpu_ranks,
        chains=fusion_chains(kernels, calls),
        launch_resources=pd.concat([r.extras.kernels for r in results], ignore_index=True).astype(
            dict.fromkeys(("name", "category", "grid", "block"), "category")),
        memory_events=pd.concat([r.extras.memory for r in results], ignore_index=True),
        memory_ops=pd.concat([r.extras.ops for r in results], ignore_index=True),
        calls=calls,
        measured=inputs.measured,
    )
    hosts = [_host(r) for r in results]  # last: a big trace's were made aside meanwhile
    for h, rank in zip(hosts, ranks, strict=True):
        for frame in (h.launches, h.critical_path, h.syncs, h.replay):
            if "rank" in frame:
                frame["rank"] = np.int64(rank)
    a.cpu_ops = H.cpu_vs_gpu([h.cpu_ops for h in hosts], ops, per_step)
    a.launches = pd.concat([h.launches for h in hosts], ignore_index=True)
    a.launch_delays = H.delay_histogram([h.delay_counts for h in hosts])
    a.critical_path = pd.concat([h.critical_path for h in hosts], ignore_index=True)
    a.syncs = _concat([h.syncs for h in hosts], H.SYNC_COLUMNS)
    a.host_replay = _concat([h.replay for h in hosts], H.REPLAY_COLUMNS)
    markers: Counter = Counter()
    for r in results:
        for key, v in r.markers.items():  # counts add up; a marker's example name is the first one
            if isinstance(v, str):
                markers.setdefault(key, v)
            else:
                markers[key] += v
    a.workload = workload(markers, inputs.manifest, kernels, comm_events,
                          len(calls[calls["kind"] == kinds.GROUPED.name]), a.world_size, per_step)
    a.recommendations = recommend(a)
    return a
