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
