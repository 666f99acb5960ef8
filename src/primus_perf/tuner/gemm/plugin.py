"""The GEMM kind of the tuner core: torch's own choice (the default), the cuBLASLt/hipBLASLt
heuristic's top candidates (optionally widened with split-K variants), and any extra
candidates a caller plants; validated against an fp32 product, timed call by call in
isolation (the core's timer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from primus_perf.base.devices import require_gpu
from primus_perf.base.errors import UserError
from primus_perf.kernels.blaslt.binding import BlasLt, Plan, load
from primus_perf.kernels.blaslt.guarded import GUARD_BYTES, GuardedMatrix, GuardError
from primus_perf.kernels.blaslt.layout import layouts, refusal
from primus_perf.kernels.gemm import WORKSPACE_BYTES, library_versions
from primus_perf.problems import GemmProblem
from primus_perf.tuner import measure
from primus_perf.tuner.core import Candidate, Reps, Step
from primus_perf.tuner.measure import Timer

TUNER_VERSION = "gemm-3"  # 3: the core's loop and selection; 2: isolated timing
TOLERANCE = {"bf16": 2e-2, "f16": 5e-3, "f32": 1e-4, "tf32": 5e-3, "f64": 1e-10}
DEFAULT = "torch"


class Operands:
    """Rotating sets of A, B and D for one problem, each laid out exactly as the problem
    says (transposes, leading dimensions, batch count and batch strides: the layout the
    BLAS-Lt plan describes, ``kernels.blaslt.layout``) over its own buffer sized from that
    layout's extent plus ``guard_bytes`` of guard (``kernels.blaslt.guarded``).

    ``a[i] @ b[i]`` (``torch.bmm`` when batched) is the problem's product in torch's terms,
    written to ``d[i]``; ``mats[i]`` holds the guarded buffers (BLAS names: ``"a"``, ``"b"``,
    ``"d"``; torch's ``a`` is BLAS B) for the pointer a library candidate is given and for the
    checks after a validation call."""

    def __init__(self, p: GemmProblem, seed: int = 0, device: str = "cuda", sets: int | None = None,
                 guard_bytes: int = GUARD_BYTES) -> None:
        import torch

        la, lb, _, ld = layouts(p)
        self.n = sets or measure.buffer_sets(la.extent_bytes() + lb.extent_bytes() + ld.extent_bytes())
        g = torch.Generator(device=device).manual_seed(seed)
        self.a, self.b, self.d, self.mats = [], [], [], []
        for _ in range(self.n):
            mats = {"a": GuardedMatrix(la, device, guard_bytes), "b": GuardedMatrix(lb, device, guard_bytes),
                    "d": GuardedMatrix(ld, device, guard_bytes)}
            mats["a"].fill_random(g)
            mats["b"].fill_random(g)
            mats["d"].reset(0.0)
            self.mats.append(mats)
            # torch's a[M, K] is BLAS op(B)^T, torch's b[K, N] is op(A)^T, torch's d is D^T
            self.a.append(mats["b"].torch_view(p.trans_b))
            self.b.append(mats["a"].torch_view(p.trans_a))
            self.d.append(mats["d"].view)
        for name in ("a", "b"):
            self.mats[0][name].save()

    def pointers(self, i: int) -> tuple[int, int, int]:
        """BLAS A, B and D pointers of set ``i``."""
        m = self.mats[i]
        return m["a"].storage.data_ptr(), m["b"].storage.data_ptr(), m["d"].storage.data_ptr()

    def touched(self, i: int = 0) -> list[str]:
        """What the last call on set ``i`` wrote outside its output's elements (or into an
        input); set 0 (the validation set) also checks its inputs."""
        return [why for m in self.mats[i].values() if (why := m.touched()) is not None]


def torch_product(a: Any, b: Any, out: Any) -> Any:
    """torch's own GEMM of the operands as they are (``torch.bmm`` when batched), into ``out``."""
    import torch

    return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out=out)


def solution_index(algo: bytes, offset: int) -> int:
    """The library's solution index stored in an algo struct (hipBLASLt)."""
    return int.from_bytes(algo[offset:offset + 4], "little", signed=True)


def library_pool(plan: Plan, widen: bool = False) -> list[Candidate]:
    """The heuristic's candidates for a plan, without repeats; with ``widen``, split-K
    variants of the top three (where the library has an algo config API)."""
    t = plan.lt.t
    pool: list[Candidate] = []
    seen: set[bytes] = set()
    for i, h in enumerate(plan.heuristics(t.heuristic_count, WORKSPACE_BYTES)):
        if h.algo in seen:
            continue
        seen.add(h.algo)
        config: dict[str, Any] = {"source": t.source, "workspace": h.workspace, **plan.algo_config(h.algo)}
        if t.solution_index_offset is not None:
            config["solution_index"] = solution_index(h.algo, t.solution_index_offset)
        pool.append(Candidate(f"heur{i}", config, h.algo))
    if widen and t.algo_config_attr:
        for c in list(pool[:3]):
            for splitk in (2, 4):
                v = plan.with_config(c.blob, SPLITK_NUM=splitk, REDUCTION_SCHEME=1)
                if v and v[0] not in seen and v[1] <= WORKSPACE_BYTES:
                    seen.add(v[0])
                    config = {"source": t.source, "workspace": v[1], **plan.algo_config(v[0])}
                    pool.append(Candidate(f"{c.name}-splitk{splitk}", config, v[0]))
    return pool


