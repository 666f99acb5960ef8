"""Exporting cache entries to other tools' formats.

- ``tunableop``: PyTorch TunableOp's results CSV: ``Validator,<name>,<value>`` lines, then
  ``<op signature>,<param signature>,<solution>,<time ms>`` rows, e.g.
  ``GemmTunableOp_BFloat16_TN,tn_4096_4096_4096_ld_4096_4096_4096,Default,0.512`` (the
  params signature is TunableOp's ``GemmParams::Signature``: transposes, m, n, k, then
  lda, ldb, ldc; a GEMM with a bias epilogue is ``GemmAndBiasTunableOp``). An entry whose choice is
  torch's own maps to ``Default``; a hipBLASLt solution to ``Gemm_Hipblaslt_<index>``; a
  cuBLASLt algorithm to TunableOp's cuBLASLt spelling, its algo config attributes in
  order: ``Gemm_Cublaslt_id_<ID>_tile_<TILE_ID>_stages_<STAGES_ID>_splitk_<SPLITK_NUM>
  _red_<REDUCTION_SCHEME>_swizzle_<CTA_SWIZZLING>_custom_<CUSTOM_OPTION>``, then
  ``_inner_<INNER_SHAPE_ID>_cluster_<CLUSTER_SHAPE_ID>`` when the library has those (12.0
  and later; a 12.x or later build parses only the long form). TunableOp reads the cuBLASLt
  names from the release after torch 2.13 on (2.13 and earlier CUDA builds offer only
  ``Default`` and register only the ``PT_VERSION`` validator, so no ``CUBLASLT_VERSION``
  line is written for them: a validator TunableOp does not know makes it drop the file).
  ``PT_VERSION`` is the reading torch's version (TunableOp drops a file whose version
  differs): by default the running torch's, whose own validators (``torch.cuda.tunable.
  get_validators()`` on a GPU build: exactly the set it checks) are written; an explicit
  release (``2.14.0``) writes the entries' library versions instead. A cuBLASLt choice
  stored as an opaque algo only (older caches: ``heur5``) is named from the algo's
  attributes where cuBLASLt can be loaded (``decode``). Every entry left out is listed
  with its reason.
- ``hipblaslt``: a hipBLASLt tuning override file, one line per hipBLASLt entry:
  ``transA,transB,m,n,k,batch,lda,ldb,ldc,ldd,a_type,b_type,c_type,d_type,compute,solution_index``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from primus_perf.base.errors import UserError
from primus_perf.base.files import write_text
from primus_perf.cache.store import CacheEntry
from primus_perf.problems import GemmProblem

TUNABLEOP_DTYPES = {"bf16": "BFloat16", "f16": "Half", "f32": "float", "f64": "double"}
# TunableOp's op per epilogue: a plain GEMM, or one with a bias (GemmAndBias; its params
# signature does not say the activation, so gelu/relu epilogues have no row of their own).
TUNABLEOP_OPS = {"none": "GemmTunableOp", "bias": "GemmAndBiasTunableOp"}
CUBLASLT_LAST_WITHOUT = (2, 13)  # the last torch release whose TunableOp on CUDA offers only Default
HIPBLASLT_TYPES = {"bf16": "bf16_r", "f16": "f16_r", "f32": "f32_r", "f64": "f64_r"}


def _solution(entry: CacheEntry) -> tuple[str, int | None]:
    cfg = entry.solution.get("config") or {}
    return str(cfg.get("source", "")), cfg.get("solution_index")


CUBLASLT_NAME_FIELDS = (("id", "ID"), ("tile", "TILE_ID"), ("stages", "STAGES_ID"), ("splitk", "SPLITK_NUM"),
                        ("red", "REDUCTION_SCHEME"), ("swizzle", "CTA_SWIZZLING"), ("custom", "CUSTOM_OPTION"))
CUBLASLT_SHAPE_FIELDS = (("inner", "INNER_SHAPE_ID"), ("cluster", "CLUSTER_SHAPE_ID"))


def cublaslt_name(config: dict, library_major: int = 0) -> str | None:
    """TunableOp's name of a cuBLASLt algorithm from its readable config (None when an
    attribute is missing; from cuBLASLt 12 on the inner and cluster shapes are part of it)."""
    if any(attr not in config for _, attr in CUBLASLT_NAME_FIELDS):
        return None
    fields = CUBLASLT_NAME_FIELDS
    has_shapes = all(attr in config for _, attr in CUBLASLT_SHAPE_FIELDS)
    if library_major >= 12 and not has_shapes:
        return None
    if has_shapes:
        fields += CUBLASLT_SHAPE_FIELDS
    return "Gemm_Cublaslt_" + "_".join(f"{label}_{int(config[attr])}" for label, attr in fields)


@dataclass
class Export:
    """What an export writes (``lines``: the file's lines, ``rows``: how many of them are
    results) and what it leaves out (``skipped``: (problem label, why) per entry)."""

    lines: list[str] = field(default_factory=list)
    rows: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string; (0, 0) when it does not start with them."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


Decode = Callable[[bytes], dict[str, int]]  # an opaque cuBLASLt algo -> its config attributes


def torch_release(version: str) -> str:
    """TunableOp's ``PT_VERSION`` of a torch version (``2.14.0+cu130`` -> ``2.14.0``);
    UserError for anything that is not one."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version.strip())
    if not m:
        raise UserError(f"--torch-version {version!r} is not a torch release such as 2.14.0")
    return ".".join(m.groups())


