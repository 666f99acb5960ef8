"""The analyses of the kernel and op-call tables, one module each; :mod:`..analyze` runs them.

Every table counts per step (the mean over the profiled steps of every rank): ``calls``
are op calls (an op that launches several kernels is one call), ``time_s`` seconds.
"""
