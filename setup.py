"""Only what pyproject.toml cannot say: the start-up hook ``primus_perf_enable.pth`` goes to
the root of site-packages (``primus_perf/env_hook.py`` says what it does), from a wheel and
from an editable install (``pip install -e .``) alike."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "primus_perf_enable.pth"


class BuildWithHook(build_py):
    def run(self) -> None:
        super().run()
        # An editable install builds into a folder that is not installed: the hook goes
        # straight into the wheel being made (the install command's root, site-packages).
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        shutil.copyfile(Path(__file__).parent / "src" / PTH, Path(root) / PTH)


setup(cmdclass={"build_py": BuildWithHook})
