"""Another program's grouped GEMMs (``torch._grouped_mm`` / ``F.grouped_mm``) under
``primus_perf.enable``: a torchtitan-style MoE (``foreign_moe.py``) in every layout torch
allows (forward, input gradient, 2-D weight gradient, 3-D x 3-D), eager and under Inductor;
an empty cache leaves every result bit-identical, a cache with a choice for each problem
routes every call (results within bf16 tolerance); one key for a foreign call and the
trainer's; a routed call's own GEMMs are torch's; online tuning takes foreign calls. ``offs``
stays on the device: no host read where the cache has no choice for a call's shape nor
where the choice takes device offsets (``grouped_mm``, Triton), whose results match torch's
(empty groups, largest-first order, a sentinel tail). The whole loop on the CPU: profiled
(grouped problems per pass, exact splits when traced under enable), tuned from the trace
(``primus-tune grouped-gemm --trace --device cpu``) and routed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import primus_perf
from enable_fakes import FAKE_KINDS, StepClock, gemm_entry
from foreign_moe import BatchedExperts, MoE, step
from primus_perf.base.devices import current_device
from primus_perf.cache.store import CacheEntry, TuningCache
from primus_perf.cli.tune import app as tune_app
from primus_perf.kernels.grouped import problem_of
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.grouped.router import GroupedChoice, library_versions, shape_key
from primus_perf.kinds import GROUPED
from primus_perf.problems import GemmProblem, GroupedGemmProblem, grouped_mm_call
from primus_perf.problems.trace_names import GROUPED_TRACE_OP
from primus_perf.tracelens.analyze import analyze
from primus_perf.trainer.moe import grouped_mm

UNRELATED = GroupedGemmProblem(groups=3, k=8, n=8, tokens=8)
CALLS_PER_STEP = 9  # three grouped GEMMs, each forward, input gradient and weight gradient


def entry(problem: GroupedGemmProblem, backend: str = "padded_bmm") -> CacheEntry:
    """A cache entry choosing ``backend`` (``triton``: its default tiles)."""
    config = GroupedChoice(backend, GroupedGemmConfig() if backend == "triton" else None).to_solution()
    return CacheEntry(kind="grouped_gemm", problem_key=problem.key(), problem=problem.to_dict(),
                      device=current_device().to_dict(), versions=library_versions(),
                      solution={"config": {"name": backend, **config}, "blob": b""},
                      times={"tuned_ms": 1.0, "default_ms": 2.0}, error=0.0, tuner_version="test")


def write_cache(path: Path, problems, backend: str = "padded_bmm") -> Path:
    TuningCache(path).put_many([entry(p, backend) for p in problems])
    return path


def routed_cache(path: Path, problems, backend: str) -> Path:
    """``write_cache`` plus one unrelated entry that is not torch's kernel: the override stays
    on whatever ``backend`` is (a cache of only ``grouped_mm`` choices installs none)."""
    TuningCache(path).put_many([entry(p, backend) for p in problems] + [entry(UNRELATED)])
    return path


def close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6)


def moe(transposed_down: bool = False) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return MoE(transposed_down=transposed_down).to(torch.bfloat16), torch.randn(2, 12, 32, dtype=torch.bfloat16)


def batched() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return BatchedExperts().to(torch.bfloat16), torch.randn(4, 6, 32, dtype=torch.bfloat16)


MODELS = {"moe": lambda: moe(), "moe_linear_layout": lambda: moe(True), "batched": batched}


def shapes(keys) -> set[str]:
    """The shape keys (skew 1) of problem keys."""
    return {shape_key(GroupedGemmProblem.from_key(k)) for k in keys}


HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__float__", "__bool__")


@pytest.fixture
def host_reads(monkeypatch) -> list[str]:
    """Every host read of an integer tensor (``offs`` and what is derived from it) from
    Python, by method name: on a GPU each one waits for the device."""
    seen: list[str] = []
    for name in HOST_READS:
        orig = getattr(torch.Tensor, name)

        def spy(self, *args, _orig=orig, _name=name, **kwargs):
            if self.dtype in (torch.int32, torch.int64):
                seen.append(_name)
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return seen


def seen_problems(model: torch.nn.Module, x: torch.Tensor, tmp_path: Path) -> tuple[dict, tuple]:
    """The grouped summary of one step under an enable() whose cache has no choice for the
    model, and the step's results."""
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out = step(model, x)
        row = tuned.summary()["grouped_gemm"]
    return row, out


