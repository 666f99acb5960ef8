"""An MoE decoder in plain PyTorch: the dense model's attention, norms, RoPE and embedding,
with mixture-of-experts layers in place of the dense MLP.

One MoE layer (:class:`MoE`), for the ``n`` tokens of a micro-batch:

1. Router: ``scores = softmax(x @ Wr^T)`` or ``sigmoid(x @ Wr^T)`` (fp32); the ``top_k``
   experts of ``scores + bias`` are selected (``bias`` is zero unless ``balance=bias``: it
   steers selection only); their weights are the unbiased scores, renormalized to sum to
   1 (``norm_topk_prob``) and times ``routed_scale``.
2. Dropless dispatch (:func:`permute`): the ``n * top_k`` (token, expert) pairs are sorted
   by expert (stable), the token rows gathered in that order, and ``counts[e]`` (tokens per
   expert) read to the host once.
3. Experts: SwiGLU through two grouped GEMMs (``x @ W13_e``, ``[gate | up]``, then
   ``@ W2_e``) through :func:`primus_perf.runtime.seams.grouped_mm`. Under expert
   parallelism (``ep_group`` set by :func:`parallel.parallelize`) the rows go to the rank
   that holds their expert with an all-to-all(v), are regrouped by local expert, and come
   back the same way.
4. Combine (:func:`unpermute`): each pair's output times its weight, summed into its token.
   Shared experts (a dense SwiGLU every token takes) are added.

Balancing: ``aux_loss`` adds ``coef * E * sum_e f_e * P_e`` (``f_e``: fraction of the
global batch's assignments to expert e, ``P_e``: mean normalized score of e over this
rank's tokens). ``f`` is all-reduced over the data-parallel group and ``P`` is local, so
the data-parallel average of the per-rank losses equals the loss of one process holding
the whole batch. ``bias``: after each optimizer step, ``bias_e += rate * sign(mean load -
load_e)`` on the global counts (:func:`update_router_biases`), identical on every rank.

Every dense GEMM (attention, router, shared experts, output head) goes through
:func:`seams.linear` as in the dense model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from primus_perf.errors import ConfigError
from primus_perf.kernels.autocast import gemm_dtype
from primus_perf.kernels.grouped import BACKENDS
from primus_perf.runtime import seams
from primus_perf.runtime.seams import grouped_mm
from primus_perf.trainer.config import ModelConfig
from primus_perf.trainer.model import MLP, Transformer, swiglu
from primus_perf.trainer.parallel import all_to_all


def permute(
    x: torch.Tensor, experts: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows of ``x[n, d]`` repeated per selected expert and sorted by expert.

    ``experts[n, k]``: the experts of each token. Returns ``(rows[n * k, d], order,
    counts)``: ``order[i]`` is the flat (token * k + slot) index of sorted row i, and
    ``counts[e]`` (on the device) the rows of expert e."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    return x[order // experts.shape[1]], order, counts


def unpermute(
    rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, n_tokens: int
) -> torch.Tensor:
    """Inverse of :func:`permute` with the combine: token t gets ``sum_j weights[t, j] *
    rows[i]`` over the sorted rows ``i`` of its (t, j) pairs."""
    k = weights.shape[1]
    scaled = rows * weights.reshape(-1)[order].unsqueeze(1).to(rows.dtype)
    out = rows.new_zeros(n_tokens, rows.shape[1])
    return out.index_add(0, order // k, scaled)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, cfg.dim))
        self.register_buffer("bias", torch.zeros(moe.n_experts), persistent=True)
        self.top_k, self.kind = moe.top_k, moe.router
        self.norm_topk, self.scale = moe.norm_topk_prob, moe.routed_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x[n, dim]`` -> (weights[n, k] fp32, experts[n, k], normalized scores[n, E])."""
        logits = seams.linear(x, self.weight).float()
        if self.kind == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        experts = (scores.detach() + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scale, experts, probs


class MoE(nn.Module):
    """Routed SwiGLU experts (and optional shared ones) in place of the dense MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.n_experts, self.top_k, self.expert_dim = moe.n_experts, moe.top_k, moe.expert_dim
        self.balance, self.aux_coef, self.bias_rate = (
            moe.balance,
            moe.aux_loss_coef,
            moe.bias_update_rate,
        )
        self.backend = moe.grouped_gemm_backend
        self.backend_checked = False
        self.router = Router(cfg)
        # local experts (all of them until parallelize keeps this rank's slice)
        self.w13 = nn.Parameter(torch.empty(moe.n_experts, cfg.dim, 2 * moe.expert_dim))
        self.w2 = nn.Parameter(torch.empty(moe.n_experts, moe.expert_dim, cfg.dim))
        shared = moe.n_shared_experts * moe.expert_dim
        self.shared = MLP(dataclasses.replace(cfg, ffn_dim=shared)) if shared else None
        self.dp_group = None  # counts are summed over it (set by parallelize)
        self.ep_group = None  # experts split over it (set by parallelize)
        self.ep = 1
        self.aux_loss: torch.Tensor | None = None  # of the last forward
        self.tokens_per_expert: list[int] = []  # global, of the last forward

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.weight, std=std)
        self.router.bias.zero_()
        nn.init.normal_(self.w13, std=std)
        nn.init.normal_(self.w2, std=out_std)
        if self.shared is not None:
            self.shared.reset_parameters(std, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, experts, probs = self.router(x2)
        rows, order, counts = permute(x2, experts, self.n_experts)
        global_counts = counts.clone()
        if self.dp_group is not None:
            dist.all_reduce(global_counts, group=self.dp_group)
        local, total = torch.stack((counts, global_counts)).tolist()
        self.tokens_per_expert = total
        if self.balance == "aux_loss" and torch.is_grad_enabled():
            share = torch.tensor(total, dtype=probs.dtype, device=probs.device) / max(1, sum(total))
            self.aux_loss = self.aux_coef * self.n_experts * (share * probs.mean(dim=0)).sum()
        out = unpermute(self._experts(rows, local), order, weights, x2.shape[0])
        if self.shared is not None:
            out = out + self.shared(x2)
        return out.view(shape)

    def _check_backend(self, rows: torch.Tensor) -> None:
        """A one-line ConfigError when the configured backend cannot run here."""
        dtype = gemm_dtype(rows)
        dim, width = self.w13.shape[1], self.expert_dim
        why = BACKENDS[self.backend].unsupported(rows.device, dtype, dim, 2 * width)
        why = why or BACKENDS[self.backend].unsupported(rows.device, dtype, width, dim)
        if why:
            raise ConfigError(
                f"config key 'model.moe.grouped_gemm_backend' ({self.backend}): {why}"
            )
        self.backend_checked = True

    def _expert_mlp(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if not self.backend_checked:
            self._check_backend(rows)
        h = grouped_mm(rows, self.w13, counts, self.backend)
        return grouped_mm(swiglu(h), self.w2, counts, self.backend)

    def _experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by (global) expert -> their expert outputs, in the same order."""
        if self.ep_group is None:
            return self._expert_mlp(rows, counts)
        ep, local_n = self.ep, self.n_experts // self.ep
        send = [sum(counts[r * local_n : (r + 1) * local_n]) for r in range(ep)]
        mine = torch.tensor(counts, device=rows.device)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=self.ep_group)
        grid = theirs.view(ep, local_n)  # grid[r, e]: rows rank r sends to my expert e
        recv = grid.sum(dim=1).tolist()
        received = all_to_all(rows, recv, send, self.ep_group)  # by (source rank, expert)
        # regroup by (expert, source rank) for the grouped GEMM, and back afterwards
        source = torch.repeat_interleave(
            torch.arange(ep * local_n, device=rows.device), grid.reshape(-1)
        )
        expert_major = (source % local_n) * ep + source // local_n
        by_expert = torch.argsort(expert_major, stable=True)
        out = self._expert_mlp(received[by_expert], grid.sum(dim=0).tolist())
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        return all_to_all(back, send, recv, self.ep_group)


