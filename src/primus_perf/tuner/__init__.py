"""The tuner: one core (``core``: candidates -> fp32 validation -> timing -> one selection
policy -> cache entry; the tune loop with resume and Ctrl-C), its timers (``timing``), and
one plugin per kind (``gemm/``, ``attention/``; the table in ``kinds``). The kernels it
tunes live in ``primus_perf.kernels``."""
