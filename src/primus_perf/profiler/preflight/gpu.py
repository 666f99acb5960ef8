"""Per-GPU figures: dense GEMM TFLOP/s (bf16 at a few sizes, FP8 where the GPU has it)
against the datasheet peak, HBM copy bandwidth, and the management library's telemetry
(clocks under load, power, temperature, ECC errors): NVML (``pynvml``, from the
``nvidia-ml-py`` package) on NVIDIA, ``amdsmi`` on AMD, each optional.

Expected values are documented fractions of the datasheet (``devices.lookup_peaks``):
:data:`GEMM_FLOOR` per size and :data:`HBM_FLOOR`. They are floors that a healthy GPU
clears with room (an H100 SXM runs 8192^3 bf16 at about 0.75-0.8 of its dense peak and
copies at about 0.8-0.9 of its HBM figure); below them something is wrong (clocks held
down, power capped, a bad part).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from primus_perf.base.devices import current_device, lookup_peaks
from primus_perf.profiler.preflight.checks import Measurement

GEMM_SIZES = (2048, 4096, 8192)
GEMM_FLOOR = {2048: 0.35, 4096: 0.5, 8192: 0.6}  # of the dense datasheet peak, per square size
FP8_SIZE = 8192
FP8_FLOOR = 0.45  # of the dense FP8 datasheet peak at FP8_SIZE
HBM_FLOOR = 0.7  # of the datasheet HBM bandwidth, copy (read + write bytes)
HBM_COPY_BYTES = 2 << 30
REPS = 20


def _time_ms(fn: Callable[[], object], reps: int = REPS) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fp8_dtype(vendor: str, arch: str) -> Any:
    """The FP8 (e4m3) dtype ``torch._scaled_mm`` takes on this GPU, or None without FP8
    GEMMs: NVIDIA sm_89 and later; AMD gfx942 (the fnuz variant) and gfx950."""
    import torch

    if vendor == "nvidia" and arch.startswith("sm_") and int(arch[3:]) >= 89:
        return torch.float8_e4m3fn
    return {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}.get(arch) if vendor == "amd" else None


def gemm_measurements(subject: str, sizes: tuple[int, ...] = GEMM_SIZES) -> list[Measurement]:
    import torch

    ident = current_device()
    peaks = lookup_peaks(ident.name)
    out = []
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        tflops = 2 * n**3 / (_time_ms(lambda a=a, b=b: a @ b) * 1e-3) / 1e12
        peak = peaks.peak_tflops("bf16") if peaks else None
        floor = GEMM_FLOOR.get(n)
        out.append(Measurement(
            "gpu", f"bf16 GEMM {n}", subject, tflops, "TFLOP/s",
            peak * floor if peak and floor else None,
            f"{floor:.0%} of the {peak:g} TFLOP/s datasheet peak" if peak and floor else "",
            peers=True, reason="" if peak else f"no datasheet peak for {ident.name}"))
        del a, b
    dtype = fp8_dtype(ident.vendor, ident.arch)
    name = f"fp8 GEMM {FP8_SIZE}"
    if dtype is None:
        out.append(Measurement("gpu", name, subject, None, "TFLOP/s", reason=f"no FP8 GEMMs on {ident.arch}"))
        return out
    n = FP8_SIZE
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    one = torch.ones((), device="cuda")
    ms = _time_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    peak = peaks.peak_tflops("f8e4m3") if peaks else None
    out.append(Measurement(
        "gpu", name, subject, 2 * n**3 / (ms * 1e-3) / 1e12, "TFLOP/s",
        peak * FP8_FLOOR if peak else None,
        f"{FP8_FLOOR:.0%} of the {peak:g} TFLOP/s datasheet peak" if peak else "", peers=True))
    return out


def hbm_measurement(subject: str, nbytes: int = HBM_COPY_BYTES) -> Measurement:
    import torch

    peaks = lookup_peaks(current_device().name)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    gb_s = 2 * nbytes / (_time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
    peak = peaks.hbm_tb_s * 1e3 if peaks and peaks.hbm_tb_s else None
    return Measurement("gpu", "HBM copy", subject, gb_s, "GB/s", peak * HBM_FLOOR if peak else None,
                       f"{HBM_FLOOR:.0%} of the {peak:g} GB/s datasheet figure" if peak else "", peers=True)


# ---- telemetry: one reader per management library ------------------------------------------

TEMPERATURE_MARGIN_C = 5.0  # fail this close to the GPU's slowdown temperature


def _nvml_readings(index: int) -> dict[str, Any]:
    import pynvml as nv
    import torch

    nv.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    handle = nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    read: dict[str, Callable[[], Any]] = {
        "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
        "sm_clock_max_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM),
        "memory_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM),
        "power_w": lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1e3,
        "power_limit_w": lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3,
        "temperature_c": lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
        "slowdown_temperature_c": lambda: nv.nvmlDeviceGetTemperatureThreshold(
            handle, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
        "ecc_uncorrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
            handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
        "rows_pending_remap": lambda: nv.nvmlDeviceGetRemappedRows(handle)[2],
    }
    return _read_all(read)


def _amdsmi_readings(index: int) -> dict[str, Any]:
    import amdsmi as am
    import torch

    am.amdsmi_init()
    bus = torch.cuda.get_device_properties(index).pci_bus_id
    handle = next(h for h in am.amdsmi_get_processor_handles()
                  if int(str(am.amdsmi_get_gpu_device_bdf(h)).split(":")[1], 16) == bus)
    gfx = am.AmdSmiClkType.GFX
    read: dict[str, Callable[[], Any]] = {
        "sm_clock_mhz": lambda: am.amdsmi_get_clock_info(handle, gfx)["clk"],
        "sm_clock_max_mhz": lambda: am.amdsmi_get_clock_info(handle, gfx)["max_clk"],
        "memory_clock_mhz": lambda: am.amdsmi_get_clock_info(handle, am.AmdSmiClkType.MEM)["clk"],
        "power_w": lambda: am.amdsmi_get_power_info(handle)["current_socket_power"],
        "power_limit_w": lambda: am.amdsmi_get_power_cap_info(handle)["power_cap"] / 1e6,  # uW
        "temperature_c": lambda: am.amdsmi_get_temp_metric(
            handle, am.AmdSmiTemperatureType.HOTSPOT, am.AmdSmiTemperatureMetric.CURRENT),
        "slowdown_temperature_c": lambda: am.amdsmi_get_temp_metric(
            handle, am.AmdSmiTemperatureType.HOTSPOT, am.AmdSmiTemperatureMetric.CRITICAL),
        "ecc_uncorrected": lambda: am.amdsmi_get_gpu_total_ecc_count(handle)["uncorrectable_count"],
    }
    return _read_all(read)


def _read_all(read: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each reading, or the one-line reason it is not available on this GPU or driver."""
    out: dict[str, Any] = {}
    for key, fn in read.items():
        try:
            out[key] = float(fn())
        except Exception as exc:  # an API this driver or part lacks
            out[key] = f"not available: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return out


