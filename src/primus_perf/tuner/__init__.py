"""Timing harness, BLAS-Lt bindings, GEMM search, attention kernels and search."""
