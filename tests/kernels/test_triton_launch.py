"""Launch options of our Triton kernels per vendor (``kernels.triton_launch``) and the
values each kernel's search tries per vendor."""

from __future__ import annotations

from primus_perf.kernels.attention.configs import BwdConfig, FwdConfig
from primus_perf.kernels.grouped.configs import GroupedGemmConfig
from primus_perf.kernels.triton_launch import launch_options
from primus_perf.tuner.attention.space import default_space as attention_space
from primus_perf.tuner.grouped.space import default_space as grouped_space


def test_launch_options_and_labels_carry_the_vendors_own_options() -> None:
    """One table of the options only one vendor's Triton knows, for the grouped GEMM's and
    the attention kernels' configs alike: passed to a launch on that vendor only, named in
    the label where a config sets them."""
    amd = GroupedGemmConfig(num_warps=4, num_stages=3, waves_per_eu=2, matrix_instr_nonkdim=16)
    assert launch_options(amd, "amd") == {
        "num_warps": 4,
        "num_stages": 3,
        "waves_per_eu": 2,
        "matrix_instr_nonkdim": 16,
    }
    assert launch_options(amd, "nvidia") == launch_options(amd, "cpu") == {"num_warps": 4, "num_stages": 3}
    assert amd.label() == "128x128x64 w4 s3 gm8 largest_first wpe2 mi16"
    assert GroupedGemmConfig().label() == "128x128x64 w8 s3 gm8 largest_first"
    fwd = FwdConfig(128, 64, 4, 1, waves_per_eu=2)
    assert launch_options(fwd, "amd") == {"num_warps": 4, "num_stages": 1, "waves_per_eu": 2}
    assert launch_options(fwd, "nvidia") == {"num_warps": 4, "num_stages": 1}
    assert fwd.label() == "128x64 w4 s1 wpe2 mi0"
    assert BwdConfig().label() == "dkdv 64x128 dq 128x64 w8 s3"
    # the searched values per vendor: stages as the vendor's Triton pipelines, ROCm's own options
    assert grouped_space("nvidia").axes["num_stages"] == (3, 4)
    assert {"num_stages": (2,), "waves_per_eu": (0, 2), "matrix_instr_nonkdim": (16,)}.items() <= (
        grouped_space("amd").axes.items())
    assert "waves_per_eu" not in grouped_space("nvidia").axes
    assert (attention_space("amd", 128).fwd["num_stages"], attention_space("amd", 128).bwd["num_stages"]) == ((1, 2), (1,))
    assert attention_space("nvidia", 128).bwd["num_stages"] == (2, 3)
