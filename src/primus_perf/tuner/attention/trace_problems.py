"""Attention problems from a Kineto trace (torch.profiler with ``record_shapes=True``).

SDPA ops record their inputs in torch's (batch, heads, seq, head_dim) order; the problems
are returned in the trainer's layout ("bshd"), the one the tuner and the router use. The
causal flag is read from the op's concrete inputs when the profiler recorded them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from primus_perf.errors import TraceError
from primus_perf.problems import AttentionProblem, dtype_name

SDPA_OPS = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::scaled_dot_product_attention",
)
# index of is_causal among each op's arguments
_CAUSAL_ARG = {
    "aten::_scaled_dot_product_flash_attention": 4,
    "aten::_scaled_dot_product_cudnn_attention": 6,
    "aten::_scaled_dot_product_efficient_attention": 6,
    "aten::_scaled_dot_product_flash_attention_for_cpu": 4,
    "aten::scaled_dot_product_attention": 5,
}


def _load(path: Path) -> dict:
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        data = json.loads(raw)
    except FileNotFoundError:
        raise TraceError(f"trace not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise TraceError(f"{path} is not a Kineto trace (no traceEvents)")
    return data


def problems_from_trace(path: str | Path) -> dict[AttentionProblem, int]:
    """Distinct attention problems of a trace and how often each ran."""
    data = _load(Path(path))
    found: dict[AttentionProblem, dict[str, int]] = {}
    for ev in data["traceEvents"]:
        name = ev.get("name") if isinstance(ev, dict) else None
        if name not in SDPA_OPS:
            continue
        args = ev.get("args") or {}
        dims = args.get("Input Dims") or []
        types = args.get("Input type") or []
        if len(dims) < 3 or any(len(d) != 4 for d in dims[:3]):
            continue
        (b, hq, sq, d), (_, hkv, skv, _) = dims[0], dims[1]
        concrete = args.get("Concrete Inputs") or []
        idx = _CAUSAL_ARG[name]
        causal = str(concrete[idx]).lower() in ("true", "1") if len(concrete) > idx else True
        try:
            prob = AttentionProblem(
                batch=int(b), heads_q=int(hq), heads_kv=int(hkv), seq_q=int(sq), seq_kv=int(skv),
                head_dim=int(d), dtype=dtype_name(types[0]) if types else "bf16", causal=causal,
                layout="bshd",
            )
        except ValueError:
            continue
        per_op = found.setdefault(prob, {})
        per_op[name] = per_op.get(name, 0) + 1
    # the public op and the backend op it calls describe one call: keep the larger count
    return {prob: max(per_op.values()) for prob, per_op in found.items()}
