"""Only what pyproject.toml cannot say: the start-up hook ``primus_perf_enable.pth`` goes to
the root of site-packages (``primus_perf/env_hook.py`` says what it does)."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "primus_perf_enable.pth"


class BuildWithHook(build_py):
    def run(self) -> None:
        super().run()
        shutil.copyfile(Path(__file__).parent / "src" / PTH, Path(self.build_lib) / PTH)


setup(cmdclass={"build_py": BuildWithHook})
