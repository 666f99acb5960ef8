"""Achieved throughput against the roofline: min(peak of the dtype, intensity x HBM bandwidth);
for memory-bound ops with a bytes model only (no FLOPs), achieved TB/s against the HBM bandwidth."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from primus_perf.devices import DevicePeaks


def roofline(flops: np.ndarray, nbytes: np.ndarray, time_s: np.ndarray, dtypes: Sequence[str],
             peaks: DevicePeaks | None) -> tuple[np.ndarray, np.ndarray]:
    """Achieved TFLOP/s and the fraction of the roofline reached (NaN where unknown)."""
    flops = np.nan_to_num(np.asarray(flops, dtype=np.float64), nan=0.0)
    nbytes = np.asarray(nbytes, dtype=np.float64)
    time_s = np.asarray(time_s, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        tflops = np.where(time_s > 0, flops / time_s / 1e12, np.nan)
    pct = np.full(len(flops), np.nan)
    if peaks is not None:
        for i, dt in enumerate(dtypes):
            peak = peaks.peak_tflops(dt) if dt else None
            if flops[i] > 0 and peak and nbytes[i] > 0 and np.isfinite(tflops[i]):
                pct[i] = tflops[i] / min(peak, flops[i] / nbytes[i] * peaks.hbm_tb_s)
            elif not flops[i] > 0 and nbytes[i] > 0 and time_s[i] > 0 and peaks.hbm_tb_s:
                pct[i] = nbytes[i] / time_s[i] / 1e12 / peaks.hbm_tb_s  # memory-bound: of the HBM roof
    return tflops, pct
