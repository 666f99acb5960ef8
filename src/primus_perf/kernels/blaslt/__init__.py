"""ctypes bindings for cuBLASLt and hipBLASLt: one binding layer over per-vendor tables
(``binding``, ``tables``), the layouts a BLAS-Lt call may be given (``layout``) and
matrices over guarded buffers for checking what a kernel touched (``guarded``)."""
