"""Achieved throughput against the roofline: min(peak of the dtype, intensity x HBM bandwidth);
for memory-bound ops with a bytes model only (no FLOPs), achieved TB/s against the HBM bandwidth.

A figure above 100% is not real: :func:`explain_over` says, per row, which ceiling the
counted work cannot be measured against (:data:`OVER_NOTES`), so tables show it flagged
with its reason instead of as an achievement; above :data:`SHOWN_MAX` it is not shown as a
fraction at all (NaN), only its reason."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from primus_perf.base.devices import DevicePeaks

SHOWN_MAX = 1.1  # a fraction of the roofline above this is not printed as one
# why a row's fraction of the roofline is above 1, by what its inputs show (first that applies)
OVER_NOTES = {
    "tf32": "above the fp32 peak: fp32 math on TF32 tensor cores (allow_tf32) assumed, % of the TF32 roof",
    "winograd": "above the peak: a Winograd/FFT convolution does fewer FLOPs than the direct convolution counted",
    "cache": "above the HBM roof: its data fits in the L2 cache, which is faster than HBM",
    "model": "above the roofline: the bytes or FLOPs counted exceed what its kernels did (an output passed as an "
             "input, a fused or compiled region, a broadcast or strided input); not a measured fraction",
}


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


def explain_over(pct: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, time_s: np.ndarray,
                 dtypes: Sequence[str], kinds: Sequence[str], calls: np.ndarray,
                 peaks: DevicePeaks | None) -> tuple[np.ndarray, list[str]]:
    """The fractions of the roofline with the rows above 1 explained: an fp32 GEMM above the
    fp32 peak is measured against the TF32 roof (where that brings it under 1); every other
    row above 1 keeps its figure and gets the reason it is not real (:data:`OVER_NOTES`):
    a convolution above its peak (``kinds`` "convolution"), data that fits in L2 (bytes per
    call, ``calls`` per row, within the device's L2), else the counted work itself.
    Returns (fractions, NaN above :data:`SHOWN_MAX`; notes, "" for rows at or below 1)."""
    pct = np.array(pct, dtype=np.float64)
    notes = [""] * len(pct)
    if peaks is None:
        return pct, notes
    flops = np.nan_to_num(np.asarray(flops, dtype=np.float64), nan=0.0)
    nbytes = np.nan_to_num(np.asarray(nbytes, dtype=np.float64), nan=0.0)
    for i in np.flatnonzero(np.nan_to_num(pct, nan=0.0) > 1.0):
        tf32 = peaks.peak_tflops("tf32")
        if flops[i] > 0 and dtypes[i] == "f32" and tf32 and nbytes[i] > 0 and time_s[i] > 0:
            roof = min(tf32, flops[i] / nbytes[i] * peaks.hbm_tb_s)
            pct[i] = flops[i] / time_s[i] / 1e12 / roof
            notes[i] = OVER_NOTES["tf32"]
            if pct[i] <= 1.0:
                continue
        if flops[i] > 0 and kinds[i] == "convolution":
            notes[i] = OVER_NOTES["winograd"]
        elif flops[i] <= 0 and peaks.l2_bytes and 0 < nbytes[i] / max(1.0, float(calls[i])) <= peaks.l2_bytes:
            notes[i] = OVER_NOTES["cache"]
        else:
            notes[i] = OVER_NOTES["model"]
    return np.where(np.nan_to_num(pct, nan=0.0) > SHOWN_MAX, np.nan, pct), notes
