"""Wall-clock step times: how long each ``ProfilerStep#N`` took on the host, beside the GPU's
step span (:mod:`.breakdown`). A host step much longer than the GPU span means the GPU
waited for the host (data loading, Python, synchronization); a GPU span much longer than
the host step means the host ran ahead and the GPU is the bottleneck."""

from __future__ import annotations

import pandas as pd

from primus_perf.tracelens.link import Linked

COLUMNS = ["rank", "step", "wall_s"]


def host_steps(lk: Linked, rank: int) -> pd.DataFrame:
    """Per step of one trace: the host duration of its ``ProfilerStep#N`` annotation (s)."""
    win = lk.step_windows
    return pd.DataFrame({"rank": [rank] * len(lk.steps), "step": list(lk.steps),
                         "wall_s": (win[:, 1] - win[:, 0]) / 1e6 if len(win) else []}, columns=COLUMNS)
