"""Device identity and the peak table used for MFU and roofline figures.

Peaks are the vendors' datasheet figures for dense math (no structured sparsity), in
TFLOP/s, and HBM bandwidth in TB/s. They are the denominators of MFU and % of roofline;
measured ceilings are lower (an H100 SXM runs an 8192^3 bf16 GEMM at about 800 TFLOP/s).

The table is data: one row per device, matched by a regular expression over the name
that ``torch.cuda.get_device_name()`` returns (also on ROCm builds of torch). The first
matching row wins, so more specific patterns come first.
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import asdict, dataclass, field

from primus_perf.base.errors import DeviceError


@dataclass(frozen=True)
class DevicePeaks:
    """Datasheet peaks of one GPU model."""

    key: str  # short stable name, e.g. "h100-sxm"
    pattern: str  # regex matched (case-insensitive) against the device name
    vendor: str  # "nvidia" or "amd"
    tflops: dict[str, float] = field(default_factory=dict)  # dtype name -> dense TFLOP/s (int8: TOPS, "i8")
    hbm_tb_s: float = 0.0
    l2_bytes: int = 0
    compute_units: int = 0  # SMs (NVIDIA) or CUs (AMD)
    source: str = ""  # the vendor document the figures are from

    def peak_tflops(self, dtype: str) -> float | None:
        """Dense peak for a dtype name from ``problems.DTYPES`` ("bf16", "f16", ...)."""
        return self.tflops.get(dtype)


def _nv(bf16: float | None, tf32: float | None, f32: float, f8: float | None, f16: float | None = None,
        i8: float | None = None) -> dict[str, float]:
    """NVIDIA dense tensor-core peaks (f16 = bf16 unless given; None: not supported or not published)."""
    table = {"f32": f32, "bf16": bf16, "f16": bf16 if f16 is None else f16, "tf32": tf32, "f8e4m3": f8,
             "f8e5m2": f8, "i8": i8}
    return {dtype: peak for dtype, peak in table.items() if peak is not None}


# AMD dense matrix-core peaks: the same rules (f16 = bf16 unless given; f32: the matrix fp32 peak)
_amd = _nv


MiB = 1 << 20
_NV = "https://www.nvidia.com/en-us/data-center/"
_AMD = "https://www.amd.com/en/products/accelerators/instinct/"

# Dense datasheet figures (TFLOP/s without structured sparsity: a datasheet's "with
# sparsity" figure halved; HBM/GDDR TB/s; L2; SMs/CUs), each row with its source. The name
# patterns match what ``torch.cuda.get_device_name()`` and Kineto's ``deviceProperties``
# write ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PG509-200",
# "NVIDIA H800", "NVIDIA GH200 480GB", "Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA B200",
# "AMD Instinct MI300X VF", "AMD Instinct MI210", "AMD Instinct MI350X"); a device no row
# matches has no roof ("n/a"), never a wrong one. Not listed, having no vendor datasheet
# with dense figures: NVIDIA A10G (AWS's variant of the A10) and AMD Instinct MI308X. An
# MI250/MI250X shows torch one device per graphics compute die (GCD), so its rows are per
# GCD: half the package's datasheet figures ("MI250X/MI250", the name ROCm gives both,
# takes the MI250's lower figures).
PEAK_TABLE: tuple[DevicePeaks, ...] = (
    # ---- NVIDIA Blackwell
    DevicePeaks("gb300", r"\bGB300\b", "nvidia", _nv(2500.0, 1250.0, 80.0, 5000.0), 8.0, 126 * MiB, 160,
                _NV + "gb300-nvl72/ (GB300 NVL72 datasheet, per GPU: the rack's dense figures / 72)"),
    DevicePeaks("b300", r"\bB300\b", "nvidia", _nv(2250.0, 1125.0, 75.0, 4500.0), 8.0, 126 * MiB, 160,
                _NV + "hgx/ (HGX B300 datasheet, per GPU: the 8-GPU sparse figures / 16)"),
    DevicePeaks("gb200", r"\bGB200\b", "nvidia", _nv(2500.0, 1250.0, 80.0, 5000.0, i8=5000.0), 8.0, 126 * MiB, 148,
                _NV + "gb200-nvl72/ (GB200 NVL72 datasheet, per GPU)"),
    DevicePeaks("b200", r"\bB200\b", "nvidia", _nv(2250.0, 1125.0, 75.0, 4500.0, i8=4500.0), 8.0, 126 * MiB, 148,
                _NV + "hgx/ (HGX B200 / DGX B200 datasheet, per GPU)"),
    DevicePeaks("rtx-pro-6000", r"RTX PRO 6000", "nvidia", _nv(None, None, 125.0, None), 1.792, 128 * MiB, 188,
                "https://www.nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/ "
                "(RTX PRO 6000 Blackwell datasheet: fp32 only; tensor peaks are published for FP4 with sparsity)"),
    # ---- NVIDIA Hopper
    DevicePeaks("gh200-hbm3e", r"\bGH200\b.*(144|624)", "nvidia", _nv(989.4, 494.7, 66.9, 1978.9, i8=1978.9), 4.9,
                50 * MiB, 132, _NV + "grace-hopper-superchip/ (GH200 datasheet, 144 GB HBM3e)"),
    DevicePeaks("gh200", r"\bGH200\b", "nvidia", _nv(989.4, 494.7, 66.9, 1978.9, i8=1978.9), 4.0, 50 * MiB, 132,
                _NV + "grace-hopper-superchip/ (GH200 datasheet, 96 GB HBM3: \"GH200 480GB\")"),
    DevicePeaks("h200-nvl", r"\bH200\b.*NVL", "nvidia", _nv(835.5, 417.5, 60.0, 1670.5, i8=1670.5), 4.8, 50 * MiB, 132,
                _NV + "h200/ (H200 NVL datasheet)"),
    DevicePeaks("h200", r"\bH200\b", "nvidia", _nv(989.4, 494.7, 66.9, 1978.9, i8=1978.9), 4.8, 50 * MiB, 132,
                _NV + "h200/ (H200 SXM datasheet)"),
    DevicePeaks("h20", r"\bH20\b", "nvidia", _nv(148.0, 74.0, 44.0, 296.0, i8=296.0), 4.0, 60 * MiB, 78,
                "NVIDIA H20 product brief"),
    DevicePeaks("h800-pcie", r"\bH800\b.*PCIe", "nvidia", _nv(756.5, 378.0, 51.2, 1513.0, i8=1513.0), 2.0, 50 * MiB,
                114, "NVIDIA H800 PCIe product brief (the H100 PCIe's tensor peaks; FP64 and NVLink reduced)"),
    DevicePeaks("h800", r"\bH800\b", "nvidia", _nv(989.4, 494.7, 66.9, 1978.9, i8=1978.9), 3.35, 50 * MiB, 132,
                "NVIDIA H800 SXM5 product brief (the H100 SXM's tensor peaks; FP64 and NVLink reduced)"),
    DevicePeaks("h100-pcie", r"\bH100\b.*PCIe", "nvidia", _nv(756.5, 378.0, 51.2, 1513.0, i8=1513.0), 2.0, 50 * MiB,
                114, _NV + "h100/ (H100 datasheet, PCIe)"),
    DevicePeaks("h100-nvl", r"\bH100\b.*NVL", "nvidia", _nv(835.5, 417.5, 60.0, 1670.5, i8=1670.5), 3.9, 50 * MiB, 132,
                _NV + "h100/ (H100 datasheet, NVL)"),
    DevicePeaks("h100-sxm", r"\bH100\b", "nvidia", _nv(989.4, 494.7, 66.9, 1978.9, i8=1978.9), 3.35, 50 * MiB, 132,
                _NV + "h100/ (H100 datasheet, SXM5)"),
    # ---- NVIDIA Ada Lovelace
    DevicePeaks("l40s", r"\bL40S\b", "nvidia", _nv(362.05, 183.0, 91.6, 733.0, i8=733.0), 0.864, 96 * MiB, 142,
                _NV + "l40s/ (L40S datasheet)"),
    DevicePeaks("l40", r"\bL40\b", "nvidia", _nv(181.05, 90.5, 90.5, 362.0, i8=362.0), 0.864, 96 * MiB, 142,
                _NV + "l40/ (L40 datasheet)"),
    DevicePeaks("l4", r"\bL4\b", "nvidia", _nv(121.0, 60.0, 30.3, 242.5, i8=242.5), 0.3, 48 * MiB, 58,
                _NV + "l4/ (L4 datasheet)"),
    DevicePeaks("rtx-6000-ada", r"RTX 6000 Ada", "nvidia", _nv(364.2, 182.1, 91.1, 728.5, i8=728.5), 0.96, 96 * MiB, 142,
                "https://www.nvidia.com/en-us/design-visualization/rtx-6000/ (RTX 6000 Ada datasheet)"),
    # ---- NVIDIA Ampere
    DevicePeaks("a100-pcie-40gb", r"\bA100\b.*PCIE.*40GB", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 1.555,
                40 * MiB, 108, _NV + "a100/ (A100 datasheet, PCIe 40GB)"),
    DevicePeaks("a100-sxm-40gb", r"\bA100\b.*SXM.*40GB", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 1.555,
                40 * MiB, 108, _NV + "a100/ (A100 datasheet, SXM4 40GB)"),
    DevicePeaks("a100-pcie", r"\bA100\b.*PCIE", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 1.935, 40 * MiB,
                108, _NV + "a100/ (A100 datasheet, PCIe 80GB)"),
    DevicePeaks("a100-sxm", r"\bA100\b", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 2.039, 40 * MiB, 108,
                _NV + "a100/ (A100 datasheet, SXM4 80GB)"),
    DevicePeaks("a800-pcie-40gb", r"\bA800\b.*PCIE.*40GB", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 1.555,
                40 * MiB, 108, "NVIDIA A800 PCIe 40GB product brief (the A100's peaks)"),
    DevicePeaks("a800-pcie", r"\bA800\b.*PCIE", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 1.935, 40 * MiB,
                108, "NVIDIA A800 PCIe 80GB product brief (the A100's peaks)"),
    DevicePeaks("a800-sxm", r"\bA800\b", "nvidia", _nv(312.0, 156.0, 19.5, None, i8=624.0), 2.039, 40 * MiB, 108,
                "NVIDIA A800 SXM4 80GB product brief (the A100's peaks; NVLink reduced)"),
    DevicePeaks("a40", r"\bA40\b", "nvidia", _nv(149.7, 74.8, 37.4, None, i8=299.3), 0.696, 6 * MiB, 84,
                _NV + "a40/ (A40 datasheet)"),
    DevicePeaks("a30", r"\bA30\b", "nvidia", _nv(165.0, 82.0, 10.3, None, i8=330.0), 0.933, 24 * MiB, 56,
                "https://www.nvidia.com/en-us/data-center/products/a30-gpu/ (A30 datasheet)"),
    DevicePeaks("a10", r"\bA10\b", "nvidia", _nv(125.0, 62.5, 31.2, None, i8=250.0), 0.6, 6 * MiB, 72,
                "https://www.nvidia.com/en-us/data-center/products/a10-gpu/ (A10 datasheet)"),
    DevicePeaks("rtx-a6000", r"RTX A6000", "nvidia", _nv(154.8, 77.4, 38.7, None), 0.768, 6 * MiB, 84,
                "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/ (RTX A6000 datasheet: 309.7 TFLOPS "
                "tensor with sparsity)"),
    # ---- NVIDIA Turing and Volta (no bf16, no tf32: fp16 tensor cores)
    DevicePeaks("t4", r"\bT4\b", "nvidia", _nv(None, None, 8.1, None, f16=65.0, i8=130.0), 0.32, 4 * MiB, 40,
                _NV + "tesla-t4/ (T4 datasheet)"),
    # SXM2 and DGX Station parts at the SXM2 clocks, PCIe at its own; V100S PCIe
    DevicePeaks("v100s-pcie", r"\bV100S\b", "nvidia", _nv(None, None, 16.4, None, f16=130.0), 1.134, 6 * MiB, 80,
                _NV + "v100/ (V100S datasheet)"),
    DevicePeaks("v100-pcie", r"\bV100\b.*PCIE", "nvidia", _nv(None, None, 14.0, None, f16=112.0), 0.9, 6 * MiB, 80,
                _NV + "v100/ (Tesla V100 datasheet, PCIe)"),
    DevicePeaks("v100-sxm2", r"\bV100\b", "nvidia", _nv(None, None, 15.7, None, f16=125.0), 0.9, 6 * MiB, 80,
                _NV + "v100/ (Tesla V100 datasheet, SXM2)"),
    # ---- AMD CDNA 4 (no TF32 hardware), CDNA 3, CDNA 2, CDNA 1 (matrix-core peaks)
    DevicePeaks("mi355x", r"\bMI355X?\b", "amd", _amd(2516.6, None, 157.3, 5033.2, i8=5033.2), 8.0, 0, 256,
                _AMD + "mi350.html (MI355X data sheet)"),
    DevicePeaks("mi350x", r"\bMI350X?\b", "amd", _amd(2307.2, None, 144.2, 4614.4, i8=4614.4), 8.0, 0, 256,
                _AMD + "mi350.html (MI350X data sheet)"),
    DevicePeaks("mi325x", r"\bMI325X?\b", "amd", _amd(1307.4, 653.7, 163.4, 2614.9, i8=2614.9), 6.0, 0, 304,
                _AMD + "mi300/mi325x.html (MI325X data sheet)"),
    DevicePeaks("mi300a", r"\bMI300A\b", "amd", _amd(980.6, 490.3, 122.6, 1961.2, i8=1961.2), 5.3, 0, 228,
                _AMD + "mi300/mi300a.html (MI300A data sheet)"),
    DevicePeaks("mi300x", r"\bMI300X?\b", "amd", _amd(1307.4, 653.7, 163.4, 2614.9, i8=2614.9), 5.3, 0, 304,
                _AMD + "mi300/mi300x.html (MI300X data sheet)"),
    DevicePeaks("mi250x", r"\bMI250X\b(?!/)", "amd", _amd(191.5, None, 47.9, None, i8=191.5), 1.6, 0, 110,
                _AMD + "mi200/mi250x.html (MI250X data sheet: 383 TFLOPS bf16, 95.7 fp32 matrix, 3.2 TB/s "
                "per package of two GCDs)"),
    DevicePeaks("mi250", r"\bMI250\b", "amd", _amd(181.0, None, 45.3, None, i8=181.0), 1.6, 0, 104,
                _AMD + "mi200/mi250.html (MI250 data sheet: 362.1 TFLOPS bf16, 90.5 fp32 matrix, 3.2 TB/s "
                "per package of two GCDs)"),
    DevicePeaks("mi210", r"\bMI210\b", "amd", _amd(181.0, None, 45.3, None, i8=181.0), 1.6, 0, 104,
                _AMD + "mi200/mi210.html (MI210 data sheet)"),
    DevicePeaks("mi100", r"\bMI100\b", "amd", _amd(92.3, None, 46.1, None, f16=184.6, i8=184.6), 1.2288, 8 * MiB, 120,
                _AMD + "mi100.html (MI100 data sheet)"),
)


def lookup_peaks(device_name: str) -> DevicePeaks | None:
    """The peak row for a device name, or None for an unknown device (MFU "n/a")."""
    for row in PEAK_TABLE:
        if re.search(row.pattern, device_name, flags=re.IGNORECASE):
            return row
    return None


# Devices a trace names with an empty string (ROCm 7 writes ``"name": ""`` in
# ``deviceProperties``), told apart by what the properties do record: (computeMajor,
# computeMinor) = the gfx version, compute units, and memory in GiB. Only combinations that
# one product alone has (MI300X and MI325X differ in memory only; an MI210 and one die of
# an MI250 look alike, as do MI350X and MI355X, so those stay unknown).
UNNAMED_DEVICES: tuple[tuple[int, int, int, int, str], ...] = (
    (9, 4, 304, 192, "AMD Instinct MI300X"),
    (9, 4, 304, 256, "AMD Instinct MI325X"),
)


def name_from_properties(props: dict) -> str | None:
    """The device of an unnamed ``deviceProperties`` entry, from its gfx version, compute
    units and memory (:data:`UNNAMED_DEVICES`), saying so in the name; None when unknown."""
    try:
        major, minor, units = int(props["computeMajor"]), int(props["computeMinor"]), int(props["numSms"])
        gib = int(props["totalGlobalMem"]) / (1 << 30)
    except (KeyError, TypeError, ValueError):
        return None
    for ma, mi, cu, mem, name in UNNAMED_DEVICES:
        if (ma, mi, cu) == (major, minor, units) and abs(gib - mem) <= 4:
            return f"{name} (unnamed in the trace: gfx{major}{minor}x, {units} CUs, {gib:.0f} GiB)"
    return None


@dataclass(frozen=True)
class DeviceIdentity:
    """What makes a tuning result valid: the same GPU model, arch and SM/CU count."""

    name: str
    vendor: str  # "nvidia", "amd" or "cpu"
    arch: str  # "sm_90", "gfx942", or "cpu"
    compute_units: int
    memory_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DeviceIdentity:
        return cls(
            name=str(data["name"]),
            vendor=str(data["vendor"]),
            arch=str(data["arch"]),
            compute_units=int(data["compute_units"]),
            memory_bytes=int(data.get("memory_bytes", 0)),
        )

    def same_hardware(self, other: DeviceIdentity) -> bool:
        """Memory size is informational; name, arch and unit count decide reuse."""
        return (self.name, self.arch, self.compute_units) == (
            other.name,
            other.arch,
            other.compute_units,
        )


def gpu_vendor() -> str:
    """"nvidia" or "amd" for the GPU torch sees (a ROCm build of torch reports AMD GPUs
    through ``torch.cuda``), "cpu" when there is none. The one place that tells vendors apart
    at run time."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "amd" if torch.version.hip is not None else "nvidia"


