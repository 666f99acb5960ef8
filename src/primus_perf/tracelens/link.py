"""Link host ops, launches and GPU events of one trace.

- The host op tree, per thread: an op's parent is the innermost op (or annotation) whose
  time span contains it. One pass over the host events sorted by (thread, start, -length)
  with a stack; each op inherits from its parent the attributes the analyses need: the
  nearest op with a perf model (``aten::mm`` under ``aten::linear``), whether it runs
  inside an optimizer step, and the backward node (``autograd::engine::evaluate_function``)
  it runs under.
- Launches: each runtime call (``cudaLaunchKernel``, ``cuLaunchKernelEx``,
  ``cudaGraphLaunch``, ``hipLaunchKernel``, ...) gets the innermost op around it. Traces
  without runtime events use the host end of the launch flows (``ac2g``) instead.
- GPU events (kernels, memcpy, memset) link to their launch by correlation id; all kernels
  of a CUDA/HIP graph replay carry the graph launch's correlation id.
- Backward ops link to their forward op through the autograd ``Sequence number``.
- Steps: an event belongs to ``ProfilerStep#N`` when its launch (or, lacking one, its own
  start) falls inside that annotation; -1 outside every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from primus_perf.tracelens import load as L
from primus_perf.tracelens.perf_models import MODELS

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
OPTIMIZER_PREFIX = "Optimizer.step#"


@dataclass
class Linked:
    """Per GPU event (``gpu`` rows of the trace) and per host op, what the analyses use."""

    gpu: np.ndarray  # row indices of kernels, memcpys and memsets
    launch: np.ndarray  # per GPU event: row of its launch (runtime call or flow start), -1 if none
    leaf_op: np.ndarray  # per GPU event: row of the innermost op around the launch, -1 if none
    model_op: np.ndarray  # per GPU event: row of the nearest modeled op, -1 if none
    fwd_op: np.ndarray  # per GPU event in backward: row of its forward op, -1 otherwise
    in_optimizer: np.ndarray  # per GPU event: bool
    step: np.ndarray  # per GPU event: step number or -1
    op_rows: np.ndarray  # rows of host ops (cpu ops and annotations)
    op_parent: np.ndarray  # per row of the trace: parent op row (ops only), -1 for roots/others
    op_model: np.ndarray  # per row: nearest modeled op (ops only), -1
    shadowed: np.ndarray  # per row: a modeled op with a modeled op inside it (e.g. linear -> mm)
    op_step: np.ndarray  # per row: step of host events by start time, -1
    steps: list[int]  # step numbers present
    step_windows: np.ndarray  # (n, 2) host [start, end) per step, in ``steps`` order


def step_windows(rt: L.RawTrace) -> tuple[list[int], np.ndarray]:
    """The ``ProfilerStep#N`` annotations: step numbers and their [start, end) on the host."""
    ann = np.flatnonzero(rt.kind == L.KIND_ANNOTATION)
    step_code = {c: int(m.group(1)) for c, n in enumerate(rt.names) if (m := _STEP.match(n))}
    found: dict[int, tuple[float, float]] = {}
    for r in ann:
        n = step_code.get(int(rt.name[r]))
        if n is not None:
            s, e = float(rt.ts[r]), float(rt.ts[r] + rt.dur[r])
            lo, hi = found.get(n, (s, e))
            found[n] = (min(lo, s), max(hi, e))
    steps = sorted(found)
    win = np.array([found[s] for s in steps], dtype=np.float64).reshape(-1, 2)
    return steps, win


def assign_steps(times: np.ndarray, steps: list[int], win: np.ndarray) -> np.ndarray:
    """Step number of each time (-1 outside every window)."""
    out = np.full(len(times), -1, dtype=np.int64)
    if not steps:
        return out
    order = np.argsort(win[:, 0], kind="stable")
    starts, ends = win[order, 0], win[order, 1]
    nums = np.asarray(steps, dtype=np.int64)[order]
    i = np.searchsorted(starts, times, side="right") - 1
    ok = (i >= 0) & (times < ends[np.clip(i, 0, None)])
    out[ok] = nums[i[ok]]
    return out


