"""The cuBLASLt table against the headers installed next to the library (GPU machines).

Every constant of ``tables.CUBLASLT`` is looked up by its C name in ``cublasLt.h``,
``cublas_api.h`` and ``library_types.h`` as shipped with the CUDA toolkit or torch's
``nvidia`` wheels, so a table entry that drifts from the real headers fails here.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from primus_perf.kernels.blaslt.tables import CUBLASLT

pytestmark = pytest.mark.gpu

# our table keys -> the C enumerator names
NAMES = {
    "desc_attr": "CUBLASLT_MATMUL_DESC_{}",
    "layout_attr": "CUBLASLT_MATRIX_LAYOUT_{}",
    "pref_attr": "CUBLASLT_MATMUL_PREF_{}",
    "algo_config_attr": "CUBLASLT_ALGO_CONFIG_{}",
    "op": "CUBLAS_OP_{}",
}
COMPUTE = {"f16": "CUBLAS_COMPUTE_16F", "f32": "CUBLAS_COMPUTE_32F", "f64": "CUBLAS_COMPUTE_64F",
           "tf32": "CUBLAS_COMPUTE_32F_FAST_TF32"}
DATA = {"f32": "CUDA_R_32F", "tf32": "CUDA_R_32F", "f64": "CUDA_R_64F", "f16": "CUDA_R_16F",
        "bf16": "CUDA_R_16BF", "f8e4m3": "CUDA_R_8F_E4M3", "f8e5m2": "CUDA_R_8F_E5M2"}


def _include_dirs() -> list[Path]:
    roots = [Path(p) for p in sys.path if p.endswith("site-packages")]
    found = [h.parent for r in roots for h in r.glob("nvidia/**/include/cublasLt.h")]
    found += [h.parent for h in Path("/usr/local").glob("cuda*/include/cublasLt.h")]
    return found


def _enumerators(include: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    for name in ("cublasLt.h", "cublas_api.h", "library_types.h"):
        f = include / name
        if f.exists():
            text = re.sub(r"/\*.*?\*/|//[^\n]*", "", f.read_text(errors="replace"), flags=re.S)
            for key, val in re.findall(r"\b([A-Z][A-Z0-9_]+)\s*=\s*(-?\d+)\b", text):
                values.setdefault(key, int(val))
    return values


def test_cublaslt_table_matches_installed_headers() -> None:
    dirs = _include_dirs()
    if not dirs:
        pytest.skip("no cublasLt.h installed on this machine")
    values = _enumerators(dirs[0])
    checked = 0
    for field, pattern in NAMES.items():
        for key, ours in getattr(CUBLASLT, field).items():
            c_name = pattern.format(key)
            assert c_name in values, f"{c_name} not in {dirs[0]}"
            assert values[c_name] == ours, f"{c_name}: header {values[c_name]}, table {ours}"
            checked += 1
    for key, c_name in COMPUTE.items():
        assert values[c_name] == CUBLASLT.compute_type[key], c_name
        checked += 1
    for key, c_name in DATA.items():
        assert values[c_name] == CUBLASLT.data_type[key], c_name
        checked += 1
    # struct sizes: cublasLtMatmulAlgo_t is uint64_t data[8]
    text = (dirs[0] / "cublasLt.h").read_text(errors="replace")
    m = re.search(r"typedef struct\s*\{\s*uint64_t data\[(\d+)\];\s*\}\s*cublasLtMatmulAlgo_t", text)
    assert m and int(m.group(1)) * 8 == CUBLASLT.algo_size
    print(f"{checked} constants checked against {dirs[0]}")