# ---- eager ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_no_choice_leaves_every_result_bit_identical(name: str, tmp_path: Path) -> None:
    model, x = MODELS[name]()
    ref = step(model, x)
    row, out = seen_problems(model, x, tmp_path)
    assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))
    calls = 6 if name == "batched" else CALLS_PER_STEP
    assert (row["routed"], row["fallback"]) == (0, calls)
    phases = {GroupedGemmProblem.from_key(k).phase for k in row["problems"]["fallback"]}
    assert phases == {"fwd", "dgrad", "wgrad"}
    # counted under their shapes' keys: the counts were never read
    assert shapes(row["problems"]["fallback"]) == set(row["problems"]["fallback"]) and row["offs_reads"] == 0
    # disabled: torch's kernel again
    again = step(model, x)
    assert torch.equal(again[0], ref[0])


def test_no_choice_reads_no_offs_on_the_host(host_reads: list[str], tmp_path: Path) -> None:
    """A cache with no choice for the model's shapes: every call goes to torch's kernel
    without reading ``offs`` (on a GPU: no device sync)."""
    model, x = moe()
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        step(model, x)
        row = tuned.summary()["grouped_gemm"]
    assert row["fallback"] == CALLS_PER_STEP and host_reads == []


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("backend", ["padded_bmm", "grouped_mm", "triton"])
def test_a_choice_for_every_problem_routes_every_call(name: str, backend: str, host_reads: list[str],
                                                      tmp_path: Path) -> None:
    model, x = MODELS[name]()
    if backend == "triton":  # the Triton interpreter computes fp32 only (its bf16 products are wrong)
        model, x = model.float(), x.float()
    ref = step(model, x)
    row, _ = seen_problems(model, x, tmp_path)
    keys = list(row["problems"]["fallback"])
    cache = write_cache(tmp_path / "tuned.json", [GroupedGemmProblem.from_key(k) for k in keys], backend)
    host_reads.clear()
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out = step(model, x)
        routed = tuned.summary()["grouped_gemm"]
        lines = tuned.end_lines()
    if backend == "grouped_mm":  # every choice torch's own kernel: no override, torch's results
        assert (routed["routed"], routed["fallback"], len(host_reads)) == (0, 0, 0)
        assert torch.equal(out[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(out[1], ref[1]))
        assert "no override of the program's calls" in lines[0]
        return
    # each call routed once: the grouped_mm backend's own torch._grouped_mm is not routed again
    assert (routed["routed"], routed["fallback"]) == (row["fallback"], 0)
    assert routed["problems"]["routed"] == row["problems"]["fallback"]
    # grouped_mm and Triton take offs on the device; padded bmm reads it once (one offs a step)
    reads = 1 if backend == "padded_bmm" and name != "batched" else 0
    assert (len(host_reads), routed["offs_reads"]) == (reads, reads)
    close_bf16(out[0], ref[0])
    for got, want in zip(out[1], ref[1]):
        close_bf16(got, want)


def test_foreign_calls_and_the_trainers_derive_the_same_problem_keys(tmp_path: Path) -> None:
    """The trainer's grouped GEMM (``trainer.moe.grouped_mm``: its offs know their host counts)
    and a foreign ``torch._grouped_mm`` on the device offs reach the one override and give one
    key per pass: by shape while nothing is traced (no counts read), the exact problem when
    traced, and it is the reading of each pass's operands as the aten call has them."""
    torch.manual_seed(3)
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 32, 48, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(sum(counts), 48, dtype=torch.bfloat16)
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cache = write_cache(tmp_path / "c.json", [UNRELATED])
    keys = {}
    for name, run in (("trainer", lambda: grouped_mm(x, w, counts)),
                      ("foreign", lambda: torch._grouped_mm(x, w, offs=offs))):
        with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
            run().backward(dy)
            keys[name] = tuned.summary()["grouped_gemm"]["problems"]["fallback"]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run().backward(dy)
        keys[name + " traced"] = {e.name.split()[1] for e in prof.events() if e.name.startswith(GROUPED_TRACE_OP)}
    # untraced, both are counted by shape; traced, both name the same exact keys
    assert keys["trainer"] == keys["foreign"] and len(keys["trainer"]) == 3
    assert keys["trainer traced"] == keys["foreign traced"] and shapes(keys["trainer traced"]) == set(keys["trainer"])
    # the reading itself: the trainer's operands of each pass as the aten call has them
    xs, ws = x.detach(), w.detach()
    assert keys["trainer traced"] == {problem_of("fwd", xs, ws, counts).key(),
                                      problem_of("dgrad", dy, ws.transpose(1, 2), counts).key(),
                                      problem_of("wgrad", xs, dy, counts).key()}
    call = grouped_mm_call((32, 16), None, (16, 48), None, 4, backward=False)
    assert (call.phase, call.groups, call.k, call.n, call.tokens) == ("wgrad", 4, 32, 48, 16)


@pytest.mark.parametrize("backend", ["padded_bmm", "triton"])
def test_rows_past_the_last_offset_are_no_groups(backend: str, tmp_path: Path) -> None:
    """An expert-parallel sentinel tail: torch leaves those output rows unwritten, and so does
    a backend that takes offs on the device; one that reads the counts zeroes them. The
    groups' rows and the weight gradient (the groups' rows only) match. The call's token
    bucket is its rows' (20 -> 32), known without reading offs."""
    torch.manual_seed(4)
    dtype, name = (torch.float32, "f32") if backend == "triton" else (torch.bfloat16, "bf16")  # the interpreter: fp32
    x = torch.randn(20, 32, dtype=dtype)
    w = torch.randn(3, 32, 16, dtype=dtype)
    dy = torch.randn(20, 16, dtype=dtype)
    offs = torch.tensor([4, 10, 16], dtype=torch.int32)
    ref, ref_dw = torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x.t(), dy, offs=offs)
    fwd = GroupedGemmProblem(groups=3, k=32, n=16, tokens=32, dtype=name)
    wgrad = GroupedGemmProblem(groups=3, k=32, n=16, tokens=32, dtype=name, phase="wgrad")
    cache = write_cache(tmp_path / "c.json", [fwd, wgrad], backend)
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out, dw = torch._grouped_mm(x, w, offs=offs), torch._grouped_mm(x.t(), dy, offs=offs)
        assert tuned.summary()["grouped_gemm"]["routed"] == 2
    close_bf16(out[:16], ref[:16])
    close_bf16(dw, ref_dw)
    assert out.shape == ref.shape
    if backend == "padded_bmm":
        assert not out[16:].any()


