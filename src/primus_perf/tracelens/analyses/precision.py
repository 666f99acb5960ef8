"""fp32 GEMMs and convolutions, and the layout transposes around convolutions: the work a
lower precision or the channels_last memory format would change, and estimates of what it
would save (read by :mod:`.recommendations`).

:func:`fp32_work`: per fp32 GEMM or convolution problem (modeled op calls with FLOPs and
bytes, inside the steps), its kernels' time less the layout transposes among them, the
fraction of the roofline it reaches now (against the TF32 roof where its kernels already
run TF32: a ``tf32``/``xf32`` kernel name, or above the fp32 peak), and its time estimated
at the same fraction of two other roofs of the device: the TF32 one (fp32 tensors, TF32
math) and the 16-bit one (bf16, or fp16 on a device without bf16: 2-byte operands, so twice
the arithmetic intensity). The fraction is capped at what the best kernels reach
(``cap``): an estimate, not a measurement; a kernel's fraction of a higher roof is usually
lower, so it is a bound of the saving more than a forecast.

:func:`layout_transposes`: per step, the time of the NCHW<->NHWC conversions
(``categories.LAYOUT_TRANSPOSE``) the convolution ops launch around their kernels: what a
channels_last model does not run.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from primus_perf.base.devices import DevicePeaks
from primus_perf.tracelens.analyses.hotspots import in_steps
from primus_perf.tracelens.categories import CONVOLUTION, GEMM, LAYOUT_TRANSPOSE

FP32_KINDS = (GEMM, CONVOLUTION)  # the call table's kinds of fp32 work a precision change speeds up
TF32_KERNEL = re.compile(r"tf32|xf32", re.I)  # a kernel that does fp32 math on TF32 tensor cores
LOW_PRECISION = ("bf16", "f16")  # the 16-bit type a device runs, in the order preferred (bf16: no loss scaling)
COLUMNS = ["kind", "key", "direction", "calls", "time_s", "transposes_s", "flops", "bytes", "tf32", "fraction", "tf32_s",
           "low_s", "low_dtype"]


def low_precision(peaks: DevicePeaks) -> str | None:
    """The 16-bit type the device has a tensor peak for (bf16, else fp16), or None."""
    return next((d for d in LOW_PRECISION if peaks.peak_tflops(d)), None)


def _roof(peak: float | None, flops: np.ndarray, nbytes: np.ndarray, hbm_tb_s: float) -> np.ndarray:
    """TFLOP/s of the roofline: min(peak, intensity x HBM bandwidth); NaN without a peak."""
    if not peak:
        return np.full(len(flops), np.nan)
    return np.minimum(peak, flops / nbytes * hbm_tb_s)


def name_matches(k: pd.DataFrame, rx: re.Pattern[str]) -> np.ndarray:
    """Which GPU events' (categorical) names match ``rx``: tested once per distinct name."""
    names = k["name"].astype("category")
    hit = np.r_[np.asarray(names.cat.categories.astype(str).str.contains(rx), dtype=bool), False]
    return hit[names.cat.codes.to_numpy()]


def _by_call(k: pd.DataFrame, mask: np.ndarray) -> pd.Series:
    """Per (rank, op call): the time of its kernels where ``mask`` holds."""
    sub = k[mask & (k["call"] >= 0).to_numpy()]
    return sub.groupby(["rank", "call"])["dur_us"].sum()


