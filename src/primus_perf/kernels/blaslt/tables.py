"""Vendor constants and struct layouts for cuBLASLt and hipBLASLt, as data.

Values are from the official headers:
- cuBLASLt: ``cublasLt.h`` / ``library_types.h`` / ``cublas_api.h`` of CUDA 12.4-13.0
  (enum values unchanged across those releases).
- hipBLASLt: ``hipblaslt/hipblaslt.h`` and ``hipblaslt-types.h`` of ROCm 6.x
  (hipBLASLt 0.6+; older 0.3 headers used other layout-attribute numbers), ``hipblas``
  ``hipblasOperation_t`` and ``hipblasComputeType_t``, HIP ``hipDataType``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VendorTable:
    vendor: str
    lib_names: tuple[str, ...]
    prefix: str  # symbol prefix: "cublasLt" or "hipblasLt"
    algo_size: int  # sizeof(*MatmulAlgo_t)
    heuristic_size: int  # sizeof(*MatmulHeuristicResult_t)
    # heuristic result field offsets: workspaceSize (size_t), state (status), wavesCount (float)
    heuristic_offsets: dict[str, int]
    op: dict[str, int]  # "N", "T"
    data_type: dict[str, int]  # our dtype names -> cudaDataType_t / hipDataType
    compute_type: dict[str, int]  # "f32", "tf32", "f16", "f64"
    desc_attr: dict[str, int]
    layout_attr: dict[str, int]
    pref_attr: dict[str, int]
    algo_config_attr: dict[str, int]  # empty where the vendor has no algo config API
    source: str = ""  # the name cache entries give solutions of this library
    # how many heuristic results to ask for: cuBLASLt returns at most ~8 useful ones for
    # our shapes; hipBLASLt returns every supported solution when asked for enough
    heuristic_count: int = 16
    # byte offset of the int32 solution index inside the algo struct (hipBLASLt), or None
    solution_index_offset: int | None = None
    success: int = 0
    # the version query: ``<prefix><version_symbol>``. With ``version_takes_handle`` the
    # call is ``f(handle, int*)`` returning a status; otherwise ``f()`` returns the encoded
    # version (size_t). ``version_digits`` (major, minor divisors) turns the encoded number
    # into "major.minor.patch"; None keeps the number as the library reports it.
    version_symbol: str = "GetVersion"
    version_takes_handle: bool = False
    version_digits: tuple[int, int] | None = None
    # ctypes width of each algo config attribute (AlgoConfigSetAttribute takes exactly it)
    algo_config_ctype: dict[str, type] = field(default_factory=dict)
    # the pointer alignment (bytes) the heuristic's algorithms may assume: the binding sets
    # it as the MIN_ALIGNMENT_{A,B,C,D}_BYTES preferences where ``pref_attr`` has them, and a
    # kernel runs torch's GEMM for a call whose pointers are less aligned (blaslt.layout)
    pointer_alignment: int = 256


CUBLASLT = VendorTable(
    vendor="nvidia",
    lib_names=("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"),
    prefix="cublasLt",
    algo_size=64,  # typedef struct { uint64_t data[8]; } cublasLtMatmulAlgo_t;
    heuristic_size=96,  # algo(64) + size_t workspaceSize + status state + float wavesCount + int reserved[4]
    heuristic_offsets={"workspace": 64, "state": 72, "waves": 76},
    op={"N": 0, "T": 1},  # CUBLAS_OP_N, CUBLAS_OP_T
    # cudaDataType_t: CUDA_R_32F=0, CUDA_R_64F=1, CUDA_R_16F=2, CUDA_R_16BF=14,
    # CUDA_R_8F_E4M3=28, CUDA_R_8F_E5M2=29
    data_type={"f32": 0, "tf32": 0, "f64": 1, "f16": 2, "bf16": 14, "f8e4m3": 28, "f8e5m2": 29},
    # cublasComputeType_t: CUBLAS_COMPUTE_16F=64, _32F=68, _64F=70, _32F_FAST_TF32=77
    compute_type={"f16": 64, "f32": 68, "f64": 70, "tf32": 77},
    # cublasLtMatmulDescAttributes_t
    desc_attr={"COMPUTE_TYPE": 0, "SCALE_TYPE": 1, "POINTER_MODE": 2, "TRANSA": 3, "TRANSB": 4,
               "EPILOGUE": 7, "BIAS_POINTER": 8},
    # cublasLtMatrixLayoutAttribute_t
    layout_attr={"TYPE": 0, "ORDER": 1, "ROWS": 2, "COLS": 3, "LD": 4, "BATCH_COUNT": 5,
                 "STRIDED_BATCH_OFFSET": 6},
    # cublasLtMatmulPreferenceAttributes_t
    pref_attr={"SEARCH_MODE": 0, "MAX_WORKSPACE_BYTES": 1, "REDUCTION_SCHEME_MASK": 3,
               "MIN_ALIGNMENT_A_BYTES": 5, "MIN_ALIGNMENT_B_BYTES": 6,
               "MIN_ALIGNMENT_C_BYTES": 7, "MIN_ALIGNMENT_D_BYTES": 8, "MAX_WAVES_COUNT": 9,
               "IMPL_MASK": 12},
    # cublasLtMatmulAlgoConfigAttributes_t
    algo_config_attr={"ID": 0, "TILE_ID": 1, "SPLITK_NUM": 2, "REDUCTION_SCHEME": 3,
                      "CTA_SWIZZLING": 4, "CUSTOM_OPTION": 5, "STAGES_ID": 6,
                      "INNER_SHAPE_ID": 7, "CLUSTER_SHAPE_ID": 8},
    algo_config_ctype={"ID": ctypes.c_int32, "TILE_ID": ctypes.c_int32, "SPLITK_NUM": ctypes.c_uint32,
                       "REDUCTION_SCHEME": ctypes.c_uint32, "CTA_SWIZZLING": ctypes.c_uint32,
                       "CUSTOM_OPTION": ctypes.c_int32, "STAGES_ID": ctypes.c_uint32,
                       "INNER_SHAPE_ID": ctypes.c_uint16, "CLUSTER_SHAPE_ID": ctypes.c_uint16},
    source="cublaslt",
    heuristic_count=16,
    version_digits=(10000, 100),  # cublasLtGetVersion(): major*10000 + minor*100 + patch
    pointer_alignment=256,  # the MIN_ALIGNMENT_*_BYTES default (cublasLt.h), set explicitly
)

HIPBLASLT = VendorTable(
    vendor="amd",
    lib_names=("libhipblaslt.so", "libhipblaslt.so.0", "libhipblaslt.so.1"),
    prefix="hipblasLt",
    # typedef struct { union { uint8_t data[16]; void* ptr; } data; size_t max_workspace_bytes; }
    algo_size=24,
    heuristic_size=56,  # algo(24) + size_t workspaceSize + status state + float wavesCount + int reserved[4]
    heuristic_offsets={"workspace": 24, "state": 32, "waves": 36},
    op={"N": 111, "T": 112},  # HIPBLAS_OP_N, HIPBLAS_OP_T
    # hipDataType: HIP_R_32F=0, HIP_R_64F=1, HIP_R_16F=2, HIP_R_16BF=14,
    # HIP_R_8F_E4M3_FNUZ=1000, HIP_R_8F_E5M2_FNUZ=1001
    data_type={"f32": 0, "tf32": 0, "f64": 1, "f16": 2, "bf16": 14, "f8e4m3": 1000, "f8e5m2": 1001},
    # hipblasComputeType_t: HIPBLAS_COMPUTE_16F=0, _32F=2, _32F_FAST_TF32=6, _64F=7
    compute_type={"f16": 0, "f32": 2, "tf32": 6, "f64": 7},
    # hipblasLtMatmulDescAttributes_t
    desc_attr={"TRANSA": 0, "TRANSB": 1, "EPILOGUE": 2, "BIAS_POINTER": 3},
    # hipblasLtMatrixLayoutAttribute_t
    layout_attr={"BATCH_COUNT": 0, "STRIDED_BATCH_OFFSET": 1, "TYPE": 2, "ORDER": 3,
                 "ROWS": 4, "COLS": 5, "LD": 6},
    # hipblasLtMatmulPreferenceAttributes_t: no MIN_ALIGNMENT attributes (hipblaslt.h of
    # ROCm 6.x ends at MAX = 2), so the alignment its solutions assume cannot be asked for:
    # calls with pointers less aligned than ``pointer_alignment`` run torch's GEMM
    pref_attr={"SEARCH_MODE": 0, "MAX_WORKSPACE_BYTES": 1},
    algo_config_attr={},
    source="hipblaslt",
    heuristic_count=2048,  # "all solutions", as hipblaslt-bench's offline tuning asks for
    solution_index_offset=0,  # hipblaslt-ext's getIndexFromAlgo reads algo.data as an int32
    version_takes_handle=True,  # hipblasLtGetVersion(handle, int* version)
    pointer_alignment=256,
)

TABLES = {"nvidia": CUBLASLT, "amd": HIPBLASLT}
