"""Collectives: kinds, NCCL's bus-bandwidth factors, and message and group sizes read from the
recorded shapes checked against what NCCL itself wrote into the committed 2-rank traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from primus_perf.tracelens.analyses import collectives as C
from primus_perf.tracelens.analyze import analyze

TRACES = Path(__file__).parents[1] / "data" / "traces"
EXTERNAL = Path(__file__).resolve().parents[3] / "shared" / "traces" / "external"
NCCL_DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Byte": 1, "Char": 1}


@pytest.mark.parametrize(("kind", "n", "factor"), [
    ("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_reduce", 1, 0.0),
    ("all_gather", 2, 0.5), ("all_gather", 8, 0.875),
    ("reduce_scatter", 4, 0.75), ("all_to_all", 16, 15 / 16),
    ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("send_recv", 2, 1.0),
])
def test_bus_factors_are_nccls(kind: str, n: int, factor: float) -> None:
    assert C.bus_factor(kind, n) == pytest.approx(factor)


def test_bus_factor_unknown_group_or_collective_is_nan() -> None:
    assert np.isnan(C.bus_factor("all_reduce", -1)) and np.isnan(C.bus_factor("barrier", 8))


@pytest.mark.parametrize(("name", "kind"), [
    ("nccl:all_reduce", "all_reduce"), ("c10d::allreduce_", "all_reduce"),
    ("symm_mem::multimem_all_reduce_", "all_reduce"), ("cross_device_reduce_1stage<bf16, 8>", "all_reduce"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
    ("nccl:_all_gather_base", "all_gather"), ("ncclDevKernel_AllGather_RING_LL", "all_gather"),
    ("nccl:_reduce_scatter_base", "reduce_scatter"), ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reduce_scatter"),
    ("nccl:all_to_all", "all_to_all"), ("c10d::alltoall_base_", "all_to_all"),
    ("nccl:broadcast", "broadcast"), ("ncclKernel_Broadcast_RING_LL_Sum_int8_t", "broadcast"),
    ("nccl:reduce", "reduce"), ("ncclDevKernel_Reduce_Sum_f32_RING_LL", "reduce"),
    ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "send_recv"), ("nccl:recv 0<-1", "send_recv"),
    ("aten::add", None),
])
def test_collective_kinds(name: str, kind: str | None) -> None:
    assert C.collective_kind(name) == kind


def test_element_sizes() -> None:
    assert [C.element_bytes(t) for t in ("float", "c10::BFloat16", "c10::Half", "long int", "signed char",
                                         "c10::Float8_e4m3fn", "TensorList")] == [4, 2, 2, 8, 1, 1, None]


def test_default_group_size() -> None:
    pg = [{"pg_size": 8}, {"pg_size": 1}, {"pg_size": 8}]
    assert C.default_group_size({"pg_config": pg, "world_size": 8}) == 8
    assert C.default_group_size({"pg_config": [{"pg_size": 2}, {"pg_size": 4}], "world_size": 8}) == 8
    assert C.default_group_size({}) == -1


def _nccl_kernel_args(path: Path) -> list[dict]:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    return [e for e in events if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel")]


@pytest.mark.parametrize("run", ["h200_tp2", "h200_dp2"])
def test_message_and_group_sizes_match_what_nccl_recorded(run: str) -> None:
    """The sizes read from the ops' recorded shapes equal NCCL's own per-kernel record
    (``Out msg nelems``/``In msg nelems`` x dtype, ``Group size``), kernel by kernel."""
    a = analyze([TRACES / run])
    ev = a.collective_events.sort_values(["rank", "ts_us"], ignore_index=True)
    raw = []
    for rank in (0, 1):
        ks = sorted(_nccl_kernel_args(TRACES / run / f"trace_rank{rank}.json.gz"), key=lambda e: e["ts"])
        raw += [(rank, e["args"]) for e in ks]
    assert len(raw) == len(ev) > 0
    for (rank, args), r in zip(raw, ev.itertuples(index=False), strict=True):
        want = max(args["In msg nelems"], args["Out msg nelems"]) * NCCL_DTYPE_BYTES[args["dtype"]]
        assert (r.rank, r.bytes, r.group_size) == (rank, want, args["Group size"]), args
        assert r.collective == {"allreduce": "all_reduce", "all_gather": "all_gather"}[args["Collective name"]]


def test_bandwidth_table_of_a_2_rank_run() -> None:
    a = analyze([TRACES / "h200_tp2"])
    bw = a.collective_bandwidth
    ag = bw[bw["collective"] == "all_gather"].iloc[0]
    assert ag["bytes"] == 131334144 * 2 and ag["group_size"] == 2 and ag["ranks"] == 2
    # per rank: bytes x calls / kernel time; the bus factor of a 2-rank all-gather is 1/2
    ev = a.collective_events
    per_rank = [ag["bytes"] * len(g) / (g["dur_us"].sum() * 1e-6) / 1e9
                for _, g in ev[(ev["collective"] == "all_gather") & (ev["step"] >= 0)].groupby("rank")]
    assert ag["algbw_gbs"] == pytest.approx(np.median(per_rank))
    assert ag["busbw_gbs"] == pytest.approx(ag["algbw_gbs"] / 2)
    assert ag["min_busbw_gbs"] == pytest.approx(min(per_rank) / 2)
    assert ag["max_skew_us"] >= ag["mean_skew_us"] > 0 and ag["last_rank"] in (0, 1)
    ar = bw[bw["collective"] == "all_reduce"]
    assert np.allclose(ar["busbw_gbs"], ar["algbw_gbs"])  # 2(n-1)/n = 1 for n = 2
    # calls per step per rank add up to the communication kernels of a step
    n_comm = len(ev[ev["step"] >= 0]) / (len(a.ranks) * len(a.steps))
    assert bw["calls"].sum() == pytest.approx(n_comm)
    assert a.world_size == 2


def test_corpus_collectives_without_shapes_have_unknown_bandwidth() -> None:
    path = EXTERNAL / "hta" / "nccl_parser_config" / "nccl_data.json.gz"
    if not path.exists():
        pytest.skip(f"external trace corpus not found at {EXTERNAL}")
    a = analyze([path])
    bw = a.collective_bandwidth
    assert set(bw["collective"]) == {"all_reduce", "broadcast"}
    assert (bw["bytes"] == -1).all() and bw["busbw_gbs"].isna().all()  # no shapes: unknown, never 0
    assert (bw["group_size"] == 2).all()  # from distributedInfo


def test_corpus_reduce_scatter_and_all_gather_groups_from_c10d_shapes() -> None:
    """A 16-rank job whose all-gathers and reduce-scatters run in groups of 8: the group comes
    from the c10d op's output/input ratio, the message from the larger of the two."""
    path = EXTERNAL / "hta" / "negative_queue_length_values_check" / "rank0.json.gz"
    if not path.exists():
        pytest.skip(f"external trace corpus not found at {EXTERNAL}")
    a = analyze([path])
    bw = a.collective_bandwidth.set_index(["collective", "bytes"])
    assert a.world_size == 16
    # c10d::_reduce_scatter_base_ [8192, 384] <- [65536, 384] f32; _allgather_base_ [65536, 64] <- [8192, 64]
    assert bw.loc[("reduce_scatter", 65536 * 384 * 4), "group_size"] == 8
    assert bw.loc[("all_gather", 65536 * 64 * 4), "group_size"] == 8
    assert set(bw.loc["all_to_all", "group_size"]) == {16}


