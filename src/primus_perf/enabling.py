"""``primus_perf.enable``: tuned kernels in any PyTorch program, the one public way to turn
routing on.

::

    import primus_perf
    with primus_perf.enable(cache="tuning_cache.json") as tuned:
        train()                      # unmodified PyTorch code
    print(tuned.summary())           # per kind: calls routed, fell back, entries stale ...

It is the runtime's ``enable`` (``runtime.handle``: read the cache, install the routers and
the dispatcher overrides) with, for ``online=True``, the tuner's in-step tuning
(``tuner.online.InStepTuning``) plugged in: this module sits above both, so the runtime
never reaches the tuner. Lower level, ``runtime.activate`` builds the routers without
installing them (the closed loop's interleaved measurement installs and removes them in
turn).

Without editing the program: ``python -m primus_perf.launch --cache PATH -- script.py
args`` (``launch.py``), or the ``PRIMUS_PERF_CACHE`` environment variable with the
start-up hook (``env_hook.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from primus_perf.base.devices import DeviceIdentity
from primus_perf.runtime.handle import Handle, rank0_stderr
from primus_perf.runtime.handle import enable as enable_runtime


def enable(
    cache: str | os.PathLike | None,
    online: bool = False,
    kinds: Iterable[str] | None = None,
    *,
    device_type: str | None = None,
    device: DeviceIdentity | None = None,
    router_kinds: Mapping[str, Any] | None = None,
    online_options: Mapping[str, Any] | None = None,
    log: Callable[[str], None] | None = rank0_stderr,
) -> Handle:
    """Route this process's GEMMs, grouped GEMMs and SDPA calls to the cache's choices.

    ``cache``: the tuning cache (read once; with ``online``, also written: a missing file
    is then created); ``online``: tune the problems the cache does not hold during the
    first steps; ``kinds``: which kinds (names of ``primus_perf.kinds``; default every
    routable one); ``device_type``:
    whose kernels are overridden ("cuda"; "cpu" where there is no GPU); ``router_kinds``:
    kind -> router part (tests pass fake kernels);
    ``online_options``: keywords of the online tuning (``policy``, ``clock``,
    ``adapters``); ``log``: where online tuning's reports go (None: nowhere). Nothing else
    is printed: ``Handle.start_lines()`` and ``end_lines()`` say what happened."""
    if online:
        from primus_perf.tuner.online import InStepTuning
    strategy = InStepTuning(**dict(online_options or {})) if online else None
    return enable_runtime(cache, strategy, kinds, device_type=device_type, device=device,
                          router_kinds=router_kinds, log=log)
