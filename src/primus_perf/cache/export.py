"""Exporting cache entries to other tools' formats.

- ``tunableop``: PyTorch TunableOp's results CSV: ``Validator,<name>,<value>`` lines, then
  ``<op signature>,<param signature>,<solution>,<time ms>`` rows, e.g.
  ``GemmTunableOp_BFloat16_TN,tn_4096_4096_4096,Default,0.512``. An entry whose choice is
  torch's own maps to ``Default``; a hipBLASLt solution to ``Gemm_Hipblaslt_<index>``; a
  cuBLASLt algorithm to TunableOp's cuBLASLt spelling, its algo config attributes in
  order: ``Gemm_Cublaslt_id_<ID>_tile_<TILE_ID>_stages_<STAGES_ID>_splitk_<SPLITK_NUM>
  _red_<REDUCTION_SCHEME>_swizzle_<CTA_SWIZZLING>_custom_<CUSTOM_OPTION>``, then
  ``_inner_<INNER_SHAPE_ID>_cluster_<CLUSTER_SHAPE_ID>`` when the library has those (12.0
  and later). TunableOp reads the cuBLASLt names from the release after torch 2.13 on
  (2.13 and earlier CUDA builds offer only ``Default``). ``PT_VERSION`` is the reading
  torch's version (TunableOp drops a file whose version differs), given by the caller.
- ``hipblaslt``: a hipBLASLt tuning override file, one line per hipBLASLt entry:
  ``transA,transB,m,n,k,batch,lda,ldb,ldc,ldd,a_type,b_type,c_type,d_type,compute,solution_index``.
"""

from __future__ import annotations

import os

from primus_perf.cache.store import CacheEntry
from primus_perf.errors import UserError
from primus_perf.files import write_text
from primus_perf.problems import GemmProblem

TUNABLEOP_DTYPES = {"bf16": "BFloat16", "f16": "Half", "f32": "float", "f64": "double"}
HIPBLASLT_TYPES = {"bf16": "bf16_r", "f16": "f16_r", "f32": "f32_r", "f64": "f64_r"}


def _solution(entry: CacheEntry) -> tuple[str, int | None]:
    cfg = entry.solution.get("config") or {}
    return str(cfg.get("source", "")), cfg.get("solution_index")


CUBLASLT_NAME_FIELDS = (("id", "ID"), ("tile", "TILE_ID"), ("stages", "STAGES_ID"), ("splitk", "SPLITK_NUM"),
                        ("red", "REDUCTION_SCHEME"), ("swizzle", "CTA_SWIZZLING"), ("custom", "CUSTOM_OPTION"))
CUBLASLT_SHAPE_FIELDS = (("inner", "INNER_SHAPE_ID"), ("cluster", "CLUSTER_SHAPE_ID"))


def cublaslt_name(config: dict) -> str | None:
    """TunableOp's name of a cuBLASLt algorithm from its readable config (None when an
    attribute is missing)."""
    if any(attr not in config for _, attr in CUBLASLT_NAME_FIELDS):
        return None
    fields = CUBLASLT_NAME_FIELDS
    if all(attr in config for _, attr in CUBLASLT_SHAPE_FIELDS):
        fields += CUBLASLT_SHAPE_FIELDS
    return "Gemm_Cublaslt_" + "_".join(f"{label}_{int(config[attr])}" for label, attr in fields)


def tunableop_rows(entries: list[CacheEntry], torch_version: str) -> tuple[list[str], int]:
    lines = [f"Validator,PT_VERSION,{torch_version}"]
    versions: dict[str, str] = {}
    skipped = 0
    rows = []
    for e in entries:
        if e.kind != "gemm":
            continue
        p = GemmProblem.from_dict(e.problem)
        source, index = _solution(e)
        if p.dtype_a not in TUNABLEOP_DTYPES or p.batch != 1:
            skipped += 1
            continue
        if source == "torch":
            sol = "Default"
        elif source == "hipblaslt" and index is not None:
            sol = f"Gemm_Hipblaslt_{index}"
        elif source == "cublaslt" and cublaslt_name(e.solution.get("config") or {}):
            sol = cublaslt_name(e.solution["config"])
        else:
            skipped += 1
            continue
        versions.update(e.versions)
        t = ("T" if p.trans_a else "N") + ("T" if p.trans_b else "N")
        ms = e.times.get("tuned_ms", 0.0)
        rows.append(f"GemmTunableOp_{TUNABLEOP_DTYPES[p.dtype_a]}_{t},{t.lower()}_{p.m}_{p.n}_{p.k},{sol},{ms:.6f}")
    names = {"hipblasLt": "HIPBLASLT_VERSION", "cublasLt": "CUBLASLT_VERSION"}
    lines += [f"Validator,{names.get(k, k.upper())},{v}" for k, v in sorted(versions.items())]
    return lines + rows, skipped


def hipblaslt_rows(entries: list[CacheEntry]) -> tuple[list[str], int]:
    rows, skipped = [], 0
    for e in entries:
        source, index = _solution(e)
        if e.kind != "gemm" or source != "hipblaslt" or index is None:
            skipped += e.kind == "gemm"
            continue
        p = GemmProblem.from_dict(e.problem)
        rows.append(",".join(str(x) for x in (
            "T" if p.trans_a else "N", "T" if p.trans_b else "N", p.m, p.n, p.k, p.batch, p.lda, p.ldb, p.ldc,
            p.ldd, HIPBLASLT_TYPES[p.dtype_a], HIPBLASLT_TYPES[p.dtype_b], HIPBLASLT_TYPES[p.dtype_c],
            HIPBLASLT_TYPES[p.dtype_d], "c_f32_r", index)))
    return rows, skipped


def export(entries: list[CacheEntry], fmt: str, out: str | os.PathLike, torch_version: str = "") -> tuple[int, int]:
    """Write ``out`` atomically; returns (rows written, gemm entries that do not map)."""
    if fmt == "tunableop":
        if not torch_version:
            raise UserError("--format tunableop needs --torch-version: the torch release that will read the file"
                            " (TunableOp ignores a file stamped with another version)")
        lines, skipped = tunableop_rows(entries, torch_version)
        n = sum(1 for x in lines if not x.startswith("Validator,"))
    elif fmt == "hipblaslt":
        lines, skipped = hipblaslt_rows(entries)
        n = len(lines)
    else:
        raise UserError(f"unknown export format {fmt!r} (tunableop, hipblaslt)")
    write_text(out, "\n".join(lines) + "\n")
    return n, skipped
