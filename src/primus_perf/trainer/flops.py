"""Analytic FLOPs of the reference model, and the exact list of its GEMMs.

Model FLOPs (the MFU numerator), per token of one training step (forward + backward):

    6 * N_matmul + attention

- ``N_matmul``: parameters that take part in a GEMM: per layer the fused Q/K/V projection
  ``dim * (n_heads + 2 * n_kv_heads) * head_dim``, the output projection
  ``n_heads * head_dim * dim``, the fused gate/up ``dim * 2 * ffn_dim`` and the down
  projection ``ffn_dim * dim``; plus the output head ``dim * vocab``. Embedding lookups,
  norms and biases are not GEMMs and are not counted. Each GEMM parameter costs 2 FLOPs
  per token forward, 2 for the input gradient and 2 for the weight gradient: 6.
- attention: the score and value matmuls over the (query, key) pairs that a causal mask
  keeps (``AttentionProblem.score_pairs``): forward ``4 * heads * pairs * head_dim`` per
  sequence, backward 2.5x the forward (3.5x in all), per layer.

Activation recompute re-runs forward GEMMs; those are not model FLOPs and
:func:`model_gemms` does not list them.

MoE layers (``model.moe.n_experts > 0``, layers ``first_k_dense`` and on) count their
*active* parameters: the router ``dim * n_experts`` and the shared experts (dense GEMMs,
listed by :func:`linear_layers`), and ``top_k`` routed SwiGLU experts of ``3 * dim *
expert_dim`` each (:func:`routed_active_params`): a token takes only those, so MFU is
measured against the work the step really does. The routed experts' grouped GEMMs are
listed by :func:`model_expert_gemms` for given tokens per expert.

:func:`model_gemms` lists every GEMM one micro-batch runs on one tensor-parallel rank, in
the row-major ``M, N, K`` torch sees and as a :class:`~primus_perf.problems.GemmProblem`
exactly as :func:`primus_perf.kernels.gemm.problem_of` builds it in the trainer: forward ``x @ W.T``
(``M = tokens``), input gradient ``dy @ W`` and weight gradient ``dy.T @ x`` (``K = tokens``).
The sum of their FLOPs is ``6 * N_matmul / tp * tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass

from primus_perf.problems import AttentionProblem, GemmProblem, GroupedGemmProblem
from primus_perf.trainer.config import ModelConfig


@dataclass(frozen=True)
class LinearLayer:
    """One weight ``[out_features, in_features]`` used as ``x @ W.T`` (per TP rank)."""

    name: str
    out_features: int
    in_features: int


@dataclass(frozen=True)
class GemmCall:
    """One GEMM of a training step: ``Y[M, N] = A[M, K] @ B[K, N]`` (row-major)."""

    layer: str
    kind: str  # "fwd", "dgrad" (input gradient) or "wgrad" (weight gradient)
    M: int
    N: int
    K: int
    problem: GemmProblem

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * self.K


def linear_layers(cfg: ModelConfig, tp: int = 1) -> list[LinearLayer]:
    """The model's linear layers in execution order, with per-rank shapes."""
    hd = cfg.head_dim
    moe = cfg.moe
    layers: list[LinearLayer] = []
    for i in range(cfg.n_layers):
        p = f"layers.{i}"
        layers += [
            LinearLayer(
                f"{p}.attention.wqkv", (cfg.n_heads + 2 * cfg.n_kv_heads) * hd // tp, cfg.dim
            ),
            LinearLayer(f"{p}.attention.wo", cfg.dim, cfg.n_heads * hd // tp),
        ]
        if not is_moe_layer(cfg, i):
            layers += [
                LinearLayer(f"{p}.mlp.w13", 2 * cfg.ffn_dim // tp, cfg.dim),
                LinearLayer(f"{p}.mlp.w2", cfg.dim, cfg.ffn_dim // tp),
            ]
            continue
        layers.append(LinearLayer(f"{p}.mlp.router", moe.n_experts, cfg.dim))  # replicated
        shared = moe.n_shared_experts * moe.expert_dim
        if shared:
            layers += [
                LinearLayer(f"{p}.mlp.shared.w13", 2 * shared // tp, cfg.dim),
                LinearLayer(f"{p}.mlp.shared.w2", cfg.dim, shared // tp),
            ]
    layers.append(LinearLayer("output", cfg.vocab_size // tp, cfg.dim))
    return layers


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.moe.n_experts > 0 and layer >= cfg.moe.first_k_dense


def matmul_params(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters that take part in dense GEMMs (whole model, all TP ranks together; with
    ``tp``: one tensor-parallel rank's)."""
    return sum(layer.out_features * layer.in_features for layer in linear_layers(cfg, tp))


def routed_active_params(cfg: ModelConfig) -> int:
    """Routed-expert parameters one token takes: ``top_k`` SwiGLU experts per MoE layer."""
    moe = cfg.moe
    layers = sum(is_moe_layer(cfg, i) for i in range(cfg.n_layers))
    return layers * moe.top_k * 3 * cfg.dim * moe.expert_dim


def model_gemms(
    cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1, dtype: str = "bf16"
) -> list[GemmCall]:
    """Every GEMM of one micro-batch's forward and backward on one TP rank, per layer:
    forward, then (in backward) input gradient and weight gradient."""
    T = micro_batch * seq_len
    calls: list[GemmCall] = []
    for layer in linear_layers(cfg, tp):
        N, K = layer.out_features, layer.in_features
        for kind, (m, n, k), flags in (
            ("fwd", (T, N, K), {"b_transposed": True}),
            ("dgrad", (T, K, N), {}),
            ("wgrad", (N, K, T), {"a_transposed": True}),
        ):
            calls.append(GemmCall(layer.name, kind, m, n, k, GemmProblem.from_row_major(m, n, k, dtype=dtype, **flags)))
    return calls


def gemm_flops_per_step(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1) -> int:
    """Dense GEMM FLOPs of one micro-batch step on one TP rank (= sum of :func:`model_gemms`)."""
    return 6 * micro_batch * seq_len * matmul_params(cfg, tp)


@dataclass(frozen=True)
class GroupedGemmCall:
    """One grouped GEMM of a training step, with the exact tokens per expert it saw."""

    layer: str
    counts: tuple[int, ...]
    problem: GroupedGemmProblem

    @property
    def flops(self) -> int:
        return self.problem.flops_of(sum(self.counts))


def model_expert_gemms(
    cfg: ModelConfig, tokens_per_expert: list[list[int]], dtype: str = "bf16"
) -> list[GroupedGemmCall]:
    """The routed experts' grouped GEMMs of one step, given the tokens per (local) expert
    of each MoE layer (``StepMetrics.tokens_per_expert`` on one process): per layer the
    gate/up projection ``[dim -> 2 * expert_dim]`` and the down projection
    ``[expert_dim -> dim]``, each forward, input gradient and weight gradient. Their FLOPs
    sum to ``6 * tokens * routed_active_params``."""
    moe = cfg.moe
    layers = [i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
    if len(layers) != len(tokens_per_expert):
        raise ValueError(f"{len(tokens_per_expert)} count lists for {len(layers)} MoE layers")
    calls: list[GroupedGemmCall] = []
    for i, counts in zip(layers, tokens_per_expert):
        for name, k, n in (
            ("w13", cfg.dim, 2 * moe.expert_dim),
            ("w2", moe.expert_dim, cfg.dim),
        ):
            for phase in ("fwd", "dgrad", "wgrad"):
                problem = GroupedGemmProblem.from_counts(counts, k, n, dtype=dtype, phase=phase)
                calls.append(GroupedGemmCall(f"layers.{i}.mlp.{name}", tuple(counts), problem))
    return calls


def attention_problem(
    cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1, dtype: str = "bf16"
) -> AttentionProblem:
    """The attention call of one layer on one TP rank (the model's layout: bshd, causal)."""
    return AttentionProblem(
        batch=micro_batch,
        heads_q=cfg.n_heads // tp,
        heads_kv=cfg.n_kv_heads // tp,
        seq_q=seq_len,
        seq_kv=seq_len,
        head_dim=cfg.head_dim,
        dtype=dtype,
        causal=True,
        layout="bshd",
    )


def attention_flops_per_step(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1) -> int:
    """Forward + backward attention FLOPs of one micro-batch on one TP rank, all layers."""
    prob = attention_problem(cfg, micro_batch, seq_len, tp)
    return cfg.n_layers * (prob.forward_flops + prob.backward_flops)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token: ``6 * N_matmul`` (dense GEMM parameters plus the
    routed experts a token takes) + causal attention (fwd + bwd)."""
    active = matmul_params(cfg) + routed_active_params(cfg)
    return 6 * active + attention_flops_per_step(cfg, 1, seq_len) / seq_len
