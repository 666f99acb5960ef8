"""The registry of kinds: one record per kind package, and what derives from it (the cache's
schema checks, the dispatches, the tuner's plugins and online adapters, problems files, the
analyzer's tables). ``test_toy_kind.py`` adds a whole kind from one test module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from primus_perf import kinds
from primus_perf.cache.store import SCHEMA_VERSION, CacheEntry, TuningCache
from primus_perf.problems import GroupedGemmProblem, problem_from_item, problem_types


def test_every_problem_type_is_one_kind_in_registration_order() -> None:
    assert kinds.names() == ("gemm", "grouped_gemm", "attention", "fp8_plan")
    assert {k.name: k.problem_type for k in kinds.all_kinds()} == problem_types()
    for kind in kinds.all_kinds():
        assert kinds.kind_of(kind.problem_type.__new__(kind.problem_type)) is kind
        assert kind.table == f"{kind.name}_problems" and kind.columns[:2] == ["key", "label"]
    with pytest.raises(KeyError, match="unknown kind 'fp4'"):
        kinds.get("fp4")
    with pytest.raises(ValueError, match="registered twice"):
        kinds.register(kinds.Kind(GroupedGemmProblem, "again"))


def test_a_record_names_only_parts_that_exist() -> None:
    with pytest.raises(ValueError, match=r"no part\(s\) \['seam'\]"):
        kinds.Kind(GroupedGemmProblem, "x", parts={"seam": object()})
    with pytest.raises(KeyError, match="no part 'seam'"):
        kinds.GEMM.part("seam")


def test_each_kind_is_a_package_whose_parts_belong_to_their_layers() -> None:
    import importlib

    from primus_perf.runtime import dispatch
    from primus_perf.runtime.handle import routable_kinds
    from primus_perf.tuner import kinds as tuner_kinds

    routed = {kinds.GEMM.name, kinds.GROUPED.name, kinds.ATTENTION.name}
    for package in kinds.PACKAGES:  # the registry lists the packages; each exports its record
        assert importlib.import_module(f"primus_perf.kinds.{package}").KIND is kinds.get(package)
    assert set(kinds.with_part("router")) == routed == set(routable_kinds())
    assert set(kinds.with_part("tuner")) == routed == set(tuner_kinds.plugins())
    assert set(kinds.with_part("online")) == routed == set(kinds.with_part("trace")) == set(kinds.with_part("cli"))
    assert set(kinds.with_part("intercept")) == routed == set(dispatch.kinds_with_dispatch())
    for name in routed:  # a built-in record names each part in the layer that owns it
        kind = kinds.get(name)
        for slot, layer in kinds.PARTS.items():
            ref = kind.parts[slot]
            text = ref if isinstance(ref, str) else ref.factory
            assert isinstance(text, str) and text.startswith(f"primus_perf.{layer}."), (name, slot, text)
        assert isinstance(dispatch.of(name), kind.part("intercept"))
    # an FP8 plan is tuned by tuner.fp8 and applied as a whole (fp8.apply, train.fp8): no part
    assert kinds.FP8_PLAN.parts == {}
    for name, plugin in tuner_kinds.plugins().items():
        assert plugin.kind == name and plugin.problem_type is kinds.get(name).problem_type


def test_the_cache_checks_every_kinds_problem_grouped_included(tmp_path: Path) -> None:
    p = GroupedGemmProblem(groups=8, k=64, n=32, tokens=256, skew=2.0)
    good = CacheEntry(kind=p.kind, problem_key=p.key(), problem=p.to_dict(), device={"name": "x"},
                      versions={"torch": "2"}, solution={"config": {"name": "loop"}, "blob": b""})
    bad = {**good.to_dict(), "problem": {**p.to_dict(), "skew": 1.7}}  # not a bucket edge
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": [good.to_dict(), bad]}))
    seen: list[str] = []
    assert [e.problem_key for e in TuningCache(path, report_stale=seen.append).entries()] == [p.key()]
    assert len(seen) == 1 and "malformed grouped_gemm problem" in seen[0], seen


def test_problems_files_read_an_item_through_its_kinds_type() -> None:
    item = {"kind": "grouped_gemm", "problem": {"counts": [3, 1, 0, 4], "k": 16, "n": 8}}
    assert problem_from_item(item) == GroupedGemmProblem.from_counts([3, 1, 0, 4], 16, 8)
    with pytest.raises(ValueError, match="unknown kind 'fp4'"):
        problem_from_item({"kind": "fp4", "problem": {}})


def test_the_analyzers_tables_are_the_registrys() -> None:
    from primus_perf.tracelens.analyses.problems import KIND_COLUMNS
    from primus_perf.tracelens.analyze import Analysis

    assert list(KIND_COLUMNS) == list(kinds.names())
    assert KIND_COLUMNS["grouped_gemm"][2:8] == ["groups", "k", "n", "tokens", "skew", "skew_known"]
    fields = {f: None for f in Analysis.__dataclass_fields__ if f != "problems_by_kind"}
    a = Analysis(**fields)
    assert list(a.problem_tables()) == list(kinds.names())
    assert list(a.grouped_gemm_problems.columns) == KIND_COLUMNS["grouped_gemm"]
    with pytest.raises(AttributeError):
        a.fp4_problems  # noqa: B018
