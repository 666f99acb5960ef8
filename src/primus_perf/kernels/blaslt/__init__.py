"""ctypes bindings for cuBLASLt and hipBLASLt: one binding layer over per-vendor tables."""
