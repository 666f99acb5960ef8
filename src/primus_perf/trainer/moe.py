"""An MoE decoder in plain PyTorch: the dense model's attention, norms, RoPE and embedding,
with mixture-of-experts layers in place of the dense MLP.

One MoE layer (:class:`MoE`), for the ``n`` tokens of a micro-batch:

1. Token router (:class:`TokenRouter`): ``scores = softmax(x @ Wr^T)`` or
   ``sigmoid(x @ Wr^T)`` (fp32); the ``top_k`` experts of ``scores + bias`` are selected
   (``bias`` is zero unless ``balance=bias``: it steers selection only); their weights are
   the unbiased scores, renormalized to sum to 1 (``norm_topk_prob``) and times
   ``routed_scale``.
2. Dropless dispatch (:func:`permute`): the ``n * top_k`` (token, expert) pairs are sorted
   by expert (stable), the token rows gathered in that order, and ``counts[e]`` (tokens per
   expert) read to the host once.
3. Experts: SwiGLU through two grouped GEMMs (``x @ W13_e``, ``[gate | up]``, then
   ``@ W2_e``), each a plain ``torch._grouped_mm`` (:func:`grouped_mm`); which backend runs
   them is the runtime's grouped dispatch's (the trainer sets it from
   ``model.moe.grouped_gemm_backend``; a tuning cache's choices where one is enabled).
4. Combine (:func:`unpermute`): each pair's output times its weight, summed into its token.
   Shared experts (a dense SwiGLU every token takes) are added.

Balancing: ``aux_loss`` adds ``coef * E * sum_e f_e * P_e`` (``f_e``: fraction of the
global batch's assignments to expert e, ``P_e``: mean normalized score of e over this
rank's tokens). ``f`` is over the global batch (:meth:`MoE.count_tokens`) and ``P`` is
local, so the data-parallel average of the per-rank losses equals the loss of one process
holding the whole batch. ``bias``: after each optimizer step, ``bias_e += rate *
sign(mean load - load_e)`` on the global counts (:func:`update_router_biases`), identical
on every rank.

The layer is plain: on one process the global batch is the local one. Data and expert
parallelism are applied from outside (``parallelize.py``): the layer is swapped for a
version (``expert_parallel.py``) whose :meth:`MoE.count_tokens` sums the counts over the
data-parallel group and whose :meth:`MoE.experts` sends the rows to the rank that holds
their expert with an all-to-all(v) and back.

Every dense GEMM (attention, router, shared experts, output head) is ``F.linear`` as in the
dense model.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from primus_perf.base.errors import ConfigError
from primus_perf.kernels.autocast import cast_operands
from primus_perf.kernels.grouped import AUTO, BACKENDS, default_backend
from primus_perf.kernels.grouped.offsets import known_counts
from primus_perf.trainer.config import ModelConfig
from primus_perf.trainer.model import MLP, Transformer, linear, swiglu


def group_ends(counts: list[int], device: torch.device) -> torch.Tensor:
    """The int32 cumulative row ends of ``counts`` (host ints) on ``device``, copied without
    waiting for it (pinned memory) and marked known on the host: a backend that needs the
    counts reads no device memory."""
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32)
    if device.type == "cuda":
        ends = ends.pin_memory()
    return known_counts(ends.to(device, non_blocking=True), counts)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int], ends: torch.Tensor | None = None) -> torch.Tensor:
    """``y[T, N]`` whose rows of group g are ``x_g @ w[g]``: ``x[T, K]`` sorted by group
    (``counts[g]`` rows each, host ints; ``ends``: their :func:`group_ends`, made once for a
    layer's calls), ``w[G, K, N]``; ``torch._grouped_mm`` in the autocast dtype,
    differentiable. ValueError for operands and counts that do not fit."""
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm needs x[T, K] and w[G, K, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0] or x.shape[1] != w.shape[1]:
        raise ValueError(f"grouped_mm: {len(counts)} counts summing to {sum(counts)} do not fit"
                         f" x{tuple(x.shape)} and w{tuple(w.shape)}")
    x, w = cast_operands(x, w)
    ends = group_ends(counts, x.device) if ends is None else ends
    with torch.autocast(x.device.type, enabled=False):
        return torch._grouped_mm(x, w, offs=ends)


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


class TokenRouter(nn.Module):
    """Which experts each token goes to, and with what weight (top-k over the scores)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.weight = nn.Parameter(torch.empty(moe.n_experts, cfg.dim))
        self.register_buffer("bias", torch.zeros(moe.n_experts), persistent=True)
        self.top_k, self.kind = moe.top_k, moe.router
        self.norm_topk, self.scale = moe.norm_topk_prob, moe.routed_scale

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x[n, dim]`` -> (weights[n, k] fp32, experts[n, k], normalized scores[n, E])."""
        logits = linear(x, self.weight).float()
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
        self.router = TokenRouter(cfg)
        # local experts (all of them until parallelize keeps this rank's slice)
        self.w13 = nn.Parameter(torch.empty(moe.n_experts, cfg.dim, 2 * moe.expert_dim))
        self.w2 = nn.Parameter(torch.empty(moe.n_experts, moe.expert_dim, cfg.dim))
        shared = moe.n_shared_experts * moe.expert_dim
        self.shared = MLP(dataclasses.replace(cfg, ffn_dim=shared)) if shared else None
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
        local, total = self.count_tokens(counts)
        self.tokens_per_expert = total
        if self.balance == "aux_loss" and torch.is_grad_enabled():
            share = token_share(total, probs)
            self.aux_loss = self.aux_coef * self.n_experts * (share * probs.mean(dim=0)).sum()
        out = unpermute(self.experts(rows, local), order, weights, x2.shape[0])
        if self.shared is not None:
            out = out + self.shared(x2)
        return out.view(shape)

    def count_tokens(self, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Tokens per expert (a device tensor) -> (this micro-batch's, the global batch's),
        read to the host once. One process: the same."""
        local = counts.tolist()
        return local, list(local)

    @torch.compiler.disable  # host counts vary every step: compiled, each split would be a new graph
    def experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by expert, ``counts[e]`` of expert e -> their SwiGLU expert outputs,
        in the same order."""
        ends = group_ends(counts, rows.device)
        h = grouped_mm(rows, self.w13, counts, ends)
        return grouped_mm(swiglu(h), self.w2, counts, ends)


@torch.compiler.disable  # host counts vary every step: compiled, each would be a new graph
def token_share(total: list[int], like: torch.Tensor) -> torch.Tensor:
    """The share of the global batch's tokens each expert received, on ``like``'s device."""
    return torch.tensor(total, dtype=like.dtype, device=like.device) / max(1, sum(total))


def grouped_backend(model: nn.Module, name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The grouped-GEMM backend the MoE layers of ``model`` (this rank's experts) run: ``name``,
    or for ``auto`` the fixed backend of the default rule for the device, dtype and expert count;
    None for a model without MoE layers. A one-line ConfigError where it cannot run here."""
    layers = moe_layers(model)
    if not layers:
        return None
    w13 = layers[0].w13
    dim, width = w13.shape[1], w13.shape[2] // 2
    if name == AUTO:
        name = default_backend(device, dtype, w13.shape[0], [(dim, 2 * width), (width, dim)])
    why = BACKENDS[name].unsupported(device, dtype, dim, 2 * width) or BACKENDS[name].unsupported(device, dtype,
                                                                                                   width, dim)
    if why:
        raise ConfigError(f"config key 'model.moe.grouped_gemm_backend' ({name}): {why}")
    return name


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
def update_router_biases(model: nn.Module, counts: list[list[int]] | None = None) -> None:
    """Auxiliary-loss-free balancing (``balance=bias``): move each expert's selection bias
    by ``bias_update_rate`` towards the mean load of the step's global counts (``counts``: one
    list per MoE layer, summed over the step's micro-batches; default: the last forward's)."""
    for i, m in enumerate(moe_layers(model)):
        load_counts = counts[i] if counts is not None else m.tokens_per_expert
        if m.balance != "bias" or not load_counts:
            continue
        load = torch.tensor(load_counts, dtype=torch.float32, device=m.router.bias.device)
        m.router.bias += m.bias_rate * torch.sign(load.mean() - load)
