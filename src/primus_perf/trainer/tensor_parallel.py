"""Megatron-style tensor parallelism, applied from outside the model.

:func:`apply_tensor_parallel` shards a full (identically initialised) model in place and
swaps its modules for versions that add the collectives of ``comm.py``:

- column-parallel: the fused Q/K/V projection (each of Q, K, V split by heads) and the fused
  gate/up projection (each half split by rows), with the input passed through
  ``copy_to_tp`` (identity forward, all-reduce of the gradient backward);
- row-parallel: the attention output and MLP down projections (split by columns), their
  partial outputs summed by ``reduce_from_tp`` (all-reduce forward, identity backward);
- vocab-parallel embedding (rows split; out-of-range tokens give zeros, then all-reduce);
- the output head is column-parallel over the vocabulary; its logits are all-gathered
  (``gather_from_tp``) and the loss is the ordinary cross entropy on full logits.
  This is a documented simplification of Megatron's vocab-parallel cross entropy: it
  costs one all-gather of the logits and memory for the full logits on every rank.

RMSNorm weights are replicated; their gradients are identical on every tensor-parallel
rank. Sharded parameters carry ``tp_sharded = True`` so ``parallel.clip_grad_norm_``
counts them once across the group.

MoE layers: their shared experts (dense MLPs) are sharded like the dense MLP; the token
router and the routed experts are replicated over the tensor-parallel group (each
tensor-parallel rank runs the same expert GEMMs: expert tensor parallelism is not
implemented).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from primus_perf.trainer.comm import copy_to_tp, gather_from_tp, reduce_from_tp
from primus_perf.trainer.model import MLP, Attention, Embedding, Transformer
from primus_perf.trainer.parallel import ProcessGroups, swap_class


class ColumnRowParallel:
    """Attention or MLP over the tensor-parallel group: its first GEMM column-parallel
    (the input through ``copy_to_tp``), its last row-parallel (the partial outputs summed
    by ``reduce_from_tp``)."""

    tp_group: Any

    def forward(self, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        return reduce_from_tp(super().forward(copy_to_tp(x, group), *args), group)  # type: ignore[misc]


class VocabParallel:
    """The token embedding's rows [vocab_start, vocab_start + local rows) on this rank:
    tokens outside give zeros, then the ranks' rows are summed."""

    tp_group: Any
    vocab_start: int
    weight: nn.Parameter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)


class VocabParallelHead:
    """The output head column-parallel over the vocabulary, its logits all-gathered."""

    tp_group: Any

    def head(self, h: torch.Tensor) -> torch.Tensor:
        group = self.tp_group
        return gather_from_tp(super().head(copy_to_tp(h, group)), group)  # type: ignore[misc]


def _rows(w: torch.Tensor, sizes: list[int], rank: int, tp: int) -> torch.Tensor:
    """Split rows into consecutive parts of ``sizes``, keep this rank's slice of each."""
    parts = [p.chunk(tp, dim=0)[rank] for p in w.split(sizes, dim=0)]
    return torch.cat(parts, dim=0).contiguous()


def _cols(w: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return w.chunk(tp, dim=1)[rank].contiguous()


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    param = nn.Parameter(value, requires_grad=True)
    param.tp_sharded = True  # type: ignore[attr-defined]
    setattr(module, name, param)


def _shard_attention(attn: Attention, rank: int, tp: int) -> None:
    hd = attn.head_dim
    sizes = [attn.n_heads * hd, attn.n_kv_heads * hd, attn.n_kv_heads * hd]
    _replace(attn, "wqkv", _rows(attn.wqkv, sizes, rank, tp))
    if attn.bqkv is not None:
        _replace(attn, "bqkv", _rows(attn.bqkv, sizes, rank, tp))
    _replace(attn, "wo", _cols(attn.wo, rank, tp))
    attn.n_heads //= tp
    attn.n_kv_heads //= tp


def _shard_mlp(mlp: MLP, rank: int, tp: int) -> None:
    ffn = mlp.w2.shape[1]
    _replace(mlp, "w13", _rows(mlp.w13, [ffn, ffn], rank, tp))
    _replace(mlp, "w2", _cols(mlp.w2, rank, tp))


@torch.no_grad()
def apply_tensor_parallel(model: Transformer, groups: ProcessGroups) -> None:
    """Shard ``model`` over ``groups.tp_group`` (tp > 1) in place: every attention, every
    dense MLP (an MoE layer's shared experts too), the embedding and the output head."""
    tp, rank, group = groups.tp, groups.tp_rank, groups.tp_group
    for module in list(model.modules()):
        if isinstance(module, Attention):
            _shard_attention(module, rank, tp)
        elif isinstance(module, MLP):
            _shard_mlp(module, rank, tp)
        else:
            continue
        swap_class(module, ColumnRowParallel)
        module.tp_group = group
    emb = model.tok_embeddings
    assert isinstance(emb, Embedding)
    per = emb.weight.shape[0] // tp
    _replace(emb, "weight", emb.weight[rank * per : (rank + 1) * per].contiguous())
    swap_class(emb, VocabParallel)
    emb.vocab_start, emb.tp_group = rank * per, group
    _replace(model, "output", _rows(model.output, [model.output.shape[0]], rank, tp))
    swap_class(model, VocabParallelHead)
    model.tp_group = group
