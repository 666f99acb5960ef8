"""Vendor tables against values from cublasLt.h (CUDA 12.4-13.0) and hipblaslt.h (ROCm 6.x)."""

from __future__ import annotations

import ctypes

from primus_perf.kernels.blaslt.tables import CUBLASLT, HIPBLASLT


def test_cublaslt_constants_match_header() -> None:
    assert CUBLASLT.algo_size == 64 and CUBLASLT.heuristic_size == 96
    assert CUBLASLT.op == {"N": 0, "T": 1}
    assert CUBLASLT.data_type["bf16"] == 14 and CUBLASLT.data_type["f16"] == 2
    assert CUBLASLT.data_type["f32"] == 0
    assert CUBLASLT.compute_type == {"f16": 64, "f32": 68, "f64": 70, "tf32": 77}
    assert CUBLASLT.desc_attr["TRANSA"] == 3 and CUBLASLT.desc_attr["EPILOGUE"] == 7
    assert CUBLASLT.layout_attr["LD"] == 4 and CUBLASLT.layout_attr["STRIDED_BATCH_OFFSET"] == 6
    assert CUBLASLT.pref_attr["MAX_WORKSPACE_BYTES"] == 1
    assert CUBLASLT.algo_config_attr["CLUSTER_SHAPE_ID"] == 8


def test_hipblaslt_constants_match_header() -> None:
    assert HIPBLASLT.algo_size == 24 and HIPBLASLT.heuristic_size == 56
    assert HIPBLASLT.op == {"N": 111, "T": 112}
    assert HIPBLASLT.compute_type["f32"] == 2
    assert HIPBLASLT.desc_attr["TRANSA"] == 0 and HIPBLASLT.desc_attr["TRANSB"] == 1
    assert HIPBLASLT.layout_attr["TYPE"] == 2 and HIPBLASLT.layout_attr["LD"] == 6


class _CuHeur(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class _HipAlgo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint8 * 16), ("max_workspace_bytes", ctypes.c_size_t)]


class _HipHeur(ctypes.Structure):
    _fields_ = [("algo", _HipAlgo), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def test_struct_layouts_match_c_structs() -> None:
    for table, struct in ((CUBLASLT, _CuHeur), (HIPBLASLT, _HipHeur)):
        assert ctypes.sizeof(struct) == table.heuristic_size
        assert struct.workspaceSize.offset == table.heuristic_offsets["workspace"]
        assert struct.state.offset == table.heuristic_offsets["state"]
        assert struct.wavesCount.offset == table.heuristic_offsets["waves"]


def test_heuristic_pool_and_solution_index_are_per_vendor_data() -> None:
    from primus_perf.tuner.gemm.plugin import solution_index

    assert CUBLASLT.source == "cublaslt" and CUBLASLT.solution_index_offset is None
    assert HIPBLASLT.source == "hipblaslt" and HIPBLASLT.heuristic_count >= 1024
    # hipBLASLt keeps the solution index as the algo's first int32
    algo = (123456).to_bytes(4, "little") + bytes(HIPBLASLT.algo_size - 4)
    assert solution_index(algo, HIPBLASLT.solution_index_offset) == 123456
    assert solution_index((-1).to_bytes(4, "little", signed=True) + bytes(20), 0) == -1


class _FakeLib:
    """Stands in for the shared library (no GPU here): every symbol returns a status and
    records its name; ``fail`` names a symbol that fails on its ``fail_at``-th call."""

    def __init__(self, prefix: str, fail: str = "", fail_at: int = 1, version: int = 0) -> None:
        self.prefix, self.fail, self.fail_at, self.version = prefix, fail, fail_at, version
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        def fn(*args):
            self.calls.append(name)
            if name.endswith("GetVersion"):
                if args:  # hipBLASLt: (handle, int*)
                    args[1]._obj.value = self.version
                    return 0
                return self.version
            if name == self.fail and self.calls.count(name) == self.fail_at:
                return 7
            return 0

        return fn


def test_binding_names_the_failing_call_and_destroys_what_it_made() -> None:
    import pytest

    from primus_perf.kernels.blaslt.binding import BlasLt, BlasLtError
    from primus_perf.problems import GemmProblem

    lib = _FakeLib("cublasLt", fail="cublasLtMatrixLayoutCreate", fail_at=3)
    lt = BlasLt(CUBLASLT, lib, "fake")  # type: ignore[arg-type]
    with pytest.raises(BlasLtError, match="cublasLtMatrixLayoutCreate failed with status 7"):
        lt.plan(GemmProblem.from_row_major(64, 32, 16))
    assert lib.calls.count("cublasLtMatrixLayoutDestroy") == 2 and lib.calls[-1] == "cublasLtMatmulDescDestroy"
    ok = BlasLt(CUBLASLT, _FakeLib("cublasLt"), "fake")  # type: ignore[arg-type]
    with ok.plan(GemmProblem.from_row_major(64, 32, 16)) as plan:
        assert not plan.closed
    assert plan.closed and ok.lib.calls.count("cublasLtMatrixLayoutDestroy") == 4


def test_version_query_follows_the_vendor_table() -> None:
    from primus_perf.kernels.blaslt.binding import BlasLt

    assert BlasLt(CUBLASLT, _FakeLib("cublasLt", version=130100), "x").version() == "13.1.0"  # type: ignore[arg-type]
    hip = BlasLt(HIPBLASLT, _FakeLib("hipblasLt", version=1200), "x")  # type: ignore[arg-type]
    assert hip.version() == "1200" and hip.library_name() == "hipblasLt"
