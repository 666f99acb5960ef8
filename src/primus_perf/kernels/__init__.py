"""What a training step runs: the BLAS-Lt binding (``blaslt/``), the Triton attention
kernels and the SDPA backend table (``attention/``), the grouped-GEMM backends of MoE
experts (``grouped/``), and one router per kind (problem -> tuned kernel) built from
tuning-cache entries. Importable without the tuner."""
