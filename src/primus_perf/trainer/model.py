"""A Llama-3-style decoder in plain PyTorch.

Token embedding, RMSNorm, rotary embeddings (rotate-half form), grouped-query attention
with a fused Q/K/V projection (optional Q/K/V bias, as in Qwen2.5), SwiGLU MLP with a fused
gate/up projection, untied output head. The model calls plain PyTorch ops: every linear
layer is ``F.linear`` (:func:`linear`; a weight tagged for FP8 runs its recipe instead) and
attention is ``F.scaled_dot_product_attention``; the runtime's overrides route them where a
tuning cache is enabled.

The modules are plain: they call no collective and import nothing of parallelism.
``parallelize.py`` applies tensor parallelism from outside: it shards the weights and swaps
:class:`Attention`, :class:`MLP`, :class:`Embedding` and the root's :meth:`Transformer.head`
for versions that add the collectives (``tensor_parallel.py``); it sets ``n_heads`` and
``n_kv_heads`` to the local heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from primus_perf.kernels.attention.backends import sdpa_bshd
from primus_perf.kernels.fp8.linear import TAG
from primus_perf.trainer.config import ModelConfig


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear``); a weight tagged for FP8 (``kernels.fp8.linear``) runs
    its recipe instead."""
    fp8 = getattr(weight, TAG, None)
    return F.linear(x, weight) if fp8 is None else fp8(x, weight)


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (seq_len, head_dim // 2), float32."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    )
    pos = torch.arange(seq_len, device=device, dtype=torch.float64)
    ang = torch.outer(pos, inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position (rotate-half convention)."""
    half = x.shape[-1] // 2
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    sdpa_backend: str | None = None  # a row of kernels.attention.backends.SDPA_BACKENDS; None: torch picks

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads  # local (per tensor-parallel rank) after parallelize
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Parameter(torch.empty(qkv_out, cfg.dim))
        self.bqkv = nn.Parameter(torch.zeros(qkv_out)) if cfg.qkv_bias else None
        self.wo = nn.Parameter(torch.empty(cfg.dim, cfg.n_heads * cfg.head_dim))
        self.rope = apply_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hq, hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = linear(x, self.wqkv)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv.to(qkv.dtype)
        q, k, v = qkv.split((hq * hd, hkv * hd, hkv * hd), dim=-1)
        q = self.rope(q.view(b, s, hq, hd), cos, sin)
        k = self.rope(k.view(b, s, hkv, hd), cos, sin)
        v = v.view(b, s, hkv, hd)
        o = sdpa_bshd(q, k, v, True, self.sdpa_backend)
        return linear(o.reshape(b, s, hq * hd), self.wo)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(2 * cfg.ffn_dim, cfg.dim))  # [gate; up]
        self.w2 = nn.Parameter(torch.empty(cfg.dim, cfg.ffn_dim))
        self.act = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(linear(x, self.w13))
        return linear(h, self.w2)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w13, std=std)
        nn.init.normal_(self.w2, std=out_std)


def _saved_ops() -> frozenset:
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_grouped_mm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu")
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


def _keep_gemm_outputs() -> tuple:
    """Selective recompute's checkpoint contexts: the GEMMs' and attention's outputs are
    saved, everything else recomputed (torch's selective activation checkpointing)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals; ``mlp`` replaces the dense SwiGLU MLP
    (an MoE layer: any module with ``forward(x)`` and ``reset_parameters(std, out_std)``)."""

    def __init__(self, cfg: ModelConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg) if mlp is None else mlp
        self.recompute = "none"  # activation recompute: none, selective, full (Transformer.recompute)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.attention.wqkv, std=std)
        if self.attention.bqkv is not None:
            self.attention.bqkv.zero_()
        nn.init.normal_(self.attention.wo, std=out_std)
        self.mlp.reset_parameters(std, out_std)
        self.attention_norm.weight.fill_(1.0)
        self.mlp_norm.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """With ``recompute`` the block's activations are recomputed in backward: all of them
        (``full``: the block's input is kept), or all but the GEMMs' and attention's outputs
        (``selective``: the norms and elementwise work are recomputed). The checkpoint is
        taken inside the block's call, so hooks on the block (FSDP2's parameter all-gather)
        run once around it, not again in the recomputation."""
        if self.recompute != "none" and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            kw = {"context_fn": _keep_gemm_outputs} if self.recompute == "selective" else {}
            return checkpoint(self._body, x, cos, sin, use_reentrant=False, **kw)
        return self._body(x, cos, sin)

    def _body(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class Embedding(nn.Module):
    """Token embedding (its weight left uninitialized until ``reset_parameters``)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, self.make_mlp(i)) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))
        self._rope_cache: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from torch's global RNG, in a fixed order (seed it first)."""
        cfg = self.cfg
        std = cfg.init_std
        out_std = std / math.sqrt(2 * cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for block in self.layers:
            block.reset_parameters(std, out_std)
        self.norm.weight.fill_(1.0)
        nn.init.normal_(self.output, std=cfg.dim**-0.5)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """The MLP of layer ``layer``; None: the dense SwiGLU MLP (the MoE model overrides
        this)."""
        return None

    @property
    def recompute(self) -> str:
        """Activation recompute per transformer block: none, selective or full."""
        return self.layers[0].recompute if len(self.layers) else "none"

    @recompute.setter
    def recompute(self, mode: str | bool) -> None:
        mode = {True: "full", False: "none"}.get(mode, mode) if isinstance(mode, bool) else mode
        if mode not in ("none", "selective", "full"):
            raise ValueError(f"recompute {mode!r}: one of none, selective, full")
        for block in self.layers:
            block.recompute = mode

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, device)
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(
                seq_len, self.cfg.head_dim, self.cfg.rope_theta, device
            )
        return self._rope_cache[key]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab)."""
        cos, sin = self.rope(ids.shape[1], ids.device)
        x = self.tok_embeddings(ids)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.head(self.norm(x))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The output head: normed hidden states -> logits (batch, seq, vocab)."""
        return linear(h, self.output)

    def set_sdpa_backend(self, backend: str | None) -> None:
        """Restrict every attention's SDPA to one backend (a row of ``SDPA_BACKENDS``; None:
        torch picks)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.sdpa_backend = backend

    @property
    def compile_scope(self) -> str:
        """What is compiled: off, pointwise or block (``train.compile``)."""
        return getattr(self, "_compile_scope", "off")

    def set_compile(self, scope: str) -> None:
        """Compile ``block`` (each transformer block whole, its GEMMs included: where a tuning
        cache routes them, the runtime's Inductor pass swaps them for its routed ops; an MoE
        block breaks its graph where it reads the token counts on the host), ``pointwise``
        (RoPE, SwiGLU and RMSNorm; the GEMMs stay eager) or nothing (``off``). Switchable
        between steps: each scope's compiled callables are made once and kept, so switching
        back compiles nothing again."""
        if scope not in ("off", "pointwise", "block"):
            raise ValueError(f"compile {scope!r}: one of off, pointwise, block")
        kept = self.__dict__.setdefault("_compiled", {})
        if scope == "block" and "block" not in kept:
            kept["block"] = [torch.compile(b._call_impl, dynamic=False) for b in self.layers]
        if scope == "pointwise" and "pointwise" not in kept:
            norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
            kept["pointwise"] = (torch.compile(apply_rope, dynamic=False), torch.compile(swiglu, dynamic=False),
                                 {id(m): torch.compile(m.forward, dynamic=False) for m in norms})
        for i, block in enumerate(self.layers):
            block._compiled_call_impl = kept["block"][i] if scope == "block" else None
        rope, act, norms = kept["pointwise"] if scope == "pointwise" else (apply_rope, swiglu, {})
        for module in self.modules():
            if isinstance(module, Attention):
                module.rope = rope
            elif isinstance(module, MLP):
                module.act = act
            elif isinstance(module, RMSNorm):
                if id(module) in norms:
                    module.forward = norms[id(module)]  # type: ignore[method-assign]
                else:
                    module.__dict__.pop("forward", None)  # the class's own
        self._compile_scope = scope
