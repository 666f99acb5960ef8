"""The host op tree in vector passes (``link._op_tree``) against the stack pass it stands for,
written plainly here, on random host events: nested, crossing and zero-length spans over
several threads, with modeled ops, owning annotations, grouped GEMM and attention ops,
optimizer steps and backward nodes; an op that crosses the end of the span it starts in
belongs to the nearest span that holds it (a step marker opened inside the optimizer step)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from primus_perf.tracelens import load as L
from primus_perf.tracelens.link import (
    BACKWARD_PREFIX,
    CROSSING_US,
    OPTIMIZER_PREFIX,
    _op_tree,
)
from primus_perf.tracelens.perf_models import ATTENTION_MODELS, annotation_model, models, ops_where

OWNER = "primus_perf::grouped_gemm ggemm:fwd|g8|k128|n256|t2048|s1.5|bf16|wN tokens=2048"
NAMES = ["aten::linear", "aten::mm", "aten::addmm", "aten::add", "aten::_grouped_mm",
         "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
         f"{OPTIMIZER_PREFIX}AdamW.step", f"{BACKWARD_PREFIX}MmBackward0", OWNER, "aten::copy_"]


def _stack_pass(rt: L.RawTrace) -> tuple[np.ndarray, ...]:
    """The reference: one pass over the host events sorted by (thread, start, -length) with a
    stack of the ops that contain the current time."""
    n, kind = len(rt), rt.kind
    host = np.flatnonzero(np.isin(kind, [L.KIND_CPU_OP, L.KIND_ANNOTATION, L.KIND_RUNTIME, L.KIND_FLOW_START]))
    order = host[np.lexsort((-rt.dur[host], rt.ts[host], rt.thread[host]))]
    up, model, bwd = (np.full(n, -1, dtype=np.int32) for _ in range(3))
    optim, shadowed = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    stack: list[tuple] = []
    cur = None
    for r in order.tolist():
        name, t = rt.names[rt.name[r]], float(rt.ts[r])
        if rt.thread[r] != cur:
            cur, stack = rt.thread[r], []
        while stack and stack[-1][0] <= t:
            stack.pop()
        at = len(stack) - 1
        op = kind[r] in (L.KIND_CPU_OP, L.KIND_ANNOTATION)
        if op:  # an op that crosses the end of the span it starts in belongs to the nearest one that holds it
            end, dur = t + float(rt.dur[r]), float(rt.dur[r])
            while at >= 0 and stack[at][0] < end - max(CROSSING_US, 0.5 * dur):
                at -= 1
        p, pm, po, pb, owned, pm_owns, pm_att = stack[at][1:] if at >= 0 else (-1, -1, False, -1, False, False, False)
        up[r] = p
        if not op:
            continue
        owner = annotation_model(name) is not None
        modeled = name in models() and rt.shape[r] >= 0
        attention = name in ATTENTION_MODELS
        inside = pm_owns and not (attention and pm_att)
        if not owned and (owner or (modeled and not inside)):
            if pm >= 0:
                shadowed[pm] = True
            pm, owned, pm_owns, pm_att = r, owner, name in ops_where("owns_inside"), attention
        po = po or name.startswith(OPTIMIZER_PREFIX)
        pb = r if name.startswith(BACKWARD_PREFIX) else pb
        model[r], optim[r], bwd[r] = pm, po, pb
        stack.append((t + float(rt.dur[r]), r, pm, po, pb, owned, pm_owns, pm_att))
    ops = np.isin(kind, [L.KIND_CPU_OP, L.KIND_ANNOTATION])
    return np.where(ops, up, -1), model, shadowed, optim, bwd, np.where(ops, -1, up)


def _events(seed: int, n: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    ev = []
    for i in range(n):
        ts = rnd.randrange(0, 400)
        dur = rnd.choice([0, 1, 2, 5, 10, 30, 80, 200, rnd.randrange(0, 400)])
        cat = rnd.choices(["cpu_op", "user_annotation", "cuda_runtime"], [6, 1, 3])[0]
        name = "cudaLaunchKernel" if cat == "cuda_runtime" else rnd.choice(NAMES)
        args: dict[str, Any] = {"correlation": i} if cat == "cuda_runtime" else {}
        if cat == "cpu_op" and rnd.random() < 0.7:
            args["Input Dims"] = [[64, 128], [128, 256]]
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": rnd.choice([1, 1, 1, 2, "3"]),
                   "ts": ts, "dur": dur, "args": args})
    return ev


@pytest.mark.parametrize("seed", range(12))
def test_the_op_tree_is_the_stack_pass(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": _events(seed, 400 if seed % 3 else 3000)}).encode()))
    rt = L.load(path)
    names = ("parent", "model", "shadowed", "optimizer", "backward root", "launch op")
    for name, got, want in zip(names, _op_tree(rt), _stack_pass(rt), strict=True):
        assert np.array_equal(got, want), name