def current_device(index: int | None = None) -> DeviceIdentity:
    """Identity of the current (or given) GPU; a CPU identity when there is none."""
    import torch

    vendor = gpu_vendor()
    if vendor == "cpu":
        return DeviceIdentity(name="cpu", vendor="cpu", arch="cpu", compute_units=0)
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if vendor == "amd":
        arch = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
    else:
        arch = f"sm_{props.major}{props.minor}"
    return DeviceIdentity(
        name=props.name,
        vendor=vendor,
        arch=arch,
        compute_units=props.multi_processor_count,
        memory_bytes=props.total_memory,
    )


def require_gpu() -> DeviceIdentity:
    """The current GPU's identity, or a one-line DeviceError when there is none."""
    ident = current_device()
    if ident.vendor == "cpu":
        raise DeviceError("no CUDA or ROCm GPU is visible to torch")
    return ident


def library_versions() -> dict[str, str]:
    """The versions that decide kernel speed and reuse: python, torch, CUDA or HIP, cuDNN,
    Triton ("none" when absent) and this package. The one definition: a tuning-cache kind
    keeps the subset it depends on; the BLAS-Lt library reports its own version through its
    binding (``kernels.blaslt``)."""
    import platform

    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.version.cuda:
        versions["cuda"] = str(torch.version.cuda)
    if torch.version.hip:
        versions["hip"] = str(torch.version.hip)
    if torch.backends.cudnn.is_available() and torch.backends.cudnn.version():
        versions["cudnn"] = str(torch.backends.cudnn.version())
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = "none"
    try:
        versions["primus_perf"] = importlib.metadata.version("primus-perf")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        versions["primus_perf"] = "source"
    return versions


# Shared memory (bytes) one Triton program may use, by architecture prefix; first match
# wins. Sources: CUDA programming guide (compute capabilities table: max shared memory per
# block, opt-in) and the AMD CDNA ISA guides (LDS per workgroup).
SHARED_MEMORY_PER_BLOCK: tuple[tuple[str, int], ...] = (
    ("sm_90", 232_448),
    ("sm_100", 232_448),
    ("sm_120", 101_376),
    ("sm_89", 101_376),
    ("sm_86", 101_376),
    ("sm_80", 166_912),
    ("gfx950", 163_840),
    ("gfx94", 65_536),
    ("gfx9", 65_536),
    ("cpu", 1 << 30),  # the Triton interpreter has no limit
)


def shared_memory_per_block(arch: str) -> int:
    """Shared memory (LDS) one program may use on ``arch`` ("sm_90", "gfx942", "cpu");
    64 KiB for an architecture the table does not know."""
    for prefix, limit in SHARED_MEMORY_PER_BLOCK:
        if arch.startswith(prefix):
            return limit
    return 65_536