def fp32_work(calls: pd.DataFrame, kernels: pd.DataFrame, peaks: DevicePeaks, per_step: int, cap: float
              ) -> pd.DataFrame:
    """One row per fp32 GEMM or convolution problem and pass (see the module docstring); times per
    step in seconds, ``flops`` and ``bytes`` per step; empty where there is none or the
    device has no fp32 peak."""
    c = calls[calls["kind"].isin(FP32_KINDS) & (calls["dtype"] == "f32") & (calls["step"] >= 0)]
    c = c[(c["flops"].astype(np.float64) > 0) & (c["bytes"].astype(np.float64) > 0)]
    f32 = peaks.peak_tflops("f32")
    if c.empty or not f32 or peaks.hbm_tb_s <= 0:
        return pd.DataFrame(columns=COLUMNS)
    k = in_steps(kernels)
    transposes = _by_call(k, name_matches(k, LAYOUT_TRANSPOSE))
    tf32_calls = _by_call(k, name_matches(k, TF32_KERNEL))
    at = pd.MultiIndex.from_arrays([c["rank"].to_numpy(), c["row"].to_numpy()])
    c = c.assign(transposes=transposes.reindex(at, fill_value=0.0).to_numpy(),
                 tf32=tf32_calls.reindex(at, fill_value=0.0).to_numpy() > 0)
    g = c.groupby(["kind", "key", "direction"], sort=False).agg(
        calls=("row", "size"), time_us=("time_us", "sum"), transposes_us=("transposes", "sum"),
        flops=("flops", "sum"), bytes=("bytes", "sum"), tf32=("tf32", "any")).reset_index()
    time_s = (g["time_us"] - g["transposes_us"]).clip(lower=0.0).to_numpy(dtype=np.float64) / 1e6
    flops, nbytes = g["flops"].to_numpy(dtype=np.float64), g["bytes"].to_numpy(dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        achieved = np.where(time_s > 0, flops / time_s / 1e12, np.nan)
    roof32 = _roof(f32, flops, nbytes, peaks.hbm_tb_s)
    roof_tf32 = _roof(peaks.peak_tflops("tf32"), flops, nbytes, peaks.hbm_tb_s)
    low = low_precision(peaks)
    roof_low = _roof(peaks.peak_tflops(low) if low else None, flops, nbytes / 2, peaks.hbm_tb_s)
    # on TF32 already: a TF32 kernel, or above the fp32 roof on a device with TF32 (without it: a
    # Winograd convolution, which does fewer FLOPs than counted)
    on_tf32 = g["tf32"].to_numpy(dtype=bool) | ((achieved > roof32) & np.isfinite(roof_tf32))
    now = np.where(on_tf32, roof_tf32, roof32)
    with np.errstate(divide="ignore", invalid="ignore"):
        fraction = achieved / now
        kept = np.minimum(fraction, cap)
        tf32_s = np.where(on_tf32, time_s, flops / (kept * roof_tf32) / 1e12)
        low_s = flops / (kept * roof_low) / 1e12
    return pd.DataFrame({
        "kind": g["kind"], "key": g["key"], "direction": g["direction"], "calls": g["calls"] / per_step, "time_s": time_s / per_step,
        "transposes_s": g["transposes_us"].to_numpy(dtype=np.float64) / 1e6 / per_step,
        "flops": flops / per_step, "bytes": nbytes / per_step, "tf32": on_tf32, "fraction": fraction,
        "tf32_s": np.minimum(tf32_s, time_s) / per_step, "low_s": np.minimum(low_s, time_s) / per_step,
        "low_dtype": low or "",
    }, columns=COLUMNS).sort_values("time_s", ascending=False, ignore_index=True)


def layout_transposes(kernels: pd.DataFrame, per_step: int) -> tuple[float, int, list[str]]:
    """Per step: the seconds of the convolutions' NCHW<->NHWC conversions, how many ran, and
    their kernel names (most time first)."""
    k = in_steps(kernels)
    k = k[(k["category"] == CONVOLUTION).to_numpy()]
    k = k[name_matches(k, LAYOUT_TRANSPOSE)]
    if k.empty:
        return 0.0, 0, []
    by = k.groupby("name", observed=True)["dur_us"].sum().sort_values(ascending=False)
    return float(k["dur_us"].sum()) / 1e6 / per_step, round(len(k) / per_step), list(map(str, by.index))