class MoETransformer(Transformer):
    """The dense decoder with :class:`MoE` in layers ``moe.first_k_dense`` and on."""

    def make_mlp(self, layer: int) -> nn.Module | None:
        if layer < self.cfg.moe.first_k_dense:
            return None
        return MoE(self.cfg)


def build_model(cfg: ModelConfig) -> Transformer:
    """The model of a config: the MoE decoder when ``moe.n_experts > 0``, else the dense one."""
    return MoETransformer(cfg) if cfg.moe.n_experts else Transformer(cfg)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The summed load-balancing loss of the last forward (None without one)."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    for m in moe_layers(model):
        m.aux_loss = None
    return torch.stack(losses).sum() if losses else None


def tokens_per_expert(model: nn.Module) -> list[list[int]] | None:
    """Global tokens per expert of the last forward, one list per MoE layer (None: dense)."""
    layers = moe_layers(model)
    return [list(m.tokens_per_expert) for m in layers] if layers else None


@torch.no_grad()
def update_router_biases(model: nn.Module) -> None:
    """Auxiliary-loss-free balancing (``balance=bias``): move each expert's selection bias
    by ``bias_update_rate`` towards the mean load of the last forward's global counts."""
    for m in moe_layers(model):
        if m.balance != "bias" or not m.tokens_per_expert:
            continue
        load = torch.tensor(m.tokens_per_expert, dtype=torch.float32, device=m.router.bias.device)
        m.router.bias += m.bias_rate * torch.sign(load.mean() - load)
