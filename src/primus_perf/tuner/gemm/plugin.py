"""The GEMM kind of the tuner core: torch's own choice (the default), the cuBLASLt/hipBLASLt
heuristic's top candidates (optionally widened with split-K variants), and any extra
candidates a caller plants; validated against an fp32 product, timed call by call in
isolation (the core's timer)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from primus_perf.devices import require_gpu
from primus_perf.errors import UserError
from primus_perf.kernels.blaslt.binding import BlasLt, Plan, load
from primus_perf.kernels.gemm import WORKSPACE_BYTES, library_versions
from primus_perf.problems import GemmProblem, torch_dtype
from primus_perf.tuner import timing
from primus_perf.tuner.core import Candidate, Reps, Step
from primus_perf.tuner.timing import Timer

TUNER_VERSION = "gemm-3"  # 3: the core's loop and selection; 2: isolated timing
TOLERANCE = {"bf16": 2e-2, "f16": 5e-3, "f32": 1e-4, "tf32": 5e-3, "f64": 1e-10}
DEFAULT = "torch"


class Operands:
    """Rotating sets of inputs and outputs for one problem, in the torch layout the trainer uses."""

    def __init__(self, p: GemmProblem, seed: int = 0, device: str = "cuda", sets: int | None = None) -> None:
        import torch

        M, N, K, at, bt = p.row_major_shapes()
        dt = torch_dtype(p.dtype_a)
        g = torch.Generator(device=device).manual_seed(seed)
        per_set = (M * K + K * N + M * N) * torch.empty((), dtype=dt).element_size()
        self.n = sets or timing.buffer_sets(per_set)
        self.a, self.b, self.d = [], [], []
        for _ in range(self.n):
            a = torch.randn(*((K, M) if at else (M, K)), device=device, dtype=dt, generator=g)
            b = torch.randn(*((N, K) if bt else (K, N)), device=device, dtype=dt, generator=g)
            self.a.append(a.T if at else a)
            self.b.append(b.T if bt else b)
            self.d.append(torch.empty(M, N, device=device, dtype=torch_dtype(p.dtype_d)))


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
        self.plan: Plan | None = tuner.library().plan(problem) if tuner.library is not None else None
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
            return lambda i: torch.mm(ops.a[i], ops.b[i], out=ops.d[i])
        plan, ws = self.plan, self.ws
        assert plan is not None and ws is not None  # library candidates come from the plan
        stream = torch.cuda.current_stream().cuda_stream
        return lambda i: plan.run(c.blob, ops.b[i].data_ptr(), ops.a[i].data_ptr(), ops.d[i].data_ptr(),
                                  ws.data_ptr(), WORKSPACE_BYTES, stream)

    def error(self, c: Candidate) -> float:
        import torch

        ops = self.ops
        if self._ref is None:
            self._ref = ops.a[0].float() @ ops.b[0].float()
            self._ref_norm = self._ref.norm().item() or 1.0
        ops.d[0].fill_(float("nan"))
        self._runner(c)(0)
        if ops.d[0].is_cuda:
            torch.cuda.synchronize()
        return (ops.d[0].float() - self._ref).norm().item() / self._ref_norm

    def calls(self, c: Candidate) -> dict[str, Callable[[int], object]]:
        return {"gemm": self._runner(c)}

    def close(self) -> None:
        if self.plan is not None:
            self.plan.close()