def _op_tree(rt: L.RawTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The stack pass: (parent, model, shadowed, optimizer, backward root, launch op) per row."""
    n = len(rt)
    kind = rt.kind
    host = np.flatnonzero((kind == L.KIND_CPU_OP) | (kind == L.KIND_ANNOTATION) | (kind == L.KIND_RUNTIME)
                          | (kind == L.KIND_FLOW_START))
    order = host[np.lexsort((-rt.dur[host], rt.ts[host], rt.tid[host], rt.pid[host]))]
    _, thread = np.unique(np.stack([rt.pid[order], rt.tid[order]]), axis=1, return_inverse=True)
    names = rt.names
    modeled_name = np.array([nm in MODELS for nm in names] + [False], dtype=bool)
    is_opt_name = np.array([nm.startswith(OPTIMIZER_PREFIX) for nm in names] + [False], dtype=bool)
    is_bwd_name = np.array([nm.startswith(BACKWARD_PREFIX) for nm in names] + [False], dtype=bool)
    name_of = rt.name[order]
    modeled = (modeled_name[name_of] & (rt.shape[order] >= 0)).tolist()
    opt_flag = is_opt_name[name_of].tolist()
    bwd_flag = is_bwd_name[name_of].tolist()
    op_like = ((kind[order] == L.KIND_CPU_OP) | (kind[order] == L.KIND_ANNOTATION)).tolist()
    starts = rt.ts[order].tolist()
    ends = (rt.ts[order] + rt.dur[order]).tolist()
    threads = thread.ravel().tolist()
    rows = order.tolist()

    parent = [-1] * n
    model = [-1] * n
    optim = [False] * n
    bwd_root = [-1] * n
    launch_op = [-1] * n
    shadowed = np.zeros(n, dtype=bool)
    stack: list[int] = []  # positions in `order`
    stack_end: list[float] = []
    cur = -1
    for j in range(len(rows)):
        t = starts[j]
        if threads[j] != cur:
            cur = threads[j]
            stack.clear()
            stack_end.clear()
        while stack_end and stack_end[-1] <= t:
            stack.pop()
            stack_end.pop()
        p = rows[stack[-1]] if stack else -1
        r = rows[j]
        if not op_like[j]:
            launch_op[r] = p
            continue
        parent[r] = p
        if p >= 0:
            pm = model[p]
            if modeled[j]:
                model[r] = r
                if pm >= 0:
                    shadowed[pm] = True
            else:
                model[r] = pm
            optim[r] = opt_flag[j] or optim[p]
            bwd_root[r] = r if bwd_flag[j] else bwd_root[p]
        else:
            model[r] = r if modeled[j] else -1
            optim[r] = opt_flag[j]
            bwd_root[r] = r if bwd_flag[j] else -1
        stack.append(j)
        stack_end.append(ends[j])
    return (np.array(parent, dtype=np.int64), np.array(model, dtype=np.int64), shadowed,
            np.array(optim, dtype=bool), np.array(bwd_root, dtype=np.int64), np.array(launch_op, dtype=np.int64))


def _lookup(keys: np.ndarray, rows: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """For each wanted key, the row with that key (first one), or -1."""
    out = np.full(len(wanted), -1, dtype=np.int64)
    if len(keys) == 0 or len(wanted) == 0:
        return out
    order = np.argsort(keys, kind="stable")
    sk, sr = keys[order], rows[order]
    i = np.searchsorted(sk, wanted, side="left")
    ok = (i < len(sk)) & (sk[np.clip(i, 0, len(sk) - 1)] == wanted)
    out[ok] = sr[i[ok]]
    return out


def _forward_ops(rt: L.RawTrace, bwd_root: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sequence numbers of forward ops and, for each, the outermost (earliest) op with it."""
    ops = np.flatnonzero((rt.kind == L.KIND_CPU_OP) & (rt.seq >= 0) & (bwd_root == -1))
    ops = ops[np.lexsort((-rt.dur[ops], rt.ts[ops]))]
    seqs, first = np.unique(rt.seq[ops], return_index=True)
    return seqs, ops[first]


def link(rt: L.RawTrace) -> Linked:
    """Link one trace (see the module docstring)."""
    parent, model, shadowed, optim, bwd_root, launch_op = _op_tree(rt)
    kind = rt.kind
    gpu = np.flatnonzero((kind == L.KIND_KERNEL) | (kind == L.KIND_MEMCPY) | (kind == L.KIND_MEMSET))
    runtime = np.flatnonzero(kind == L.KIND_RUNTIME)
    launch = _lookup(rt.correlation[runtime], runtime, rt.correlation[gpu])
    missing = (launch < 0) & (rt.correlation[gpu] >= 0)
    if missing.any():
        flows = np.flatnonzero(kind == L.KIND_FLOW_START)
        launch[missing] = _lookup(rt.correlation[flows], flows, rt.correlation[gpu][missing])
    has = launch >= 0
    leaf = np.where(has, launch_op[np.clip(launch, 0, None)], -1)
    has_leaf = leaf >= 0
    model_op = np.where(has_leaf, model[np.clip(leaf, 0, None)], -1)
    in_opt = np.where(has_leaf, optim[np.clip(leaf, 0, None)], False)
    root = np.where(has_leaf, bwd_root[np.clip(leaf, 0, None)], -1)
    fwd_op = np.full(len(gpu), -1, dtype=np.int64)
    in_bwd = root >= 0
    if in_bwd.any():
        seqs, fwd_rows = _forward_ops(rt, bwd_root)
        fwd_op[in_bwd] = _lookup(seqs, fwd_rows, rt.seq[root[in_bwd]])
    steps, win = step_windows(rt)
    when = np.where(has, rt.ts[np.clip(launch, 0, None)], rt.ts[gpu])
    op_step = assign_steps(rt.ts, steps, win)
    return Linked(
        gpu=gpu, launch=launch, leaf_op=leaf, model_op=model_op, fwd_op=fwd_op,
        in_optimizer=in_opt.astype(bool), step=assign_steps(when, steps, win),
        op_rows=np.flatnonzero((kind == L.KIND_CPU_OP) | (kind == L.KIND_ANNOTATION)),
        op_parent=parent, op_model=model, shadowed=shadowed, op_step=op_step,
        steps=steps, step_windows=win,
    )
