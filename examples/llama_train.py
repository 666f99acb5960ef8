"""A plain PyTorch Llama-style training script that uses a primus-perf tuning cache.

Nothing in the model knows about primus-perf: ``primus_perf.enable(cache)`` routes its
forward, input-gradient and weight-gradient GEMMs and its SDPA calls to the cached
choices. ``--check`` prints the routed-call counts next to what the model issues per step
(3 GEMMs per linear layer, 1 attention call per layer) and exits 1 on a mismatch.

    python examples/llama_train.py --cache tuning_cache.json --steps 20 --check
    python examples/llama_train.py --cache new_cache.json --online      # tune in the run (GPU)
    python examples/llama_train.py --steps 20                           # torch's default

The size follows the machine: on a GPU, 4 layers of Llama-3 8B (dim 4096, 32/8 heads,
hidden 14336, seq 4096); on a CPU, a small model of the same shape (dim 256, seq 128, a
few steps in seconds). ``--size 8b`` or ``--size small`` chooses either on
any machine, and ``--layers``, ``--dim``, ... change one dimension. The same script runs
without the ``--cache`` line under
``python -m primus_perf.launch --cache tuning_cache.json -- examples/llama_train.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    LINEARS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w3, w2

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def calls_per_step(self) -> dict[str, int]:
        """GEMMs (forward, input gradient, weight gradient of every linear) and SDPA calls."""
        linears = self.LINEARS_PER_BLOCK * len(self.blocks) + 1
        return {"gemm": 3 * linears, "attention": len(self.blocks)}


# 4 layers of Llama-3 8B, and a small model of the same shape for a CPU
SIZES = {
    "8b": {"layers": 4, "dim": 4096, "heads": 32, "kv_heads": 8, "hidden": 14336, "vocab": 32000, "seq": 4096},
    "small": {"layers": 2, "dim": 256, "heads": 4, "kv_heads": 2, "hidden": 512, "vocab": 1024, "seq": 128},
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", help="tuning cache for primus_perf.enable (none: torch's default)")
    ap.add_argument("--online", action="store_true", help="tune new problems in the first steps")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", choices=sorted(SIZES), default="8b" if torch.cuda.is_available() else "small",
                    help="model size (default: 8b on a GPU, small on a CPU)")
    for name in SIZES["8b"]:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the size's {name}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--check", action="store_true", help="compare routed-call counts with the model's calls")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.hidden, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.device == "cuda")
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, i: int) -> float:
    """One training step; its time in seconds (synchronized)."""
    g = torch.Generator(device="cpu").manual_seed(i)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(args.device)
    t0 = time.perf_counter()
    autocast = torch.autocast("cuda", torch.bfloat16) if args.device == "cuda" else contextlib.nullcontext()
    with autocast:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    model, opt = build(args)
    run_model = torch.compile(model) if args.compile else model
    handle = None
    if args.cache:
        import primus_perf

        handle = primus_perf.enable(args.cache, online=args.online)
    try:
        times = [step(run_model, opt, args, i) for i in range(args.steps)]
    finally:
        summary = handle.summary() if handle is not None else None
        if handle is not None:
            handle.disable()
    med = sorted(times)[len(times) // 2]
    print(f"{args.steps} steps, median {med * 1e3:.1f} ms/step, {args.batch * args.seq / med:.0f} tokens/s")
    if summary is None:
        return 0
    for kind, row in summary.items():
        if row["available"]:
            print(f"{kind}: {row['routed']} routed, {row['fallback']} fell back, {row['stale']} stale entries")
        else:
            print(f"{kind}: not routed ({row['note']})")
    if not args.check:
        return 0
    expected = {k: v * args.steps for k, v in model.calls_per_step().items()}
    ok = True
    for kind, want in expected.items():
        row = summary.get(kind, {})
        if not row.get("available"):
            print(f"check {kind}: not routed ({row.get('note', 'not in the summary')}), nothing to compare")
            continue
        if not row.get("intercepted", True):
            print(f"check {kind}: every entry is torch's own kernel, so no override counts the calls: nothing to compare")
            continue
        seen = row.get("routed", 0) + row.get("fallback", 0) + sum(row.get("tuning", {}).values())
        good = seen == want
        ok &= good
        print(f"check {kind}: {seen} calls seen, the model issues {want} ({'ok' if good else 'MISMATCH'});"
              f" {row.get('routed', 0)} used a cached choice")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
