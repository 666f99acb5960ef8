"""Link host ops, launches and GPU events of one trace.

- The host op tree, per thread: an op's parent is the innermost op (or annotation) whose
  time span contains it. One pass over the host events sorted by (thread, start, -length)
  with a stack; each op inherits from its parent the attributes the analyses need: the
  nearest op with a perf model (``aten::mm`` under ``aten::linear``), whether it runs
  inside an optimizer step, and the backward node (``autograd::engine::evaluate_function``)
  it runs under. An annotation that names its problem (a grouped GEMM call,
  ``perf_models.annotation_model``) owns everything inside it: the ops under it (the
  per-expert ``aten::mm`` of the loop backend, ``aten::_grouped_mm``) are parts of its
  call, not calls of their own, and their kernels are its kernels. The GEMMs torch runs
  inside an ``aten::_grouped_mm`` (its per-group fallback on the CPU) are likewise parts of
  that call; an annotation inside it (the call routed by ``enable()``) names its problem.
- Launches: each runtime call (``cudaLaunchKernel``, ``cuLaunchKernelEx``,
  ``cudaGraphLaunch``, ``hipLaunchKernel``, ...) gets the innermost op around it. Traces
  without runtime events use the host end of the launch flows (``ac2g``) instead. A step
  marker (``ProfilerStep#N``) is never that op: it times the step, it does not launch
  anything, so a kernel launched directly inside it (a custom extension's or Triton's
  launcher, a graph replay outside any op) has no op and goes by its kernel name.
- GPU events (kernels, memcpy, memset) link to their launch by correlation id; all kernels
  of a CUDA/HIP graph replay carry the graph launch's correlation id. The op around a graph
  launch did not launch each of its kernels: they have no op (each goes by its own kernel
  name), and keep the backward pass and optimizer step they ran in.
- Backward ops link to their forward op through the autograd ``Sequence number``.
- Recomputation (activation checkpointing): an op inside a backward node, below the node's own
  event, with a sequence number of its own, not its node's, is the forward run again (autograd
  records it for a backward to come); the GPU events launched under it are recomputed (``op_recomputed``).
  Where such an op is a backward op (``aten::threshold_backward``), the backward itself is
  being differentiated (``create_graph=True``, ``torch.func``): nothing is taken as recomputed.
  A compiled region's recomputation runs inside its compiled backward and is not seen.
- Steps: a host event belongs to ``ProfilerStep#N`` (an annotation, or a cpu op in 2021
  traces) when it starts inside it. A GPU event belongs to the step of its launch, not of
  its own start: a GPU running behind its host runs step N's kernels during step N+1.
  GPU work without a launch inside the steps (queued before the profiler started, or
  whose launch is not in the trace) is outside every step (-1), reported on its own and
  left out of per-step figures. Only a trace whose GPU events have no launches at all
  (GPU-only traces) places them by their own start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from primus_perf.tracelens import load as L
from primus_perf.tracelens.arrays import order_by_start, unique
from primus_perf.tracelens.perf_models import annotation_model, models, ops_where

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
SHARDING_HOOK = re.compile(r"^(FSDP|fsdp)::")  # FSDP2's hooks (its collectives' own kernels are communication)
_GRAPH_LAUNCH = re.compile(r"GraphLaunch")  # cudaGraphLaunch, hipGraphLaunch, cuGraphLaunch
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
    op_backward: np.ndarray  # per row: an op inside a backward node
    op_step: np.ndarray  # per row: step of host events by start time, -1
    steps: list[int]  # step numbers present
    step_windows: np.ndarray  # (n, 2) host [start, end) per step, in ``steps`` order
    op_recomputed: np.ndarray  # per row: an op of the forward run again inside a backward node
    # per GPU event: launched inside a data-parallel sharding hook (FSDP2's ``FSDP::`` and
    # ``fsdp::`` annotations: the all-gather's copy-in and copy-out, the gradients' reduction and
    # accumulation): work per parameter, once per micro-batch
    in_sharding: np.ndarray


def step_windows(rt: L.RawTrace) -> tuple[list[int], np.ndarray]:
    """The ``ProfilerStep#N`` annotations: step numbers and their [start, end) on the host."""
    ann = np.flatnonzero((rt.kind == L.KIND_ANNOTATION) | (rt.kind == L.KIND_CPU_OP))
    step_code = {c: int(m.group(1)) for c, n in enumerate(rt.names) if (m := _STEP.match(n))}
    found: dict[int, tuple[float, float]] = {}
    for r in ann[np.isin(rt.name[ann], np.fromiter(step_code, dtype=np.int64))].tolist():
        n = step_code[int(rt.name[r])]
        s, e = float(rt.ts[r]), float(rt.ts[r] + rt.dur[r])
        lo, hi = found.get(n, (s, e))
        found[n] = (min(lo, s), max(hi, e))
    steps = sorted(found)
    win = np.array([found[s] for s in steps], dtype=np.float64).reshape(-1, 2)
    return steps, win


