"""The device of a trace that does not name it (no ``deviceProperties``: a merged trace, a
GPU-only export), inferred from the architecture its kernels were built for.

Kernel names carry it: hipBLASLt's ``..._ISA942_...``, ``gfx942`` in other ROCm kernels;
cuBLAS/cuDNN's ``sm90_xmma_...``, CUTLASS's ``cutlass3x_sm90_...``/``cutlass_80_...``,
``cutlass::arch::Sm90``, TensorRT-LLM's ``..._sm100f``. :data:`ARCH_DEVICES` maps each
architecture to the device whose datasheet row (``devices.PEAK_TABLE``) stands for it, and
names the others that share it (their peaks differ: the roof is that one device's). An
architecture without a row (``sm_89``: an L4 and an L40S differ 3x) is named with no roof.

A kernel built for an older NVIDIA architecture runs on a newer one (``sm80_xmma`` kernels
on an H100), never the reverse, so the newest NVIDIA architecture seen is the device's; an
AMD code object runs only on its own ISA, so the one most kernels name is.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

# the architecture a kernel name says it was built for: NVIDIA's SM number, AMD's gfx ISA
_NVIDIA = re.compile(r"(?:(?<![A-Za-z0-9])sm_?|Sm|(?<![A-Za-z0-9])cutlass_)(\d{2,3})(?=[a-z]?(?![0-9]))")
_AMD = re.compile(r"(?:gfx|ISA)(9\d[0-9a-f]|1[0-2]\d[0-9a-f])(?![0-9a-f])")

# architecture -> (the device whose peaks stand for it, the others that share the architecture)
ARCH_DEVICES: dict[str, tuple[str, str]] = {
    "gfx950": ("AMD Instinct MI355X", "an MI350X shares the ISA at about 8% lower peaks"),
    "gfx942": ("AMD Instinct MI300X", "an MI325X shares the ISA with the same compute peaks and 6.0 TB/s of HBM; "
                                      "an MI300A or MI308X has lower peaks"),
    "gfx90a": ("AMD Instinct MI250X/MI250", "an MI210 has the same peaks (per die of an MI250); an MI250X die about "
                                            "6% higher"),
    "gfx908": ("AMD Instinct MI100", ""),
    "sm_103": ("NVIDIA B300", "a GB300 has about 11% higher bf16 peaks"),
    "sm_100": ("NVIDIA B200", "a GB200 has about 11% higher bf16 peaks"),
    "sm_90": ("NVIDIA H100", "an H800 or H200 has the same compute peaks (an H200 4.8 TB/s of HBM); an H100 PCIe or "
                             "NVL, H800 PCIe or H20 lower ones"),
    "sm_80": ("NVIDIA A100", "an A800 has the same peaks; an A30 lower ones"),
    "sm_75": ("Tesla T4", "other Turing GPUs (Quadro, GeForce RTX 20) have other peaks"),
    "sm_70": ("Tesla V100", "a V100 PCIe or V100S differs by up to 10%"),
}


@dataclass(frozen=True)
class Inferred:
    """A device inferred from kernel names: its name (what the peak table is looked up by,
    saying it was inferred), the architecture, how many kernel names said so, and the
    devices that share the architecture."""

    name: str
    arch: str
    kernels: int
    of: int
    shares: str

    @property
    def note(self) -> str:
        known = f"the roof is {self.name.split(' (')[0]}'s" if self.arch in ARCH_DEVICES else "no roof (no single device)"
        return (f"device: the trace does not name it; inferred from kernel names ({self.arch} in {self.kernels} of "
                f"{self.of} kernel names): {known}" + (f"; {self.shares}" if self.shares else ""))


def arch_of(kernel_name: str) -> tuple[str, str] | None:
    """(vendor, architecture) a kernel name says it was built for (``("amd", "gfx942")``,
    ``("nvidia", "sm_90")``), or None."""
    m = _AMD.search(kernel_name)
    if m:
        return "amd", f"gfx{m.group(1)}"
    m = _NVIDIA.search(kernel_name)
    return ("nvidia", f"sm_{m.group(1)}") if m else None


def infer_device(kernel_names: Iterable[str]) -> Inferred | None:
    """The device the kernels ran on (see the module docstring), or None when no name says."""
    names = list(kernel_names)
    found = Counter(a for a in map(arch_of, names) if a is not None)
    if not found:
        return None
    vendor = Counter(v for v, _ in found.elements()).most_common(1)[0][0]
    archs = {arch: n for (v, arch), n in found.items() if v == vendor}
    arch = max(archs, key=lambda a: int(a[3:])) if vendor == "nvidia" else max(archs, key=archs.__getitem__)
    device, shares = ARCH_DEVICES.get(arch, (f"{'NVIDIA' if vendor == 'nvidia' else 'AMD'} GPU", ""))
    return Inferred(f"{device} (inferred from kernel names: {arch})", arch, archs[arch], len(names), shares)