def _offs_passes(x, w, dy, ends, cfg, mm, wgrad) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(Triton, torch) results of the forward, input and weight gradient from device ends,
    the groups' rows of the first two (the sentinel tail is left unwritten by both)."""
    used = int(ends[-1])
    wt = w.transpose(1, 2)
    dw = wgrad(x, dy, ends, cfg)
    empty = [g for g in range(len(ends)) if int(ends[g]) == (int(ends[g - 1]) if g else 0)]
    assert empty and not dw[empty].any()
    return [(mm(x, w, ends, cfg)[:used], torch._grouped_mm(x, w, offs=ends)[:used]),
            (mm(dy, wt, ends, cfg)[:used], torch._grouped_mm(dy, wt, offs=ends)[:used]),
            (dw, torch._grouped_mm(x.t(), dy, offs=ends))]


@pytest.mark.parametrize("order", ["natural", "largest_first"])
def test_triton_kernels_take_offs_on_the_device_and_match_torch(order: str) -> None:
    """The Triton kernels' group tables built on the device from ``offs`` are the host
    tables (the stable largest-first order among equal counts too); forward, input and
    weight gradient match torch's grouped_mm, with empty groups and a sentinel tail, in fp32
    (the interpreter's bf16 products are wrong; ``test_cuda_triton_offs_bf16`` checks bf16);
    ``offs`` past the rows or decreasing keep every program in bounds."""
    from primus_perf.kernels.grouped.triton_kernels import (
        _device_tables,
        _group_tables,
        grouped_mm_offs,
        grouped_mm_wgrad_offs,
    )

    cfg = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1, group_m=2,
                            group_order=order)
    counts = [9, 0, 17, 3, 0, 17, 1]  # empty groups, and two of 17 for the stable order
    rows, K, N = sum(counts) + 5, 40, 48  # a sentinel tail of 5 rows
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    starts, visit = _device_tables(ends, rows, order)
    host_starts, host_visit = _group_tables(counts, order, torch.device("cpu"))
    assert torch.equal(starts, host_starts) and torch.equal(visit, host_visit)
    assert _device_tables(ends, rows, order)[0] is starts  # once per offs tensor: a layer's passes share it
    torch.manual_seed(6)
    x, dy = torch.randn(rows, K), torch.randn(rows, N)
    w = torch.randn(len(counts), N, K).transpose(1, 2)  # the nn.Linear storage
    for got, want in _offs_passes(x, w, dy, ends, cfg, grouped_mm_offs, grouped_mm_wgrad_offs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    bad, _ = _device_tables(torch.tensor([5, 3, 100], dtype=torch.int32), 10, order)
    assert bad.tolist() == [0, 5, 5, 10]


def test_calls_no_problem_describes_stay_torchs(tmp_path: Path) -> None:
    torch.manual_seed(5)
    a3, b2 = torch.randn(4, 8, 32, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    ref = torch._grouped_mm(a3, b2, offs=offs)  # 3-D a with 2-D b: no pass of the seam
    x = torch.randn(16, 32)
    w = torch.randn(4, 32, 16)
    offs_x = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    ref_x = torch._grouped_mm(x, w, offs=offs_x, out_dtype=torch.float32)
    key = GroupedGemmProblem.from_counts([4, 4, 4, 4], 32, 16, dtype="f32").key()
    cache = write_cache(tmp_path / "c.json", [GroupedGemmProblem.from_key(key)], "loop")
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out = torch._grouped_mm(a3, b2, offs=offs)
        assert tuned.summary()["grouped_gemm"]["routed"] + tuned.summary()["grouped_gemm"]["fallback"] == 0
        out_x = torch._grouped_mm(x, w, offs=offs_x, out_dtype=torch.float32)  # the input dtype: routed
        assert tuned.summary()["grouped_gemm"]["routed"] == 1
    assert torch.equal(out, ref)
    torch.testing.assert_close(out_x, ref_x)


def test_a_shape_whose_entries_differ_by_skew_reads_the_counts(host_reads: list[str], tmp_path: Path) -> None:
    """Entries of one shape that name different choices by skew bucket: the call's counts
    decide (one host read of its offs, counted), and a skew with no entry stays torch's.
    Entries of a shape that agree decide without the counts, for every skew."""
    torch.manual_seed(7)
    x, w = torch.randn(32, 32, dtype=torch.bfloat16), torch.randn(4, 32, 16, dtype=torch.bfloat16)
    balanced, skewed = torch.tensor([8, 16, 24, 32], dtype=torch.int32), torch.tensor([26, 28, 30, 32], dtype=torch.int32)
    ref = torch._grouped_mm(x, w, offs=skewed)
    even = GroupedGemmProblem.from_counts([8, 8, 8, 8], 32, 16)
    lopsided = GroupedGemmProblem.from_counts([26, 2, 2, 2], 32, 16)
    assert lopsided.skew > 1 and shape_key(lopsided) == even.key()
    TuningCache(tmp_path / "mixed.json").put_many([entry(even, "grouped_mm"), entry(lopsided, "padded_bmm")])
    with primus_perf.enable(tmp_path / "mixed.json", kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out = torch._grouped_mm(x, w, offs=skewed)
        torch._grouped_mm(x, w, offs=torch.tensor([4, 16, 24, 32], dtype=torch.int32))  # skew 1.5: no entry
        row = tuned.summary()["grouped_gemm"]
    close_bf16(out, ref)
    assert row["problems"]["routed"] == {lopsided.key(): 1} and row["fallback"] == 1
    assert row["problems"]["offs_reads"] == {lopsided.key(): 1, shape_key(lopsided).replace("|s1|", "|s1.5|"): 1}
    assert len(host_reads) == 2
    host_reads.clear()
    # (with one entry of another shape that is not torch's kernel: else nothing is intercepted)
    TuningCache(tmp_path / "same.json").put_many([entry(even, "grouped_mm"), entry(lopsided, "grouped_mm"),
                                                  entry(UNRELATED, "padded_bmm")])
    with primus_perf.enable(tmp_path / "same.json", kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out = torch._grouped_mm(x, w, offs=skewed)
        torch._grouped_mm(x, w, offs=balanced)
        row = tuned.summary()["grouped_gemm"]
    # the shape's choice is torch's own kernel: it runs, counted as the cache's choice
    assert row["problems"]["routed"] == {even.key(): 2} and row["offs_reads"] == 0 and host_reads == []
    assert torch.equal(out, ref)


def test_a_mixed_shape_call_whose_counts_have_not_landed_runs_its_sites_last_choice(
        host_reads: list[str], monkeypatch, tmp_path: Path) -> None:
    """On a GPU the counts of a forward's offs are not on the host yet (the non-blocking copy
    is under way): the call runs the choice its site (shape and weight) ran last, with no
    wait; only the site's first call waits for its counts."""
    from primus_perf.kernels.grouped.offsets import Offsets

    torch.manual_seed(8)
    x, w = torch.randn(32, 32), torch.randn(4, 32, 16)
    skewed, balanced = torch.tensor([26, 28, 30, 32], dtype=torch.int32), torch.tensor([8, 16, 24, 32], dtype=torch.int32)
    even = GroupedGemmProblem.from_counts([8, 8, 8, 8], 32, 16, dtype="f32")
    lopsided = GroupedGemmProblem.from_counts([26, 2, 2, 2], 32, 16, dtype="f32")
    TuningCache(tmp_path / "mixed.json").put_many([entry(even, "triton"), entry(lopsided, "grouped_mm")])
    monkeypatch.setattr(Offsets, "peek", lambda self: None)  # no copy has landed
    with primus_perf.enable(tmp_path / "mixed.json", kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        torch._grouped_mm(x, w, offs=skewed)  # the site's first call: waits for its counts
        out = torch._grouped_mm(x, w, offs=balanced)  # the site's last choice, no wait
        row = tuned.summary()["grouped_gemm"]
    torch.testing.assert_close(out, torch._grouped_mm(x, w, offs=balanced))
    assert row["problems"]["routed"] == {lopsided.key(): 2} and row["offs_reads"] == 1 and len(host_reads) == 1


def test_a_routed_grouped_calls_own_gemms_are_not_routed_again(tmp_path: Path) -> None:
    """padded_bmm's torch.bmm (and the loop's torch.mm) are torch's: the grouped choice was
    tuned on them, and a padded batch is no problem the dense router was tuned for."""
    model, x = moe()
    row, _ = seen_problems(model, x, tmp_path)
    problems = [GroupedGemmProblem.from_key(k) for k in row["problems"]["fallback"]]
    cache = write_cache(tmp_path / "tuned.json", problems, "padded_bmm")
    # one dense entry that is not torch's, so that the dense router is installed and counts
    TuningCache(cache).put(gemm_entry(GemmProblem(m=4096, n=4096, k=4096), current_device()))
    kinds = {**FAKE_KINDS, "grouped_gemm": GROUPED.part("router")}
    with primus_perf.enable(cache, kinds=("gemm", "grouped_gemm"), device_type="cpu", router_kinds=kinds,
                            log=None) as tuned:
        step(model, x)
        s = tuned.summary()
    assert s["grouped_gemm"]["routed"] == CALLS_PER_STEP
    # the dense router saw the gate's GEMMs only: forward, input and weight gradient
    assert s["gemm"]["routed"] + s["gemm"]["fallback"] == 3


def test_online_tuning_takes_foreign_calls(tmp_path: Path) -> None:
    from primus_perf.tuner.online import OnlinePolicy

    model, x = moe()
    ref = step(model, x)
    seen, _ = seen_problems(model, x, tmp_path)
    cache = tmp_path / "online.json"
    policy = OnlinePolicy(pairs=2, warmup=0, drop_after=1, max_calls=16)
    with primus_perf.enable(cache, online=True, kinds=("grouped_gemm",), device_type="cpu", log=None,
                            online_options={"policy": policy, "clock": StepClock()}) as tuned:
        outs = [step(model, x) for _ in range(8)]
        row = tuned.summary()["grouped_gemm"]
    assert set(row["tuning"]) == set(row["online"]) and shapes(row["tuning"]) == set(seen["problems"]["fallback"])
    for out in outs:
        close_bf16(out[0], ref[0])
    assert {e.problem_key for e in TuningCache(cache).entries()} == set(row["tuning"])


# ---- torch.compile (Inductor) -----------------------------------------------------------------


def _inductor_or_skip() -> None:
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler for Inductor's CPU code here")


def _compiled_step(model: torch.nn.Module, x: torch.Tensor, graphs: list) -> tuple:
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    return step(torch.compile(model, backend=backend), x)


def test_compiled_grouped_mms_are_routed_forward_and_backward(tmp_path: Path) -> None:
    _inductor_or_skip()
    from torch._inductor.utils import run_and_get_code

    model, x = moe(transposed_down=True)
    plain = _compiled_step(model, x, [])
    row, _ = seen_problems(model, x, tmp_path)
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        empty = _compiled_step(model, x, [])
        s = tuned.summary()["grouped_gemm"]
    assert (s["routed"], s["fallback"]) == (0, CALLS_PER_STEP)
    assert torch.equal(empty[0], plain[0]) and all(torch.equal(a, b) for a, b in zip(empty[1], plain[1]))
    problems = [GroupedGemmProblem.from_key(k) for k in row["problems"]["fallback"]]
    cache = write_cache(tmp_path / "tuned.json", problems)
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out, code = run_and_get_code(_compiled_step, model, x, [])
        s = tuned.summary()["grouped_gemm"]
    assert (s["routed"], s["fallback"]) == (CALLS_PER_STEP, 0)
    # the forward graph's three calls and the backward graph's six are the routed op
    assert sum(c.count("torch.ops.primus_perf.routed_grouped_mm.default(") for c in code) == CALLS_PER_STEP
    close_bf16(out[0], plain[0])
    for got, want in zip(out[1], plain[1]):
        close_bf16(got, want)
    from torch._inductor import config

    assert config.post_grad_custom_pre_pass is None  # disable() took the pass out


# ---- the whole loop: profile, analyze, tune, route ----------------------------------------------


def _trace(model: torch.nn.Module, x: torch.Tensor, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step(model, x)
    path = out_dir / "trace.json"
    prof.export_chrome_trace(str(path))
    return path


def test_a_foreign_moe_is_profiled_tuned_and_routed(tmp_path: Path) -> None:
    model, x = moe(transposed_down=True)
    ref = step(model, x)
    row, _ = seen_problems(model, x, tmp_path)
    runtime_keys = set(row["problems"]["fallback"])

    # a plain trace: every grouped GEMM with its pass and FLOPs, the split assumed even
    plain = analyze([_trace(model, x, tmp_path / "plain")]).grouped_gemm_problems
    assert set(plain["direction"]) == {"fwd", "dgrad", "wgrad"} and int(plain["calls"].sum()) == CALLS_PER_STEP
    assert not plain["skew_known"].any()
    drop_skew = {k.split("|s")[0] + "|" + k.split("|", 6)[-1] for k in runtime_keys}
    assert {k.split("|s")[0] + "|" + k.split("|", 6)[-1] for k in plain["key"]} == drop_skew

    # traced under enable(): each call names its problem with the real split
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with primus_perf.enable(empty, kinds=("grouped_gemm",), device_type="cpu", log=None):
        trace = _trace(model, x, tmp_path / "run")
    g = analyze([trace]).grouped_gemm_problems
    assert shapes(g["key"]) == runtime_keys and g["skew_known"].all() and int(g["calls"].sum()) == CALLS_PER_STEP
    for r in g.itertuples(index=False):
        p = GroupedGemmProblem.from_key(r.key)
        assert r.direction == p.phase and r.flops == 2 * 48 * p.k * p.n  # 24 tokens x top-2

    cache = tmp_path / "tuned.json"
    res = CliRunner().invoke(tune_app, ["grouped-gemm", "--trace", str(trace.parent), "--device", "cpu",
                                        "--no-triton", "--budget-s", "0.01", "--cache", str(cache)])
    assert res.exit_code == 0, res.output
    assert {e.problem_key for e in TuningCache(cache).entries()} == set(g["key"])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        out = step(model, x)
        s = tuned.summary()["grouped_gemm"]
    assert (s["routed"], s["fallback"]) == (CALLS_PER_STEP, 0)
    close_bf16(out[0], ref[0])
    for got, want in zip(out[1], ref[1]):
        close_bf16(got, want)


# ---- Hugging Face transformers --------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_moe_train.py"


def _example():
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_moe_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hf_step(net: torch.nn.Module, ids: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    net.zero_grad(set_to_none=True)
    loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in net.parameters() if p.grad is not None]


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral", "deepseek-v3"])
def test_hf_models_grouped_mms_are_routed(name: str, tmp_path: Path) -> None:
    ex = _example()
    torch.manual_seed(0)
    net = ex.build(name, "cpu", None, None, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, net.config.vocab_size, (2, 16))
    ref_loss, ref_grads = _hf_step(net, ids)
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        loss, grads = _hf_step(net, ids)
        row = tuned.summary()["grouped_gemm"]
    assert loss == ref_loss and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    layers = net.config.num_hidden_layers
    assert (row["routed"], row["fallback"]) == (0, 6 * layers)  # gate_up and down: fwd, dgrad, wgrad
    problems = [GroupedGemmProblem.from_key(k) for k in row["problems"]["fallback"]]
    tuned_cache = write_cache(tmp_path / "tuned.json", problems)
    with primus_perf.enable(tuned_cache, kinds=("grouped_gemm",), device_type="cpu", log=None) as tuned:
        loss, grads = _hf_step(net, ids)
        row = tuned.summary()["grouped_gemm"]
    assert (row["routed"], row["fallback"]) == (6 * layers, 0)
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_hf_example_runs_under_the_launcher(tmp_path: Path) -> None:
    import subprocess
    import sys

    _example()
    empty = tmp_path / "empty.json"
    empty.write_text("")
    res = subprocess.run([sys.executable, "-m", "primus_perf.launch", "--cache", str(empty), "--kinds", "grouped_gemm",
                          "--", str(EXAMPLE), "--steps", "3", "--profile", str(tmp_path / "prof")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["model"] == "qwen3-moe" and len(last["step_ms"]) == len(last["losses"]) == 3
    assert "0 calls used a cached choice, 36 fell back to torch" in res.stderr  # 2 layers x 6 x 3 steps
    g = analyze([tmp_path / "prof" / "hf_moe_trace.json"]).grouped_gemm_problems
    assert set(g["direction"]) == {"fwd", "dgrad", "wgrad"} and g["skew_known"].all()
    assert int(g["calls"].sum()) == 12  # per step: 2 layers x 2 GEMMs x 3 passes


def test_hf_moe_e2e_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/moe/hf_moe_e2e.py --smoke: profiled under enable, tuned from the trace, the
    losses compared and the sides timed; every grouped call of the tuned side counted."""
    import subprocess
    import sys

    _example()
    out = tmp_path / "e2e.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "moe" / "hf_moe_e2e.py"
    res = subprocess.run([sys.executable, str(script), "--smoke", "--cases", "qwen3-moe-128e", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["case"] == "qwen3-moe-128e" and set(row["baselines"]) == {"grouped_mm", "enable_no_choice"}
    assert row["tuned_ms"] > 0 and row["loss_max_rel_diff"] < 1e-3 and len(row["losses"]["tuned"]) == 2
    assert row["problems"] > 0 and set(row["chosen"]) and row["tuned_calls"]["routed"] > 0
    # the choices went through the program's confirmation (3 steps: too few pairs to conclude)
    conf = row["confirmation"]
    assert conf["rows"] and conf["unconfirmed"] == len(conf["rows"]) and conf["kept"] == conf["dropped"] == 0
    # one block of 1 + 1 steps a side after the warm-up step: 12 grouped calls a step
    assert row["tuned_calls"]["routed"] + row["tuned_calls"]["fallback"] == 12 * 3
    # no choice: nothing read on the host; the padded bmm choice reads each layer's offs once a step
    none, tuned = row["calls"]["enable_no_choice"], row["calls"]["tuned"]
    assert (none["routed"], none["fallback"], none["offs_reads"]) == (0, 12 * 3, 0)
    assert 0 < tuned["offs_reads"] <= 2 * 3 and set(row["vs_grouped_mm"]) == {"enable_no_choice", "tuned"}
    # Amdahl's bound of the grouped GEMMs (no CUDA kernels on the CPU: zero time, no gain)
    share = row["grouped_share"]
    assert share["step_ms"] == row["baselines"]["grouped_mm"] and share["grouped_gpu_ms"] == 0.0
    assert share["free"] == 1.0 and share["needed_for_bar"] is None


def test_hf_moe_e2e_ceiling() -> None:
    """The bound: 5 of 50 ms free gives 1.111x; 1.10x needs them 11x faster; 4 ms cannot."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "moe" / "hf_moe_e2e.py"
    spec = importlib.util.spec_from_file_location("hf_moe_e2e_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.ceiling(50.0, 5.0)
    assert c["free"] == pytest.approx(50 / 45, abs=1e-4) and c["needed_for_bar"] == pytest.approx(11.0, abs=1e-2)
    assert mod.ceiling(50.0, 4.0)["needed_for_bar"] is None


# ---- CUDA ---------------------------------------------------------------------------------------


def _cuda_layouts() -> dict:
    """Each layout torch allows, on CUDA in bf16: forward, its input gradient, the 2-D
    weight gradient, 3-D x 3-D (forward and weight gradient)."""
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    counts = [200, 0, 56, 312, 8]
    offs = torch.tensor(counts, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
    T, K, N, G = sum(counts), 256, 512, len(counts)
    x = torch.randn(T, K, dtype=bf, device=dev)
    w = torch.randn(G, N, K, dtype=bf, device=dev)
    dy = torch.randn(T, N, dtype=bf, device=dev)
    a3 = torch.randn(G, 64, K, dtype=bf, device=dev)
    b3 = torch.randn(G, K, N, dtype=bf, device=dev)
    x3 = torch.randn(G, 64, K, dtype=bf, device=dev)
    return {
        "fwd": (x, w.transpose(-2, -1), offs),
        "wgrad_2d": (dy.t(), x, offs),
        "fwd_3d": (a3, b3, None),
        "wgrad_3d": (x3.transpose(-2, -1), torch.randn(G, 64, N, dtype=bf, device=dev), None),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fwd", "wgrad_2d", "fwd_3d", "wgrad_3d"])
@pytest.mark.parametrize("backend", ["loop", "grouped_mm", "padded_bmm", "triton"])
def test_cuda_layouts_route_and_fall_back(layout: str, backend: str, tmp_path: Path) -> None:
    a, b, offs = _cuda_layouts()[layout]
    ref = torch._grouped_mm(a, b, offs=offs)
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), log=None) as tuned:
        same = torch._grouped_mm(a, b, offs=offs)
        row = tuned.summary()["grouped_gemm"]
    assert torch.equal(same, ref) and (row["routed"], row["fallback"]) == (0, 1)
    (key,) = row["problems"]["fallback"]
    cache = routed_cache(tmp_path / "tuned.json", [GroupedGemmProblem.from_key(key)], backend)
    with primus_perf.enable(cache, kinds=("grouped_gemm",), log=None) as tuned:
        out = torch._grouped_mm(a, b, offs=offs)
        row = tuned.summary()["grouped_gemm"]
    assert (row["routed"], row["fallback"], row["failed"]) == (1, 0, [])
    close_bf16(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["none", "grouped_mm", "triton", "mixed"])
def test_cuda_moe_steps_do_not_wait_for_offs(backend: str, tmp_path: Path) -> None:
    """CUDA's sync debug mode raises at any call that waits for the device: a MoE step under
    enable() makes none with no choice, with a choice that takes offs on the device, and
    (after the first step) with shapes whose entries differ by skew."""
    torch.manual_seed(0)
    model = MoE(dim=256, hidden=512, experts=8).to("cuda", torch.bfloat16)
    x = torch.randn(4, 128, 256, dtype=torch.bfloat16, device="cuda")
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with (primus_perf.enable(cache, kinds=("grouped_gemm",), log=None),
          torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof):
        _cuda_step(model, x)
    # each call's exact problem, as a trace taken under enable() names it
    problems = [GroupedGemmProblem.from_key(k) for k in
                {e.name.split()[1] for e in prof.events() if e.name.startswith(GROUPED_TRACE_OP)}]
    if backend == "grouped_mm" or backend == "triton":
        cache = routed_cache(tmp_path / "tuned.json", problems, backend)
    elif backend == "mixed":  # each shape: triton for the calls' skew, grouped_mm for another
        other = [GroupedGemmProblem(**{**p.to_dict(), "skew": 8.0 if p.skew != 8.0 else 6.0}) for p in problems]
        TuningCache(tmp_path / "mixed.json").put_many([entry(p, "triton") for p in problems]
                                                      + [entry(p, "grouped_mm") for p in other])
        cache = tmp_path / "mixed.json"
    with primus_perf.enable(cache, kinds=("grouped_gemm",), log=None) as tuned:
        ref = _cuda_step(model, x)  # a mixed shape's first call per site waits for its counts
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = _cuda_step(model, x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        row = tuned.summary()["grouped_gemm"]
    close_bf16(out[0], ref[0])
    if backend != "mixed":
        assert row["offs_reads"] == 0
    if backend != "none":
        assert row["fallback"] == 0 and row["routed"] == 2 * CALLS_PER_STEP


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["natural", "largest_first"])
def test_cuda_triton_offs_bf16(order: str) -> None:
    """The Triton kernels from device offs against torch's grouped_mm, bf16 on the GPU
    (empty groups, a sentinel tail, the nn.Linear weight storage)."""
    from primus_perf.kernels.grouped.triton_kernels import grouped_mm_offs, grouped_mm_wgrad_offs

    torch.manual_seed(9)
    cfg = GroupedGemmConfig(block_m=64, block_n=128, block_k=64, group_order=order)
    counts = [200, 0, 56, 312, 8, 0, 312]
    dev, rows, K, N = "cuda", sum(counts) + 24, 256, 512
    ends = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x, dy = torch.randn(rows, K, device=dev).bfloat16(), torch.randn(rows, N, device=dev).bfloat16()
    w = torch.randn(len(counts), N, K, device=dev).bfloat16().transpose(1, 2)
    for got, want in _offs_passes(x, w, dy, ends, cfg, grouped_mm_offs, grouped_mm_wgrad_offs):
        close_bf16(got, want)


def _cuda_step(model: torch.nn.Module, x: torch.Tensor) -> tuple:
    xx = x.detach().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(xx)
    y.backward(torch.ones_like(y) * 1e-2)
    return y.detach(), [xx.grad, *(p.grad for p in model.parameters())]


@pytest.mark.gpu
def test_cuda_moe_forward_and_backward_routed_and_bit_identical_without_choice(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MoE(dim=256, hidden=512, experts=8).to("cuda", torch.bfloat16)
    x = torch.randn(4, 128, 256, dtype=torch.bfloat16, device="cuda")

    def cuda_step():
        return _cuda_step(model, x)

    ref = cuda_step()
    cache = write_cache(tmp_path / "unrelated.json", [UNRELATED])
    with primus_perf.enable(cache, kinds=("grouped_gemm",), log=None) as tuned:
        same = cuda_step()
        row = tuned.summary()["grouped_gemm"]
    assert torch.equal(same[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(same[1], ref[1]))
    assert row["fallback"] == CALLS_PER_STEP
    problems = [GroupedGemmProblem.from_key(k) for k in row["problems"]["fallback"]]
    for backend in ("padded_bmm", "grouped_mm", "loop"):
        cache = routed_cache(tmp_path / f"{backend}.json", problems, backend)
        with primus_perf.enable(cache, kinds=("grouped_gemm",), log=None) as tuned:
            out = cuda_step()
            row = tuned.summary()["grouped_gemm"]
        assert (row["routed"], row["fallback"]) == (CALLS_PER_STEP, 0)
        close_bf16(out[0], ref[0])
        for got, want in zip(out[1], ref[1]):
            close_bf16(got, want)
