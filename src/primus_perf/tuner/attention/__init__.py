"""Attention tuner: Triton flash attention with searched tile configs, SDPA backend
selection, and the router through which the trainer uses the cached choice."""