def assign_steps(times: np.ndarray, steps: list[int], win: np.ndarray) -> np.ndarray:
    """Step number of each time (-1 outside every window)."""
    out = np.full(len(times), -1, dtype=np.int32)
    if not steps:
        return out
    order = np.argsort(win[:, 0], kind="stable")
    starts, ends = win[order, 0], win[order, 1]
    nums = np.asarray(steps, dtype=np.int32)[order]
    i = np.searchsorted(starts, times, side="right") - 1
    ok = (i >= 0) & (times < ends[np.clip(i, 0, None)])
    out[ok] = nums[i[ok]]
    return out


def by_step(step: np.ndarray) -> dict[int, np.ndarray]:
    """The indices of each step number's entries in ``step`` (in index order), in one sort."""
    if not len(step):
        return {}
    order = np.argsort(step, kind="stable")
    s = step[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    values = s[starts]
    return dict(zip(values.tolist(), np.split(order, starts[1:]), strict=True))


def _nearest(flag: np.ndarray, up: np.ndarray) -> np.ndarray:
    """For each node of a forest (``up``: its parent, -1 for a root), the nearest node at or
    above it with ``flag`` set (-1 if none), by pointer doubling: log(depth) vector passes."""
    nxt = np.where(flag, np.arange(len(flag), dtype=up.dtype), up)
    todo = np.flatnonzero(nxt >= 0)
    todo = todo[~flag[nxt[todo]]]
    while len(todo):
        nxt[todo] = nxt[nxt[todo]]
        todo = todo[nxt[todo] >= 0]
        todo = todo[~flag[nxt[todo]]]
    return nxt


def _stack_parents(thread: np.ndarray, start: np.ndarray, end: np.ndarray, pushed: np.ndarray) -> np.ndarray:
    """The stack pass's parent of each event (sorted by thread, start, -length): per thread,
    pop the stack's top while it has ended by the event's start, then the top is its parent;
    ``pushed`` events are pushed after. That top is the first event that has not ended in
    the chain (previous pushed event, its parent, its parent's parent, ...), so each event's
    candidate starts at the previous pushed event and jumps to its candidate's candidate
    while it has ended: every candidate on the way ended before the event, or is on its
    chain (earlier events start no later), so the candidates converge on the stack's answer,
    in about log(depth) vector passes."""
    n = len(start)
    if not n:
        return np.zeros(0, dtype=np.int32)
    pos = np.arange(n, dtype=np.int32)
    last = np.maximum.accumulate(np.where(pushed, pos, -1))
    up = np.r_[np.int32(-1), last[:-1]].astype(np.int32)
    first = np.maximum.accumulate(np.where(np.r_[True, thread[1:] != thread[:-1]], pos, 0))
    up[up < first] = -1  # the stack is empty at a thread's first event
    del pos, last, first
    todo = np.flatnonzero(up >= 0)
    todo = todo[end[up[todo]] <= start[todo]]
    while len(todo):
        up[todo] = up[up[todo]]
        todo = todo[up[todo] >= 0]
        todo = todo[end[up[todo]] <= start[todo]]
    return up


def _contained(up: np.ndarray, start: np.ndarray, end: np.ndarray, ops: np.ndarray) -> np.ndarray:
    """``up`` with each op that crosses the end of the span it starts in (more than half of it,
    and more than :data:`CROSSING_US`, after that span's end) moved up to the nearest span above
    that holds it: a step marker that a hook inside the optimizer step opened (the profiler's
    step boundary inside ``Optimizer.step#``'s record_function: the whole next step would
    otherwise run "in the optimizer step"), an annotation left open across a step. A span
    that ends a moment after its parent (timestamps rounded) stays inside it."""
    todo = np.flatnonzero(ops & (up >= 0))
    last = end[todo] - np.maximum(CROSSING_US, 0.5 * (end[todo] - start[todo]))  # ends after this: crosses
    keep = end[up[todo]] < last
    todo, last = todo[keep], last[keep]
    while len(todo):
        up[todo] = up[up[todo]]
        keep = up[todo] >= 0
        todo, last = todo[keep], last[keep]
        keep = end[up[todo]] < last
        todo, last = todo[keep], last[keep]
    return up


CROSSING_US = 1.0  # a span ending this much after its parent is still inside it (rounded timestamps)


def _op_tree(rt: L.RawTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The stack pass: (parent, model, shadowed, optimizer, backward root, launch op) per row,
    in vector passes (:func:`_stack_parents`, :func:`_nearest`).

    An op inherits from its parent the nearest model (an op with a perf model and shapes,
    or an annotation that names its problem), whether it is in an optimizer step and its
    backward node. An op that could be a model becomes one unless the model above it is
    an annotation (it owns its inside), or owns its inside (a grouped GEMM op, an attention
    op; an attention op inside an attention op takes over); the model above a new model
    is shadowed by it."""
    n = len(rt)
    kind = rt.kind
    host = np.flatnonzero((kind == L.KIND_CPU_OP) | (kind == L.KIND_ANNOTATION) | (kind == L.KIND_RUNTIME)
                          | (kind == L.KIND_FLOW_START))
    order = host[order_by_start(rt.ts[host], rt.dur[host], rt.thread[host])]
    del host
    names = rt.names
    # ops whose modeled ops inside are part of their call (a grouped GEMM's per-group fallback
    # GEMMs, an attention op's math-path bmms), and those whose op of their kind inside is its
    # own (an attention op's dispatch): the kinds' trace parts say
    flags = {key: np.array([test(nm) for nm in names] + [False], dtype=bool) for key, test in (
        ("modeled", models().__contains__), ("owner", lambda nm: annotation_model(nm) is not None),
        ("owns", ops_where("owns_inside").__contains__), ("takes_over", ops_where("takes_over").__contains__),
        ("optimizer", lambda nm: nm.startswith(OPTIMIZER_PREFIX)),
        ("backward", lambda nm: nm.startswith(BACKWARD_PREFIX)))}
    k = kind[order]
    op_like = (k == L.KIND_CPU_OP) | (k == L.KIND_ANNOTATION)
    del k
    start = rt.ts[order]
    end = start + rt.dur[order]
    up = _contained(_stack_parents(rt.thread[order], start, end, op_like), start, end, op_like)
    del start, end
    name_of = rt.name[order]

    def flag(key: str) -> np.ndarray:
        return flags[key][name_of] & op_like

    optim = _nearest(flag("optimizer"), up) >= 0
    bwd = _nearest(flag("backward"), up)
    owner = flag("owner")
    # which candidates become models, resolved from the top: each against the model above it
    cand = np.flatnonzero(owner | (flag("modeled") & (rt.shape[order] >= 0)))
    is_model = np.zeros(len(order), dtype=bool)
    model_above = np.full(len(order), -1, dtype=np.int32)  # per candidate, once resolved
    if len(cand):
        is_cand = np.zeros(len(order), dtype=bool)
        is_cand[cand] = True
        cand_up = _nearest(is_cand, up)[np.clip(up[cand], 0, None)]  # the nearest candidate above
        cand_up[up[cand] < 0] = -1
        owns_of, att_of = flags["owns"][name_of], flags["takes_over"][name_of]
        done = np.zeros(len(order), dtype=bool)
        todo = np.arange(len(cand))
        while len(todo):
            ready = todo[(cand_up[todo] < 0) | done[np.clip(cand_up[todo], 0, None)]]
            j, c = cand[ready], cand_up[ready]
            m = np.where(c < 0, -1, np.where(is_model[np.clip(c, 0, None)], c, model_above[np.clip(c, 0, None)]))
            has, mm = m >= 0, np.clip(m, 0, None)
            inside = has & owns_of[mm] & ~(att_of[j] & att_of[mm])
            is_model[j] = ~(has & owner[mm]) & (owner[j] | ~inside)
            model_above[j] = m
            done[j] = True
            todo = todo[~done[cand[todo]]]
        shadow = model_above[cand[is_model[cand]]]
    else:
        shadow = np.zeros(0, dtype=np.int32)
    model_pos = _nearest(is_model, up)

    def rows(p: np.ndarray) -> np.ndarray:
        return np.where(p >= 0, order[np.clip(p, 0, None)], -1).astype(np.int32)

    ops = order[op_like]
    up_row = np.full(n, -1, dtype=np.int32)
    up_row[order] = rows(up)
    model = np.full(n, -1, dtype=np.int32)
    model[ops] = rows(model_pos[op_like])
    bwd_root = np.full(n, -1, dtype=np.int32)
    bwd_root[ops] = rows(bwd[op_like])
    optim_row = np.zeros(n, dtype=bool)
    optim_row[ops] = optim[op_like]
    shadowed = np.zeros(n, dtype=bool)
    shadowed[order[shadow[shadow >= 0]]] = True
    op_like_all = (kind == L.KIND_CPU_OP) | (kind == L.KIND_ANNOTATION)
    parent = np.where(op_like_all, up_row, -1).astype(np.int32)
    launch_op = np.where(op_like_all, -1, up_row).astype(np.int32)
    return parent, model, shadowed, optim_row, bwd_root, launch_op


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
    ops = ops[order_by_start(rt.ts[ops], rt.dur[ops])]
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
    step_names = [c for c, nm in enumerate(rt.names) if _STEP.match(nm)]
    if step_names:
        leaf[np.isin(rt.name[np.clip(leaf, 0, None)], step_names) & (leaf >= 0)] = -1
    has_leaf = leaf >= 0
    in_opt = np.where(has_leaf, optim[np.clip(leaf, 0, None)], False)
    root = np.where(has_leaf, bwd_root[np.clip(leaf, 0, None)], -1)
    # a graph replay runs many kernels under one launch: the op around the launch did not
    # launch each of them, so each goes by its own name (its pass and optimizer step kept)
    graph_codes = [c for c, nm in enumerate(rt.names) if _GRAPH_LAUNCH.search(nm)]
    if graph_codes:
        leaf[has & np.isin(rt.name[np.clip(launch, 0, None)], graph_codes)] = -1
        has_leaf = leaf >= 0
    model_op = np.where(has_leaf, model[np.clip(leaf, 0, None)], -1)
    fwd_op = np.full(len(gpu), -1, dtype=np.int64)
    in_bwd = root >= 0
    if in_bwd.any():
        seqs, fwd_rows = _forward_ops(rt, bwd_root)
        fwd_op[in_bwd] = _lookup(seqs, fwd_rows, rt.seq[root[in_bwd]])
    cpu = kind == L.KIND_CPU_OP
    # the node's own event (the root's child) keeps its number, also where the root records none
    again = (cpu & (bwd_root >= 0) & (parent != bwd_root) & (rt.seq >= 0)
             & (rt.seq != rt.seq[np.clip(bwd_root, 0, None)]))
    if again.any() and any("backward" in rt.names[c].lower() for c in unique(rt.name[again]).tolist()):
        again[:] = False  # a backward that is itself differentiated (create_graph, torch.func): not a forward again
    op_recomputed = (_nearest(again, parent) >= 0) if again.any() else np.zeros(len(rt), dtype=bool)
    steps, win = step_windows(rt)
    if has.any():  # the step of the launch; no launch: outside the steps
        step = np.where(has, assign_steps(rt.ts[np.clip(launch, 0, None)], steps, win), -1).astype(np.int32)
    else:  # a GPU-only trace: by the event's own start
        step = assign_steps(rt.ts[gpu], steps, win)
    op_step = assign_steps(rt.ts, steps, win)
    hook_codes = [c for c, nm in enumerate(rt.names) if SHARDING_HOOK.match(nm)]
    in_sharding = np.zeros(len(gpu), dtype=bool)
    ops = (kind == L.KIND_CPU_OP) | (kind == L.KIND_ANNOTATION)
    if hook_codes and has_leaf.any():
        hooked = _nearest(np.isin(rt.name, hook_codes) & ops, parent)
        in_sharding[has_leaf] = hooked[leaf[has_leaf]] >= 0
    return Linked(
        gpu=gpu, launch=launch, leaf_op=leaf, model_op=model_op, fwd_op=fwd_op,
        in_optimizer=in_opt.astype(bool), step=step,
        op_rows=np.flatnonzero(ops),
        op_parent=parent, op_model=model, shadowed=shadowed, op_backward=bwd_root >= 0, op_step=op_step,
        steps=steps, step_windows=win, op_recomputed=op_recomputed, in_sharding=in_sharding,
    )
