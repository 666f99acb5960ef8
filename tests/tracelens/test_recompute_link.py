"""Recomputation in the backward pass (``link``'s ``recomputed``), on hand-written traces of the
op structure torch.profiler records: a checkpointed block's forward op inside a backward node
has a sequence number of its own (the forward recorded again for a backward to come); a plain
backward's ops have none; a backward that is itself differentiated (``create_graph=True``)
records its ops with numbers too, and a backward op among them says it is not a forward."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from primus_perf.tracelens.analyze import analyze

EVALUATE = "autograd::engine::evaluate_function: "


class _Trace:
    """Host ops as nested spans on one thread, each launching at most one GPU kernel."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.t = 0.0
        self.corr = 0

    def op(self, name: str, seq: int | None = None, kids: tuple = (), kernel: str = "") -> dict[str, Any]:
        ev = {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": self.t, "dur": 0.0,
              "args": {} if seq is None else {"Sequence number": seq}}
        if name == "aten::mm":  # a GEMM of 1,024 rows: a modeled call
            ev["args"].update({"Input Dims": [[1024, 512], [512, 256]], "Input type": ["c10::BFloat16"] * 2})
        self.events.append(ev)
        self.t += 1.0
        for kid in kids:
            kid(self)
        if kernel:
            self.corr += 1
            self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                                "ts": self.t, "dur": 1.0, "args": {"correlation": self.corr}})
            self.events.append({"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7, "ts": 1000.0 + self.t,
                                "dur": 100.0, "args": {"correlation": self.corr, "device": 0, "stream": 7}})
            self.t += 2.0
        self.t += 1.0
        ev["dur"] = self.t - ev["ts"]
        return ev

    def write(self, path: Path) -> Path:
        step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": -1.0,
                "dur": self.t + 2.0, "args": {}}
        doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
               "traceEvents": [step, *self.events]}
        path.write_bytes(gzip.compress(json.dumps(doc).encode()))
        return path


def op(name: str, seq: int | None = None, *kids: Any, kernel: str = "") -> Any:
    return lambda tr: tr.op(name, seq, kids, kernel)


def _analysis(tmp_path: Path, backward: list[Any]) -> Any:
    tr = _Trace()
    op("aten::linear", 10, op("aten::mm", 10, kernel="gemm_fwd"))(tr)  # the forward
    for node in backward:
        node(tr)
    op("Optimizer.step#SGD.step", None, op("aten::add_", None, kernel="sgd"))(tr)
    return analyze([tr.write(tmp_path / "rank0.pt.trace.json.gz")])


def _recomputed(tmp_path: Path, backward: list[Any]) -> dict[str, bool]:
    k = _analysis(tmp_path, backward).kernels
    return dict(zip(k["name"], k["recomputed"], strict=True))


def _node(name: str, seq: int, *ops: Any, root_seq: int | None = -1) -> Any:
    """A backward node: the engine's event (``root_seq``: its number, -1 the node's) around the node's own."""
    return op(EVALUATE + name, seq if root_seq == -1 else root_seq, op(name, seq, *ops))


@pytest.mark.parametrize("root_seq", [-1, None])  # some traces record no number on the engine's event
def test_a_checkpointed_forward_inside_a_backward_node_is_recomputed(tmp_path: Path, root_seq: int | None) -> None:
    got = _recomputed(tmp_path, [
        _node("CheckpointFunctionBackward", 11, op("aten::linear", 20, op("aten::mm", 20, kernel="gemm_again")),
              root_seq=root_seq),
        _node("MmBackward0", 10, op("aten::mm", None, kernel="gemm_grad"))])
    assert got == {"gemm_fwd": False, "gemm_again": True, "gemm_grad": False, "sgd": False}


def test_a_differentiated_backward_is_not_taken_for_recomputation(tmp_path: Path) -> None:
    """create_graph=True: the backward's own ops record numbers; its threshold_backward says so."""
    got = _recomputed(tmp_path, [
        _node("ReluBackward0", 12, op("aten::threshold_backward", 21, kernel="relu_grad")),
        _node("MmBackward0", 10, op("aten::mm", 22, kernel="gemm_grad"))])
    assert not any(got.values())


def test_a_recomputed_gemm_is_a_forward_call_and_one_stopped_early_is_none(tmp_path: Path) -> None:
    """The GEMM table's pass: the forward run again is ``fwd``, not a backward GEMM; a recomputed op
    that launched nothing (non-reentrant checkpoint stops once it has what the backward needs) is no
    call, so its FLOPs do not inflate the forward's rate."""
    a = _analysis(tmp_path, [
        _node("MulBackward0", 11, op("aten::linear", 20, op("aten::mm", 20, kernel="gemm_again")),
              op("aten::linear", 21, op("aten::mm", 21))),  # stopped before its kernel
        _node("MmBackward0", 10, op("aten::mm", None, kernel="gemm_grad"))])
    gemms = a.calls[a.calls["kind"] == "gemm"]
    assert sorted(gemms["direction"]) == ["bwd", "fwd", "fwd"]
