"""Bytes models of ops that touch rows of a table picked by an index (vLLM's
``reshape_and_cache_flash`` writing into the paged KV cache, a rotary embedding reading its
cos/sin cache at the positions) count only those rows; and no hotspot shows more than 110%
of a roofline as a fraction of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_tracelens_unseen import _kernel, _launch, _op, _write

from primus_perf.tracelens.analyze import analyze
from primus_perf.tracelens.load import ShapeArgs
from primus_perf.tracelens.perf_models import model_bytes
from primus_perf.tracelens.roofline import SHOWN_MAX

# as the profiler records vLLM's cache write on an MI300X decode step (888 tokens, an fp8 cache
# of 4.2M blocks of 16 slots stored as uint8)
CACHE_WRITE = {"Input Dims": [[888, 1, 64], [888, 1, 64], [4213816, 16, 1, 64], [4213816, 16, 1, 64], [888], [], [], []],
               "Input type": ["c10::BFloat16", "c10::BFloat16", "unsigned char", "unsigned char", "long int", "",
                              "float", "float"]}
ROTARY = {"Input Dims": [[888], [888, 512], [888, 64], [131072, 64]],
          "Input type": ["long int", "c10::BFloat16", "c10::BFloat16", "float"]}


def _args(d: dict[str, Any]) -> ShapeArgs:
    return ShapeArgs(d["Input Dims"], d["Input type"], [], [])


def test_a_cache_write_counts_the_rows_it_writes() -> None:
    m = model_bytes(_args(CACHE_WRITE), "_C_cache_ops::reshape_and_cache_flash")
    # keys and values read (bf16), their slots' rows written into both caches (1 byte), the slots read
    assert m.bytes == 2 * 888 * 64 * 2 + 2 * 888 * 64 * 1 + 888 * 8


def test_a_rotary_embedding_reads_the_cos_sin_rows_of_its_positions() -> None:
    m = model_bytes(_args(ROTARY), "_C::rotary_embedding")
    assert m.bytes == 888 * 8 + 888 * 512 * 2 + 888 * 64 * 2 + 888 * 64 * 4


def test_no_table_without_an_index() -> None:
    """A broadcast (a bias added to every row) is not a table read by rows."""
    m = model_bytes(ShapeArgs([[8192, 4096], [4096]], ["c10::BFloat16", "c10::BFloat16"], [], []), "aten::add")
    assert m.bytes == (8192 * 4096 + 4096 + 8192 * 4096) * 2


def test_a_decode_step_on_mi300x_stays_under_the_roofline(tmp_path: Path) -> None:
    ev: list[dict[str, Any]] = [
        _op("_C_cache_ops::reshape_and_cache_flash", 10, 10, **CACHE_WRITE), _launch(1, 12),
        _kernel(1, 100, 12, "void vllm::reshape_and_cache_flash_kernel<__hip_bfloat16, __hip_bfloat16, "
                            "(vllm::Fp8KVCacheDataType)0>(__hip_bfloat16 const*, long const*, int)"),
        _op("_C::rotary_embedding", 30, 10, **ROTARY), _launch(2, 32),
        _kernel(2, 120, 8, "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*)"),
        # an elementwise op whose counted bytes could not move in its time (a model caveat): not shown as a fraction
        _op("aten::add", 50, 10, **{"Input Dims": [[4096, 4096], [4096, 4096]],
                                    "Input type": ["c10::BFloat16", "c10::BFloat16"]}), _launch(3, 52),
        _kernel(3, 140, 5, "void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<c10::BFloat16>>()"),
    ]
    a = analyze([_write(tmp_path / "decode.json.gz", ev, deviceProperties=[{"id": 0, "name": "AMD Instinct MI300X"}])])
    h = a.hotspots.set_index("op")
    cache = h.loc["_C_cache_ops::reshape_and_cache_flash"]
    assert cache["tb_s"] == pytest.approx((2 * 888 * 64 * 3 + 888 * 8) / 12e-6 / 1e12)
    assert cache["pct_roofline"] < 0.1 and not cache["roofline_note"]
    assert h.loc["_C::rotary_embedding", "pct_roofline"] < 1
    add = h.loc["aten::add"]
    assert np.isnan(add["pct_roofline"]) and add["roofline_note"]  # 3 x 32 MiB in 5 us: its reason, not 1,000%+
    assert not (a.hotspots["pct_roofline"] > SHOWN_MAX).any()
    assert not any((df["pct_roofline"] > SHOWN_MAX).any() for df in a.problem_tables().values() if len(df))
