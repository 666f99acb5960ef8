"""The grouped-GEMM kind of the tuner (``plugin``): the backends of
``kernels.grouped`` and the Triton grouped GEMM's configs, raced per pass."""