def running_validators() -> dict[str, str] | None:
    """The validators the running torch's TunableOp checks (a CUDA or ROCm build), else None."""
    try:
        import torch.cuda.tunable as tunable

        return {str(k): str(v) for k, v in dict(tunable.get_validators()).items()}
    except Exception:  # a CPU build has no TunableOp
        return None


def library_decoder() -> Decode | None:
    """Reads a cuBLASLt algo's attributes through the library, where it can be loaded."""
    try:
        from primus_perf.kernels.blaslt.binding import load

        return load("nvidia").algo_config
    except Exception:  # no cuBLASLt (or no GPU) here
        return None


def tunableop_solution(e: CacheEntry, p: GemmProblem, cublaslt: bool, decode: Decode | None = None
                       ) -> tuple[str | None, str]:
    """TunableOp's name for the entry's choice, or None and why it has none. ``cublaslt``:
    the reading TunableOp takes cuBLASLt solutions."""
    source, index = _solution(e)
    config = e.solution.get("config") or {}
    if source == "torch":
        return "Default", ""
    if source == "hipblaslt":
        if index is None:
            return None, "hipBLASLt choice without its solution index"
        return f"Gemm_Hipblaslt_{index}", ""
    if source == "cublaslt":
        if not cublaslt:
            return None, (f"chose cuBLASLt algorithm {config.get('name', '?')}; this TunableOp on CUDA offers"
                          f" only Default (cuBLASLt solutions are read from the release after"
                          f" {CUBLASLT_LAST_WITHOUT[0]}.{CUBLASLT_LAST_WITHOUT[1]})")
        major = _release(e.versions.get("cublasLt", ""))[0]
        name = cublaslt_name(config, major)
        blob = e.solution.get("blob") or b""
        if name is None and decode is not None and blob:
            name = cublaslt_name({**config, **decode(blob)}, major)
        if name is None:
            shapes = ", INNER_SHAPE_ID, CLUSTER_SHAPE_ID" if major >= 12 else ""
            return None, (f"chose cuBLASLt algorithm {config.get('name', '?')}, stored as an opaque algo without"
                          f" the config attributes TunableOp's name spells (ID, TILE_ID, ...{shapes}); export on"
                          " a machine with cuBLASLt (it reads them from the algo) or re-tune it")
        return name, ""
    return None, f"choice from {source or 'an unknown source'} ({config.get('name', config.get('backend', '?'))}),"\
                 " which TunableOp has no solution for"


