"""A two-rank expert-parallel run folder written event by event: what ``primus-profile run``
of an MoE model with ``parallel.ep=2`` on two GPUs leaves (a Kineto trace per rank with NCCL
all-to-alls, and a manifest with the tokens per expert of every step).

The events follow what torch 2.11 and NCCL 2.28 write for ``all_to_all_single``: the
dispatcher op ``c10d::alltoall_base_`` (inputs: output, input, process group, output and
input split sizes, async, timeout), under it ``record_param_comms`` (the NCCL metadata) and
the ``nccl:all_to_all`` annotation around the launch (``cuLaunchKernelEx``) of
``ncclDevKernel_SendRecv``, whose kernel event carries the same metadata. Each step: the
token-count exchange (an equal-split all-to-all of 8 int64), then the forward dispatch and
combine (bf16 rows of width ``DIM``, split sizes that change every step and rank) and the
two backward ones on the autograd thread, beside one expert GEMM.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DIM = 128  # hidden size: a row of the dispatch is DIM bf16 values
ROW_BYTES = DIM * 2
EXPERTS = 8
KERNEL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
# rows each rank sends to rank 0 and rank 1, per step (its tokens x top-k: 64 every step)
SENDS = {1: {0: [40, 24], 1: [30, 34]}, 2: {0: [36, 28], 1: [26, 38]}}
STEP_US = 10_000.0


@dataclass(frozen=True)
class Call:
    """One all-to-all as a rank saw it: rows in and out, split sizes, kernel time."""

    step: int
    in_rows: int
    out_rows: int
    in_splits: list[int] | None  # None: equal split (no split sizes given)
    out_splits: list[int] | None
    dur_us: float
    dtype: str = "c10::BFloat16"
    width: int = DIM

    @property
    def elem(self) -> int:
        return 8 if self.dtype == "long int" else 2

    @property
    def in_bytes(self) -> int:
        return self.in_rows * self.width * self.elem

    @property
    def out_bytes(self) -> int:
        return self.out_rows * self.width * self.elem


def calls(rank: int) -> list[Call]:
    """Every all-to-all of one rank, in order: per step the count exchange, dispatch and
    combine, and their two backward all-to-alls."""
    out = []
    for step, sends in SENDS.items():
        send = sends[rank]
        recv = [sends[src][rank] for src in (0, 1)]
        s, r = sum(send), sum(recv)
        # a rank that receives more rows waits longer: time grows with the larger buffer
        dur = [20.0 + 0.25 * max(s, r) + 3 * rank + step, 18.0 + 0.25 * max(s, r) + step]
        out.append(Call(step, EXPERTS, EXPERTS, None, None, 9.0 + rank, "long int", 1))
        out.append(Call(step, s, r, send, recv, dur[0]))  # dispatch
        out.append(Call(step, r, s, recv, send, dur[1]))  # combine
        out.append(Call(step, s, r, send, recv, dur[1] + 2))  # combine's backward
        out.append(Call(step, r, s, recv, send, dur[0] + 2))  # dispatch's backward
    return out


def _split_text(splits: list[int] | None) -> str:
    return "[]" if splits is None else "[" + ", ".join(map(str, splits)) + "]"


def _nccl_args(c: Call, rank: int) -> dict[str, Any]:
    return {"Collective name": "all_to_all" if c.in_splits is None else "all_to_allv",
            "In msg nelems": c.in_rows * c.width, "Out msg nelems": c.out_rows * c.width, "Group size": 2,
            "dtype": "Long" if c.dtype == "long int" else "BFloat16", "In split size": _split_text(c.in_splits),
            "Out split size": _split_text(c.out_splits), "Process Group Name": "1",
            "Process Group Description": "undefined", "Process Group Ranks": "[0, 1]"}


def _dims(c: Call, rows: int) -> list[int]:
    return [rows] if c.width == 1 else [rows, c.width]


class _Trace:
    def __init__(self, rank: int) -> None:
        self.rank, self.events, self.next_id = rank, [], 1
        self.pid = 700 + rank

    def op(self, name: str, ts: float, dur: float, tid: int, cat: str = "cpu_op", **args: Any) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": tid, "ts": ts, "dur": dur,
                            "args": {"External id": self.next_id, "Record function id": 0, **args}})
        self.next_id += 1

    def launch(self, ts: float, gpu_ts: float, kernel: str, dur: float, stream: int, tid: int, **kargs: Any) -> None:
        corr = 5000 + self.next_id
        self.op("cuLaunchKernelEx", ts, 8.0, tid, cat="cuda_driver", correlation=corr, cbid=652)
        self.events += [
            {"ph": "s", "id": corr, "pid": self.pid, "tid": tid, "ts": ts, "cat": "ac2g", "name": "ac2g"},
            {"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": stream, "ts": gpu_ts, "dur": dur,
             "args": {"External id": self.next_id, "queued": 0, "device": 0, "context": 1, "stream": stream,
                      "correlation": corr, "grid": [24, 1, 1], "block": [544, 1, 1], **kargs}},
            {"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": gpu_ts, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        ]

    def all_to_all(self, c: Call, ts: float, gpu_ts: float, tid: int) -> None:
        out_dims, in_dims = _dims(c, c.out_rows), _dims(c, c.in_rows)
        strides = [[c.width, 1] if c.width > 1 else [1]] * 2
        self.op("c10d::alltoall_base_", ts, 60.0, tid,
                **{"Concrete Inputs": ["", "", "", _split_text(c.out_splits), _split_text(c.in_splits), "False", "-1"],
                   "Input type": [c.dtype, c.dtype, "", "ScalarList", "ScalarList", "Scalar", "Scalar"],
                   "Input Strides": [*strides, [], [], [], [], []], "Input Dims": [out_dims, in_dims, [], [], [], [], []]})
        self.op("record_param_comms", ts + 5, 50.0, tid, Rank=self.rank, **{
            "Global rank start": 0, "Global rank stride": 1, **_nccl_args(c, self.rank),
            "Concrete Inputs": ["", "", "", str(self.rank), "", _split_text(c.in_splits), _split_text(c.out_splits),
                                "0", "1", "2"],
            "Input type": [c.dtype, "", "", "Scalar", "", "ScalarList", "ScalarList", "Scalar", "Scalar", "Scalar"],
            "Input Dims": [in_dims, [], [], [], [], [], [], [], [], []]})
        self.op("nccl:all_to_all", ts + 10, 40.0, tid, cat="user_annotation",
                **{"Concrete Inputs": [""], "Input type": [c.dtype], "Input Dims": [in_dims]})
        self.launch(ts + 20, gpu_ts, KERNEL, c.dur_us, 13, tid, **_nccl_args(c, self.rank))
        self.events.append({"ph": "X", "cat": "gpu_user_annotation", "name": "nccl:all_to_all", "pid": 0, "tid": 13,
                            "ts": gpu_ts, "dur": c.dur_us, "args": {"External id": self.next_id}})

    def gemm(self, rows: int, ts: float, gpu_ts: float, tid: int) -> None:
        self.op("aten::mm", ts, 30.0, tid, **{"Input type": ["c10::BFloat16", "c10::BFloat16"],
                                             "Input Dims": [[rows, DIM], [DIM, 256]],
                                             "Input Strides": [[DIM, 1], [1, DIM]], "Concrete Inputs": ["", ""]})
        self.launch(ts + 5, gpu_ts, GEMM, 12.0, 7, tid)


def write_trace(path: Path, rank: int) -> Path:
    t = _Trace(rank)
    main, backward = t.pid, t.pid + 1
    per_step: dict[int, list[Call]] = {}
    for c in calls(rank):
        per_step.setdefault(c.step, []).append(c)
    for step, cs in per_step.items():
        t0 = 1_000_000.0 + rank * 3.0 + step * STEP_US
        t.op(f"ProfilerStep#{step}", t0, STEP_US - 100, main, cat="user_annotation")
        host = t0 + 100
        for i, c in enumerate(cs):
            tid = main if i < 3 else backward
            t.all_to_all(c, host, host + 40, tid)  # the kernel starts 20 us after its launch
            if i == 2:  # the expert GEMM between forward and backward
                t.gemm(c.out_rows, host + 100, max(host + 110, host + 45 + c.dur_us), main)
            host += 400
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "numSms": 132}],
           "record_shapes": 1, "distributedInfo": {
               "backend": "nccl", "rank": rank, "world_size": 2, "pg_count": 2, "nccl_version": "2.28.9",
               "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": 2,
                              "ranks": [0, 1]},
                             {"pg_name": "1", "pg_desc": "undefined", "backend_config": "cuda:nccl", "pg_size": 2,
                              "ranks": [0, 1]}]},
           "traceEvents": t.events}
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


# tokens per expert of the two MoE layers (model layers 1 and 2) in the profiled steps; layer
# 2's expert 5 gets no token
TOKENS = {1: [[20, 12, 16, 16, 10, 18, 22, 14], [30, 18, 16, 28, 0, 0, 20, 16]],
          2: [[18, 14, 16, 16, 12, 16, 24, 12], [26, 22, 18, 26, 0, 0, 24, 12]]}


def manifest(steps: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A run manifest: baseline, warm-up, the two profiled steps (with tokens per expert) and after."""
    if steps is None:
        steps = [{"index": 0, "phase": "baseline", "time_s": 0.012, "tokens_per_expert": TOKENS[1]},
                 {"index": 1, "phase": "warmup", "time_s": 0.013, "tokens_per_expert": TOKENS[2]},
                 *({"index": 1 + s, "phase": "active", "time_s": 0.012, "loss": 5.0,
                    "tokens_per_expert": TOKENS[s]} for s in (1, 2)),
                 {"index": 4, "phase": "after", "time_s": 0.012, "tokens_per_expert": TOKENS[1]}]
    return {"schema": "primus-perf-run/1", "world_size": 2, "traced_ranks": [0, 1],
            "traces": {"0": "rank0.pt.trace.json.gz", "1": "rank1.pt.trace.json.gz"},
            "config": {"model": {"name": "tiny-moe", "moe": {"n_experts": EXPERTS, "top_k": 2, "first_k_dense": 1}}},
            "device": {"name": "NVIDIA H200"}, "steps": steps}


def write_run(folder: Path, steps: list[dict[str, Any]] | None = None) -> Path:
    """The run folder: both ranks' traces and the manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    for rank in (0, 1):
        write_trace(folder / f"rank{rank}.pt.trace.json.gz", rank)
    (folder / "manifest.json").write_text(json.dumps(manifest(steps), indent=1))
    return folder
