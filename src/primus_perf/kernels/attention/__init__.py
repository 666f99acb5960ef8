"""Attention as a training step runs it: Triton flash attention (``kernels``, ``function``)
with tile configs (``configs``), torch SDPA backends (``backends``), the fp32 reference
(``reference``) and the router over cached choices (``router``). Triton is imported only
by ``kernels``/``function``, on demand."""