def tunableop_rows(entries: list[CacheEntry], torch_version: str, validators: dict[str, str] | None = None,
                   decode: Decode | None = None) -> Export:
    """The rows of a TunableOp results file for the release ``torch_version``; with
    ``validators`` (the reading torch's own) those are written as they are."""
    out = Export()
    cublaslt = ("CUBLASLT_VERSION" in validators if validators is not None
                else _release(torch_version) > CUBLASLT_LAST_WITHOUT)
    versions: dict[str, str] = {}
    rows = []
    for e in entries:
        if e.kind != "gemm":
            continue
        p = GemmProblem.from_dict(e.problem)
        op = TUNABLEOP_OPS.get(p.epilogue)
        why = (f"{p.dtype_a} has no TunableOp GEMM" if p.dtype_a not in TUNABLEOP_DTYPES else
               f"{p.dtype_a} inputs with a {p.dtype_d} output: a TunableOp GEMM has one type"
               if len({p.dtype_a, p.dtype_b, p.dtype_c, p.dtype_d}) > 1 else
               "batched GEMM (TunableOp's strided-batched op is not exported)" if p.batch != 1 else
               f"epilogue {p.epilogue}: TunableOp's signature does not tell the activation" if op is None else "")
        sol = None
        if not why:
            sol, why = tunableop_solution(e, p, cublaslt, decode)
        if sol is None:
            out.skipped.append((e.label(), why))
            continue
        versions.update({k: v for k, v in e.versions.items() if k != "cublasLt" or cublaslt})
        t = ("T" if p.trans_a else "N") + ("T" if p.trans_b else "N")
        ms = e.times.get("tuned_ms", 0.0)
        rows.append(f"{op}_{TUNABLEOP_DTYPES[p.dtype_a]}_{t},{t.lower()}_{p.m}_{p.n}_{p.k}_ld_{p.lda}_{p.ldb}_{p.ldc},"
                    f"{sol},{ms:.6f}")
    names = {"hipblasLt": "HIPBLASLT_VERSION", "cublasLt": "CUBLASLT_VERSION"}
    if validators is None:
        validators = {"PT_VERSION": torch_version, **{names.get(k, k.upper()): v for k, v in versions.items()}}
    out.lines = [f"Validator,{k},{v}" for k, v in sorted(validators.items(), key=lambda kv: (kv[0] != "PT_VERSION", kv))]
    out.lines += rows
    out.rows = len(rows)
    return out


def hipblaslt_rows(entries: list[CacheEntry]) -> Export:
    out = Export()
    for e in entries:
        if e.kind != "gemm":
            continue
        source, index = _solution(e)
        if source != "hipblaslt" or index is None:
            out.skipped.append((e.label(), "not a hipBLASLt choice" if source != "hipblaslt"
                                else "hipBLASLt choice without its solution index"))
            continue
        p = GemmProblem.from_dict(e.problem)
        out.lines.append(",".join(str(x) for x in (
            "T" if p.trans_a else "N", "T" if p.trans_b else "N", p.m, p.n, p.k, p.batch, p.lda, p.ldb, p.ldc,
            p.ldd, HIPBLASLT_TYPES[p.dtype_a], HIPBLASLT_TYPES[p.dtype_b], HIPBLASLT_TYPES[p.dtype_c],
            HIPBLASLT_TYPES[p.dtype_d], "c_f32_r", index)))
    out.rows = len(out.lines)
    return out


def export(entries: list[CacheEntry], fmt: str, out: str | os.PathLike, torch_version: str = "") -> Export:
    """Write ``out`` atomically. Refused (UserError) when no entry maps to the format: a
    hipBLASLt file of a cache tuned on NVIDIA GPUs, a file of a cache without GEMM entries.
    ``torch_version`` (tunableop): the release that reads the file; empty: the running
    torch, with its own validators."""
    gemms = [e for e in entries if e.kind == "gemm"]
    if fmt == "tunableop":
        if torch_version:
            result = tunableop_rows(entries, torch_release(torch_version), decode=library_decoder())
        else:
            import torch

            result = tunableop_rows(entries, torch_release(torch.__version__), running_validators(),
                                    library_decoder())
    elif fmt == "hipblaslt":
        if gemms and not any("hipblasLt" in e.versions for e in gemms):
            libs = sorted({k for e in gemms for k in e.versions} & {"cublasLt"}) or ["no BLAS library"]
            raise UserError(f"--format hipblaslt: this cache's {len(gemms)} GEMM entries were tuned with"
                            f" {', '.join(libs)}; a hipBLASLt override file holds hipBLASLt (AMD) choices only")
        result = hipblaslt_rows(entries)
    else:
        raise UserError(f"unknown export format {fmt!r} (tunableop, hipblaslt)")
    if not result.rows:
        why = "; ".join(sorted({reason for _, reason in result.skipped}))
        raise UserError(f"nothing to export to {fmt}: " + (f"none of the {len(gemms)} GEMM entries maps to it ({why})"
                                                           if gemms else "the cache has no GEMM entries"))
    write_text(out, "\n".join(result.lines) + "\n")
    return result
