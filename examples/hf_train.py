"""Train a Qwen2-style causal LM with Hugging Face transformers in a plain PyTorch loop, as such
scripts are written: the model built by transformers, AdamW, gradient accumulation up to a fixed
global batch, optionally FSDP2 (``fully_shard`` of each decoder layer and the model) under
torchrun. Nothing in it knows about tuning but one line: the micro-batch is a setting it
consents to have tuned, ``primus_perf.knob("micro_batch", 2, choices=...)`` (2 as it is; the
step tuner's value inside a plan, one of the divisors of its global batch), and it derives its
accumulation steps from it.

    python examples/hf_train.py --steps 20                       # 4 layers of Qwen2-7B's dims on a GPU
    torchrun --nproc-per-node 2 examples/hf_train.py --fsdp      # the same under FSDP2 over 2 GPUs
    primus-tune step --out runs/hf -- examples/hf_train.py --steps 1000          # find its plan
    python -m primus_perf.launch --plan runs/hf/plan.yaml -- examples/hf_train.py # run it with the plan

On a GPU the model has Qwen2-7B's dimensions (hidden 3584, 28/4 heads, MLP 18944, vocabulary
152064) with ``--layers`` decoder layers, seq 2048 and a global batch of 8 sequences per rank,
in bf16; on a CPU a small model of the same shape (``--size small``). The data are random
tokens from a fixed seed (the same batches whatever the micro-batch).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import primus_perf

SIZES = {  # hidden, heads, kv heads, MLP, vocabulary, seq
    "7b": (3584, 28, 4, 18944, 152064, 2048),
    "small": (128, 4, 2, 384, 1024, 64),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="7b" if torch.cuda.is_available() else "small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the size's)")
    ap.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step, per rank")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2: fully_shard each decoder layer and the model")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    args = parse(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    hidden, heads, kv_heads, mlp, vocab, seq = SIZES[args.size]
    seq = args.seq or seq
    config = Qwen2Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=mlp, vocab_size=vocab, num_hidden_layers=args.layers,
                         max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # sequences per forward and backward: 2 as written, the step tuner's choice inside a plan;
    # the global batch (the recipe) stays, the accumulation steps follow
    micro = primus_perf.knob("micro_batch", 2, choices=[m for m in range(1, args.global_batch + 1)
                                                         if args.global_batch % m == 0])
    accumulation = args.global_batch // micro
    generator = torch.Generator().manual_seed(1234 + rank)
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = torch.randint(0, vocab, (args.global_batch, seq), generator=generator).to(device)
        total = 0.0
        for i in range(accumulation):
            tokens = batch[i * micro:(i + 1) * micro]
            loss = model(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0 and (step < 3 or step % 10 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {float(total):.4f}, {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
