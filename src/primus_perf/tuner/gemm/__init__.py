"""The GEMM kind of the tuner (``plugin``): BLAS-Lt heuristics against torch."""
