"""The shared vocabulary: one problem type per kind, the dtype names they use, and the
problems files that carry them between commands.

- ``dtypes``: canonical dtype names, element sizes, user spellings, torch dtypes.
- ``gemm``: :class:`GemmProblem` (and the BLAS column-major convention, documented once).
- ``grouped``: :class:`GroupedGemmProblem` (MoE expert layers; token-distribution buckets).
- ``attention``: :class:`AttentionProblem`.
- ``fp8``: :class:`Fp8PlanProblem` (which linear layers of a model run FP8: a plan's problem).
- ``files``: problems files (``load_problems``, ``problem_from_item``).
- ``trace_names``: the name a grouped GEMM call records in a profiler trace.

tracelens emits the problems from a trace, the tuners search them, the cache stores results
by their ``key()``, and the routers look them up: every problem type is a frozen dataclass
with a canonical string key and a plain-dict form for JSON, and names its kind
(``problem.kind``). This package re-exports every public name of its modules.
"""

from __future__ import annotations

from primus_perf.problems.attention import AttentionProblem
from primus_perf.problems.base import (
    ProblemType,
    dataclass_from_dict,
    forget_problem_type,
    problem_type,
    problem_types,
)
from primus_perf.problems.dtypes import (
    DTYPE_ALIASES,
    DTYPE_BYTES,
    canonical_dtype,
    default_compute,
    dtype_name,
    torch_dtype,
)
from primus_perf.problems.files import (
    MAX_PROBLEMS_BYTES,
    PROBLEMS_SCHEMA,
    Problem,
    load_problems,
    problem_from_item,
)
from primus_perf.problems.fp8 import Fp8PlanProblem
from primus_perf.problems.gemm import GemmProblem, Operand, operand_layout
from primus_perf.problems.grouped import (
    GROUPED_PASSES,
    GroupedGemmProblem,
    GroupedMmCall,
    grouped_mm_call,
    skew_bucket,
    skew_buckets,
    tokens_bucket,
)
from primus_perf.problems.trace_names import (
    GROUPED_TRACE_OP,
    grouped_trace_name,
    parse_grouped_trace_name,
)

__all__ = [
    "DTYPE_ALIASES", "DTYPE_BYTES", "GROUPED_PASSES", "GROUPED_TRACE_OP", "MAX_PROBLEMS_BYTES", "PROBLEMS_SCHEMA",
    "AttentionProblem", "Fp8PlanProblem", "GemmProblem", "GroupedGemmProblem", "GroupedMmCall", "Operand", "Problem", "ProblemType",
    "canonical_dtype", "dataclass_from_dict", "default_compute", "dtype_name", "forget_problem_type", "grouped_mm_call",
    "grouped_trace_name",
    "load_problems", "operand_layout", "parse_grouped_trace_name", "problem_from_item", "problem_type",
    "problem_types", "skew_bucket", "skew_buckets", "tokens_bucket", "torch_dtype",
]