TELEMETRY: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "nvidia": ("pynvml", _nvml_readings),  # pip install nvidia-ml-py
    "amd": ("amdsmi", _amdsmi_readings),
}


def telemetry_measurements(subject: str, index: int, vendor: str) -> list[Measurement]:
    """Clocks (read right after the GEMMs: under load), power, temperature, ECC."""
    module, reader = TELEMETRY[vendor]
    try:
        readings = reader(index)
    except ImportError:
        return [Measurement("telemetry", "management library", subject, None,
                            reason=f"{module} is not installed: no clocks, power, temperature or ECC")]

    def value(key: str) -> float | None:
        v = readings.get(key)
        return v if isinstance(v, float) else None

    def why(key: str) -> str:
        v = readings.get(key)
        return v if isinstance(v, str) else ""

    slowdown = value("slowdown_temperature_c")
    limit = value("power_limit_w")
    out = [
        Measurement("telemetry", "SM clock after GEMMs", subject, value("sm_clock_mhz"), "MHz", peers=True,
                    reason=why("sm_clock_mhz")),
        Measurement("telemetry", "SM clock max", subject, value("sm_clock_max_mhz"), "MHz", peers=True,
                    reason=why("sm_clock_max_mhz")),
        Measurement("telemetry", "memory clock", subject, value("memory_clock_mhz"), "MHz", peers=True,
                    reason=why("memory_clock_mhz")),
        Measurement("telemetry", "power limit", subject, limit, "W", peers=True, reason=why("power_limit_w")),
        Measurement("telemetry", "power", subject, value("power_w"), "W", limit, "the enforced power limit",
                    higher_is_better=False, reason=why("power_w")),
        Measurement("telemetry", "temperature", subject, value("temperature_c"), "°C",
                    slowdown - TEMPERATURE_MARGIN_C if slowdown else None,
                    f"{TEMPERATURE_MARGIN_C:g} °C below the slowdown temperature" if slowdown else "",
                    higher_is_better=False, reason=why("temperature_c")),
        Measurement("telemetry", "uncorrected ECC errors (volatile)", subject, value("ecc_uncorrected"), "",
                    0.0, "none", higher_is_better=False, reason=why("ecc_uncorrected")),
    ]
    if "rows_pending_remap" in readings:
        out.append(Measurement("telemetry", "rows pending remap", subject, value("rows_pending_remap"), "",
                               0.0, "none (a reset is due)", higher_is_better=False,
                               reason=why("rows_pending_remap")))
    return out


def gpu_measurements(subject: str, index: int, sizes: tuple[int, ...] = GEMM_SIZES) -> list[Measurement]:
    """Every per-GPU figure of GPU ``index`` (the current device)."""
    vendor = current_device(index).vendor
    out = gemm_measurements(subject, sizes)
    out += telemetry_measurements(subject, index, vendor)  # right after the GEMMs: clocks under load
    out.append(hbm_measurement(subject))
    return out
