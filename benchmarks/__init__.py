"""The benchmarks, grouped by area (the index: ``benchmarks/README.md``).

Each script runs from the checkout as ``python benchmarks/<area>/<script>.py``. A script that
uses another one imports it by its package name (``from benchmarks.moe.moe_e2e import
rotated_blocks``), after one line that puts the checkout on ``sys.path``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

Results go to ``RESULTS / <bench> / <device>.json`` (``h100``, ``h200``, ``2xh200``, ``cpu``):
the latest only; git keeps the earlier ones.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout
RESULTS = ROOT / "benchmarks" / "results"
