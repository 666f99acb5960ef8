"""A plain Hugging Face transformers MoE training loop (no primus-perf in it).

The model is built from a config (no download) with ``experts_implementation="grouped_mm"``,
the setting transformers recommends for training: each MoE layer's experts are
``torch._grouped_mm`` / ``F.grouped_mm`` calls with ``offs``, forward and (through
autograd) backward. Qwen3-MoE by default; ``--model mixtral`` and ``--model deepseek-v3``
select the others. Small on the CPU by default; ``--preset h100`` gives GPU sizes (bf16).

    python examples/hf_moe_train.py --steps 5
    python examples/hf_moe_train.py --preset h100 --steps 30 --profile traces/qwen
    python -m primus_perf.launch --cache tuning_cache.json -- examples/hf_moe_train.py --preset h100

Each step prints its time and loss; the last line is JSON (``step_ms``, ``losses``, the
model and its sizes). ``--profile DIR`` records steps 2 and 3 with torch.profiler
(``record_shapes``) into ``DIR/hf_moe_trace.json``: ``primus-profile analyze`` lists its
grouped GEMM problems and ``primus-tune grouped-gemm --trace DIR`` tunes them. Taken
under ``python -m primus_perf.launch`` (any cache, even an empty file) the trace names
each grouped call's exact token split, which the tuner needs to tune the problems the
run will route; a plain trace records shapes only (an even split is assumed).

transformers is an optional dependency: ``pip install 'primus-perf[hf]'``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

# per model: (config class, model class, CPU sizes, H100 sizes); sizes are config fields
MODELS: dict[str, dict[str, Any]] = {
    "qwen3-moe": {
        "classes": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
                    vocab_size=256),
        "h100": dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     intermediate_size=6144, vocab_size=32000),
        "seq": {"cpu": 32, "h100": 4096},
    },
    "mixtral": {
        "classes": ("MixtralConfig", "MixtralForCausalLM"),
        "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, vocab_size=256),
        "h100": dict(hidden_size=4096, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                     vocab_size=32000),
        "seq": {"cpu": 32, "h100": 4096},
    },
    "deepseek-v3": {
        "classes": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "cpu": dict(hidden_size=64, num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=4,
                    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                    v_head_dim=16, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
                    topk_group=2, moe_intermediate_size=32, intermediate_size=128, vocab_size=256),
        "h100": dict(hidden_size=4096, num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=32,
                     num_key_value_heads=32, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                     qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=48, n_shared_experts=1,
                     num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=2048,
                     intermediate_size=11008, vocab_size=32000),
        "seq": {"cpu": 32, "h100": 4096},
    },
}
PROFILED_STEPS = (2, 3)  # 1-based steps recorded by --profile (step 1 warms up)


def build(model: str, preset: str, layers: int | None, experts: int | None, dtype: torch.dtype,
          device: torch.device) -> torch.nn.Module:
    import transformers

    spec = MODELS[model]
    config_cls, model_cls = (getattr(transformers, name) for name in spec["classes"])
    sizes = dict(spec[preset])
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    if experts is not None:
        key = next(k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in sizes)
        sizes[key] = experts
    config = config_cls(**sizes, experts_implementation="grouped_mm", attn_implementation="sdpa", use_cache=False)
    with torch.device(device):
        net = model_cls(config)
    return net.to(dtype).train()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-moe")
    p.add_argument("--preset", choices=("cpu", "h100"), default=None,
                   help="sizes: cpu (tiny) or h100 (default: h100 where a GPU is visible, else cpu)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    p.add_argument("--experts", type=int, default=None, help="routed experts (default: the preset's)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=Path, default=None, help="record steps 2-3 into DIR/hf_moe_trace.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        p.error("--steps and --batch must be at least 1")
    if args.profile is not None and args.steps < PROFILED_STEPS[-1]:
        p.error(f"--profile records steps {PROFILED_STEPS}: give --steps {PROFILED_STEPS[-1]} or more")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    preset = args.preset or ("h100" if device.type == "cuda" else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    seq = args.seq or MODELS[args.model]["seq"][preset]

    torch.manual_seed(args.seed)
    model = build(args.model, preset, args.layers, args.experts, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = [torch.randint(0, vocab, (args.batch, seq), generator=gen).to(device) for _ in range(args.steps)]

    prof = None
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        out = args.profile / "hf_moe_trace.json"
        prof = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(wait=PROFILED_STEPS[0] - 1, warmup=0, active=len(PROFILED_STEPS)),
            on_trace_ready=lambda pr: pr.export_chrome_trace(str(out)))
        prof.start()

    step_ms, losses = [], []
    for i, ids in enumerate(batches, start=1):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        ms = (time.perf_counter() - t0) * 1e3
        step_ms.append(round(ms, 3))
        losses.append(float(loss.detach()))
        print(f"step {i}/{args.steps}: {ms:9.2f} ms  loss {losses[-1]:.4f}", flush=True)
        if prof is not None:
            prof.step()
            if i == PROFILED_STEPS[-1]:
                prof.stop()
                prof = None
                print(f"trace written: {args.profile / 'hf_moe_trace.json'}", flush=True)
    if prof is not None:
        prof.stop()
    sizes = {k: getattr(model.config, k) for k in MODELS[args.model][preset]}
    print(json.dumps({"model": args.model, "preset": preset, "device": str(device), "dtype": str(dtype).split(".")[-1],
                      "seq": seq, "batch": args.batch, "sizes": sizes, "step_ms": step_ms, "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
