"""BLAS-Lt layouts on the CPU: which torch operands a GEMM router takes (``problem_of`` and
``blaslt.layout.refusal``), that the tuner's operands are the call's exact layout with the
plan's extents, and that the guards catch a kernel writing outside its output."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from primus_perf.kernels.blaslt.guarded import GuardedMatrix, GuardError
from primus_perf.kernels.blaslt.layout import layouts, refusal
from primus_perf.kernels.gemm import problem_of
from primus_perf.problems import GemmProblem
from primus_perf.tuner.core import tune_problem
from primus_perf.tuner.gemm.plugin import GemmTuner, Operands, python_candidate


def _t(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# name -> (a, b): layouts torch hands aten::mm / aten::bmm, each either routed or left to torch
ACCEPTED = {
    "mm NN": lambda: (_t(64, 32), _t(32, 48)),
    "mm x @ W.T (linear)": lambda: (_t(64, 32), _t(48, 32).t()),
    "mm dgrad": lambda: (_t(64, 48), _t(48, 32)),
    "mm wgrad (g.T @ x)": lambda: (_t(64, 48).t(), _t(64, 32)),
    "mm TT": lambda: (_t(32, 64).t(), _t(48, 32).t()),
    "mm sliced columns (ld > cols)": lambda: (_t(64, 80)[:, :32], _t(32, 48)),
    "mm sliced rows of a transposed view": lambda: (_t(96, 64)[:32].t(), _t(32, 48)),
    "mm offset into a storage": lambda: (_t(65, 32)[1:], _t(32, 48)),
    "mm one row": lambda: (_t(1, 32), _t(32, 48)),
    "mm K=1": lambda: (_t(64, 1), _t(1, 48)),
    "bmm packed": lambda: (_t(4, 16, 32), _t(4, 32, 24)),
    "bmm padded wgrad (x.transpose(1, 2) @ dy)": lambda: (_t(8, 64, 32).transpose(1, 2), _t(8, 64, 16)),
    "bmm transposed weight": lambda: (_t(4, 16, 32), _t(4, 24, 32).transpose(1, 2)),
    "bmm batch stride beyond the matrix": lambda: (_t(4, 32, 32)[:, :16], _t(4, 32, 24)),
    "bmm one batch": lambda: (_t(1, 16, 32), _t(1, 32, 24)),
}
REFUSED = {
    "bmm expanded batch (stride 0)": lambda: (_t(16, 32).expand(4, 16, 32), _t(4, 32, 24)),
    "bmm interleaved batch (batch stride < matrix)": lambda: (_t(16, 4, 32).transpose(0, 1), _t(4, 32, 24)),
    "bmm batch stride not a multiple of 256 bytes": lambda: (_t(4, 3, 7), _t(4, 7, 5)),
    "mm neither rows nor columns contiguous": lambda: (_t(64, 64)[::2, ::2], _t(32, 48)),
    "mm expanded rows": lambda: (_t(1, 32).expand(64, 32), _t(32, 48)),
}


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last of a torch view."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_operands_are_the_calls_layout_with_the_plans_extents(name: str) -> None:
    a, b = ACCEPTED[name]()
    p = problem_of(a, b)
    assert refusal(p) is None
    ops = Operands(p, device="cpu", sets=1)
    if p.batch == 1:  # a batch of one is the 2-D problem of its matrices
        a, b = a[0] if a.dim() == 3 else a, b[0] if b.dim() == 3 else b
    # the tuner's operands: the same shapes and strides as the call's
    assert (ops.a[0].shape, ops.a[0].stride()) == (a.shape, a.stride()), name
    assert (ops.b[0].shape, ops.b[0].stride()) == (b.shape, b.stride()), name
    out = torch.matmul(a, b)
    assert ops.d[0].shape == out.shape
    # each buffer holds exactly the extent the plan describes (plus the guard), and the
    # call's own operands span no more than that
    la, lb, _, ld = layouts(p)
    m = ops.mats[0]
    assert (m["a"].extent_bytes, m["b"].extent_bytes, m["d"].extent_bytes) == (
        la.extent_bytes(), lb.extent_bytes(), ld.extent_bytes())
    if p.batch > 1:
        assert _extent(b) <= la.extent() and _extent(a) <= lb.extent()
    else:
        assert _extent(b) == la.matrix_extent() and _extent(a) == lb.matrix_extent()
    # torch's default candidate on the tuner's operands is right and touches only its output
    session = GemmTuner(device="cpu", sets=1, library=None).open(p, None, lambda _l: None)
    assert session.error(session.candidates()[0]) < 1e-5
    assert ops.touched(0) == []


@pytest.mark.parametrize("name", list(REFUSED))
def test_layouts_no_blaslt_kernel_may_be_given_are_left_to_torch(name: str) -> None:
    a, b = REFUSED[name]()
    with pytest.raises(ValueError):
        problem_of(a, b)


@pytest.mark.parametrize("batch, change, why", [
    (4, {"ldd": 8, "ldc": 8}, "leading dimension"),
    (4, {"stride_d": 100, "stride_c": 100}, "batches overlap"),
    (4, {"stride_a": 16 * 32 + 3}, "not a multiple of 256"),
    (1, {"ldc": 24}, "C is laid out unlike D"),
])
def test_refusal_names_the_rule(batch: int, change: dict, why: str) -> None:
    p = GemmProblem(m=16, n=8, k=32, batch=batch)
    assert refusal(p) is None
    bad = dataclasses.replace(p, **change) if "ldd" not in change else None
    if bad is None:  # GemmProblem itself refuses a leading dimension below the rows
        with pytest.raises(ValueError, match=why):
            dataclasses.replace(p, **change)
        return
    assert why in refusal(bad)


def _write_past_output(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.matmul(a, b, out=out)
    whole = out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,), 0)
    whole[-1] = 1.0  # the last element of the buffer: inside the guard


def _write_into_a_gap(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.matmul(a, b, out=out)
    out.as_strided((1,), (1,), out.storage_offset() + out.shape[-1])[0] = 1.0  # right of row 0


@pytest.mark.parametrize("fn, where", [
    (_write_past_output, "the guard after it"),
    (_write_into_a_gap, "a gap between its elements"),
])
def test_a_kernel_writing_outside_its_output_is_caught_and_rejected(fn, where: str) -> None:
    # an output with ld > rows (gaps right of each row in torch's terms)
    p = dataclasses.replace(GemmProblem(m=16, n=8, k=32), ldc=24, ldd=24)
    tuner = GemmTuner(device="cpu", sets=1, library=None, extra=[python_candidate("bad", fn)])
    session = tuner.open(p, None, lambda _l: None)
    with pytest.raises(GuardError, match=where):
        session.error(session.candidates()[-1])
    assert "bad" in session.details["guard"]
    # the core rejects it and keeps torch's choice
    res = tune_problem(tuner, p, timer=_same_times, budget_s=0.5)
    bad = next(c for c in res.candidates if c.name == "bad")
    assert bad.status == "rejected" and "written outside" in bad.reason
    assert res.chosen == "torch" and "bad" in res.details["guard"]


def test_a_kernel_writing_into_an_input_is_caught() -> None:
    def bad(a, b, out):
        torch.matmul(a, b, out=out)
        b.as_strided((1,), (1,), b.storage_offset())[0] = 123.0

    p = GemmProblem(m=16, n=8, k=32)
    session = GemmTuner(device="cpu", sets=1, library=None, extra=[python_candidate("bad", bad)]).open(
        p, None, lambda _l: None)
    with pytest.raises(GuardError, match=r"A \(an input\) was written"):
        session.error(session.candidates()[-1])


def test_guarded_matrix_views_and_guards() -> None:
    p = GemmProblem(m=16, n=8, k=32, batch=3, stride_d=16 * 8 + 128)
    d = layouts(p)[3]
    g = GuardedMatrix(d, "cpu", guard_bytes=256)
    assert g.view.shape == (3, 8, 16) and g.view.stride() == (d.stride, 16, 1)
    g.reset(float("nan"))
    assert g.touched() is None
    g.view.fill_(1.0)  # writing every element touches nothing else
    assert g.touched() is None
    g.storage[g.extent_bytes - 1 - 256] = 0  # a byte in the gap between batch 1 and batch 2
    assert "gap" in g.touched()


def test_refused_problems_get_no_library_candidates() -> None:
    p = GemmProblem(m=16, n=8, k=32, batch=4, stride_a=16 * 32 + 3)

    def library():
        raise AssertionError("a refused problem must not open a plan")

    session = GemmTuner(device="cpu", sets=1, library=library).open(p, None, lambda _l: None)
    assert [c.name for c in session.candidates()] == ["torch"]
    assert "not a multiple of 256" in session.details["refused"]


def _same_times(calls, n_sets, reps, seed=0):
    return {key: [1e-3] * reps for key in calls}
