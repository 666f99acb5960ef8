"""Achieved throughput against the roofline: min(peak of the dtype, intensity x HBM bandwidth)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from primus_perf.devices import DevicePeaks


def roofline(flops: np.ndarray, nbytes: np.ndarray, time_s: np.ndarray, dtypes: Sequence[str],
             peaks: DevicePeaks | None) -> tuple[np.ndarray, np.ndarray]:
    """Achieved TFLOP/s and the fraction of the roofline reached (NaN where unknown)."""
    flops = np.asarray(flops, dtype=np.float64)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    time_s = np.asarray(time_s, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tflops = np.where(time_s > 0, flops / time_s / 1e12, np.nan)
    pct = np.full(len(flops), np.nan)
    if peaks is not None:
        for i, dt in enumerate(dtypes):
            peak = peaks.peak_tflops(dt) if dt else None
            if peak and nbytes[i] > 0 and np.isfinite(tflops[i]):
                pct[i] = tflops[i] / min(peak, flops[i] / nbytes[i] * peaks.hbm_tb_s)
    return tflops, pct