def test_corpus_all_to_alls_with_split_sizes_are_one_row() -> None:
    """The same job's all-to-alls whose input and output sizes differ (split sizes, not
    recorded by this older profiler) are all-to-allv: one row over their many sizes, with
    the input and output of each call, instead of a row per size."""
    path = EXTERNAL / "hta" / "negative_queue_length_values_check" / "rank0.json.gz"
    if not path.exists():
        pytest.skip(f"external trace corpus not found at {EXTERNAL}")
    a = analyze([path])
    ev = a.collective_events
    v = ev[(ev["collective"] == "all_to_allv") & (ev["step"] >= 0)]
    assert len(v) and (v["in_bytes"] != v["out_bytes"]).all() and (v["bytes"] == v[["in_bytes", "out_bytes"]].max(axis=1)).all()
    # c10d::alltoall_base_ [2883584] <- [3145728] f32: sends the input, receives the output
    assert ((v["in_bytes"] == 3145728 * 4) & (v["out_bytes"] == 2883584 * 4)).any()
    bw = a.collective_bandwidth
    row = bw[bw["collective"] == "all_to_allv"]
    assert len(row) == 1 and row["sizes"].iloc[0] == v["bytes"].nunique() > 5
    assert row["calls"].iloc[0] == pytest.approx(len(v) / len(a.steps))
    assert row["algbw_gbs"].iloc[0] == pytest.approx(v["bytes"].sum() / (v["dur_us"].sum() * 1e-6) / 1e9)
    equal = ev[ev["collective"] == "all_to_all"]
    assert (equal["in_bytes"] == equal["out_bytes"]).all()
