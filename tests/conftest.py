"""Shared test setup.

Triton reads ``TRITON_INTERPRET`` when it is first imported, and any test module may be the
first to import it (through the package), so the choice is made here, before any test
module is collected: the interpreter on a machine without a GPU; on a GPU machine the
caller decides (``TRITON_INTERPRET=0 pytest -m gpu``).
"""

from __future__ import annotations

import os
import shutil


def _has_gpu() -> bool:
    return bool(shutil.which("nvidia-smi") or shutil.which("rocm-smi") or os.path.exists("/dev/kfd"))


if not _has_gpu():
    os.environ.setdefault("TRITON_INTERPRET", "1")
