"""The built wheel works outside the checkout: installed into an empty folder, it trains the
`tiny` preset for 2 steps from another directory (presets and report assets are package
data, nothing is read from the source tree)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("primus_perf-*.whl")
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    return target


def test_wheel_carries_presets_and_report_assets(installed):
    pkg = installed / "primus_perf"
    assert (pkg / "trainer" / "presets" / "tiny.yaml").is_file()
    assert (pkg / "tracelens" / "report_assets").is_dir()
    assert not (installed / "configs").exists()


def test_installed_wheel_trains_tiny_from_another_directory(installed, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(installed)}
    code = ("import primus_perf, sys; from pathlib import Path; "
            f"assert Path(primus_perf.__file__).is_relative_to({str(installed)!r}), primus_perf.__file__; "
            "from primus_perf.cli.train import main; sys.argv = ['primus-train', '--config', 'tiny', "
            "'--steps', '2']; main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step    2/2" in out.stdout, out.stdout


def test_wheel_installs_the_enable_hook_at_the_site_root(installed):
    from primus_perf.env_hook import PTH_LINE

    assert (installed / "primus_perf_enable.pth").read_text().strip() == PTH_LINE


def test_wheel_has_no_tests_or_benchmarks(installed):
    names = {p.name for p in installed.iterdir()}
    assert "tests" not in names and "benchmarks" not in names


def test_editable_install_carries_the_enable_hook(tmp_path):
    """`pip install -e .` (the Quick start's install) installs the hook too: with
    PRIMUS_PERF_CACHE set, a plain Python process starts with enable() on."""
    wheels, site_dir = tmp_path / "wheels", tmp_path / "site"
    build = "import sys; from setuptools import build_meta; build_meta.build_editable(sys.argv[1])"
    subprocess.run([sys.executable, "-c", build, str(wheels)], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
    (wheel,) = wheels.glob("primus_perf-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(site_dir), str(wheel)], check=True, capture_output=True, timeout=300)
    cache = ROOT / "benchmarks" / "results" / "closed_loop" / "h100" / "tuning_cache.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PRIMUS_PERF_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({str(site_dir)!r})"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "primus_perf: tuning cache" in out.stderr, out.stderr[-2000:]