def python_candidate(name: str, fn: Callable[[Any, Any, Any], object]) -> Candidate:
    """A candidate computing ``fn(a, b, out)`` (torch layout operands): for experiments and
    tests (a planted wrong candidate must lose)."""
    return Candidate(name, {"source": "python"}, run=fn)


class GemmTuner:
    """cuBLASLt/hipBLASLt algorithms against torch's own choice. ``library``: the BLAS-Lt
    loader (None: torch and ``extra`` candidates only); ``device``: where operands live;
    ``sets``: input sets per problem (None: enough to exceed L2; online tuning, which only
    validates here, takes 1)."""

    kind = GemmProblem.kind
    version = TUNER_VERSION
    problem_type = GemmProblem
    reps = Reps(rough=5, final_min=10, final_max=40)

    def __init__(
        self,
        *,
        widen: bool = False,
        library: Callable[[], BlasLt] | None = load,
        extra: Sequence[Candidate] = (),
        device: str = "cuda",
        sets: int | None = None,
    ) -> None:
        self.sets = sets
        self.widen = widen
        self.library = library
        self.extra = list(extra)
        self.device = device

    def versions(self) -> dict[str, str]:
        return library_versions(self.library()) if self.library is not None else {}

    def check(self, problem: GemmProblem) -> None:
        key = problem.compute if problem.compute == "tf32" else problem.dtype_a
        if key not in TOLERANCE:
            raise UserError(f"{problem}: GEMM tuning has no reference tolerance for {key}")

    def open(self, problem: GemmProblem, timer: Timer, step: Step) -> GemmSession:
        return GemmSession(self, problem)


class GemmSession:
    """Candidates of one problem on :class:`Operands` of its exact layout. A problem whose
    layout no BLAS-Lt kernel may be given (``blaslt.layout.refusal``) gets no library
    candidates (``details["refused"]`` says why); a candidate that writes outside its output
    in validation is rejected (:class:`~primus_perf.kernels.blaslt.guarded.GuardError`) and
    named in ``details["guard"]``."""

    def __init__(self, tuner: GemmTuner, problem: GemmProblem) -> None:
        import torch

        if tuner.device != "cpu":
            require_gpu()
        self.tuner = tuner
        self.problem = problem
        self.ops = Operands(problem, device=tuner.device, sets=tuner.sets)
        self.n_sets = self.ops.n
        self.tolerance = TOLERANCE[problem.compute if problem.compute == "tf32" else problem.dtype_a]
        self.details: dict[str, Any] = {}
        refused = refusal(problem)
        if refused:
            self.details["refused"] = refused
        library = tuner.library if not refused else None
        self.plan: Plan | None = library().plan(problem) if library is not None else None
        self.ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=tuner.device) if self.plan else None
        self._ref: Any = None
        self._ref_norm = 1.0

    def candidates(self) -> list[Candidate]:
        pool = [Candidate(DEFAULT, {"source": "torch"})]
        if self.plan is not None:
            pool += library_pool(self.plan, self.tuner.widen)
        return pool + self.tuner.extra

    def _runner(self, c: Candidate) -> Callable[[int], object]:
        import torch

        ops = self.ops
        if c.run is not None:
            return lambda i: c.run(ops.a[i], ops.b[i], ops.d[i])
        if not c.blob:
            return lambda i: torch_product(ops.a[i], ops.b[i], ops.d[i])
        plan, ws = self.plan, self.ws
        assert plan is not None and ws is not None  # library candidates come from the plan
        launch = plan.launcher(c.blob, WORKSPACE_BYTES)
        stream = torch.cuda.current_stream().cuda_stream
        ptrs = [ops.pointers(i) for i in range(ops.n)]
        ws_ptr = ws.data_ptr()
        return lambda i: launch(ptrs[i][0], ptrs[i][1], ptrs[i][2], ws_ptr, stream)

    def error(self, c: Candidate) -> float:
        """Relative error of one call on set 0 against the fp32 product (per batch when
        batched); GuardError when the call wrote outside its output or into an input."""
        import torch

        ops = self.ops
        if self._ref is None:
            self._ref = torch.matmul(ops.a[0].float(), ops.b[0].float())
            self._ref_norm = self._ref.norm().item() or 1.0
        ops.mats[0]["d"].reset(float("nan"))
        self._runner(c)(0)
        if ops.d[0].is_cuda:
            torch.cuda.synchronize()
        touched = ops.touched(0)
        if touched:
            self.details.setdefault("guard", {})[c.name] = touched
            raise GuardError(f"{c.name} on {self.problem.key()}: " + "; ".join(touched))
        return (ops.d[0].float() - self._ref).norm().item() / self._ref_norm

    def calls(self, c: Candidate) -> dict[str, Callable[[int], object]]:
        return {"gemm": self._runner(c)}

    def close(self) -> None:
        if self.plan is not None:
            self.plan.close()
