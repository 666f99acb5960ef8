"""Launch options of our Triton kernels, per vendor: ``num_warps`` and ``num_stages`` on
every vendor, and the options only one vendor's Triton backend knows (passing them to
another one is an error). The tile configs of the attention and grouped-GEMM kernels carry
them all as fields (a vendor's own option at 0: the compiler's default); each kernel's
search space says which values it tries per vendor."""

from __future__ import annotations

from typing import Any

# vendor -> its own launch options, each with its short name in a config's label
VENDOR_ONLY: dict[str, dict[str, str]] = {
    "nvidia": {},
    "cpu": {},
    "amd": {"waves_per_eu": "wpe", "matrix_instr_nonkdim": "mi"},
}


def launch_options(cfg: Any, vendor: str) -> dict[str, int]:
    """``cfg``'s ``num_warps`` and ``num_stages``, and the options of ``vendor``'s own that
    it sets (non-zero), for a launch on that vendor's GPU."""
    opts = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    for name in VENDOR_ONLY.get(vendor, {}):
        value = getattr(cfg, name)
        if value:
            opts[name] = value
    return opts


def options_label(cfg: Any) -> str:
    """The vendor's own options of a config that sets any (``" wpe2 mi16"``), else ""."""
    text = ""
    for options in VENDOR_ONLY.values():
        if any(getattr(cfg, name) for name in options):
            text += "".join(f" {short}{getattr(cfg, name)}" for name, short in options.items())
    return text
