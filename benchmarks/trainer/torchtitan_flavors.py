"""torchtitan's llama3 flavors sliced to their first few layers, for the step tuner's torchtitan
case (``torchtitan_case.py``): torchtitan imports this module itself, its model's dimensions
being no command-line options.

- torchtitan 0.2: ``--experimental.custom_import benchmarks.trainer.torchtitan_flavors
  --model.flavor 8B_4layers``: importing it adds ``<flavor>_<n>layers`` (n = 1, 2, 4, 8) to
  its llama3 flavors;
- torchtitan 0.3: ``--module benchmarks.trainer.torchtitan_flavors --config
  llama3_8B_4layers``: a config function of its kind, made by this module's ``__getattr__``
  from its own ``llama3_<flavor>`` config function.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

LAYERS = (1, 2, 4, 8)


def sliced(flavor: str, layers: int) -> Any:
    """torchtitan 0.3's ``llama3_<flavor>`` config (``llama3_8b``, ``llama3_debugmodel``) with its
    model's first ``layers`` blocks."""
    from torchtitan.models.llama3 import config_registry

    config = getattr(config_registry, f"llama3_{flavor.lower()}")()
    model = config.model_spec.model
    if not 1 <= layers <= len(model.layers):
        raise ValueError(f"llama3 {flavor} has {len(model.layers)} layers: {layers} is not between 1 and that")
    model.layers = model.layers[:layers]
    return config


def __getattr__(name: str) -> Any:
    """``llama3_<flavor>_<n>layers``: a torchtitan 0.3 config function (no arguments)."""
    found = re.fullmatch(r"llama3_(\w+?)_(\d+)layers", name)
    if found is None:
        raise AttributeError(name)
    flavor, layers = found.group(1), int(found.group(2))
    return lambda: sliced(flavor, layers)


def _register_flavors() -> None:
    """torchtitan 0.2: its llama3 flavors' arguments with ``n_layers`` cut, under new names."""
    try:
        from torchtitan.models.llama3 import llama3_args
    except ImportError:  # torchtitan 0.3: the config functions above
        return
    for flavor, args in list(llama3_args.items()):
        for n in LAYERS:
            if n < args.n_layers:
                llama3_args.setdefault(f"{flavor}_{n}layers", dataclasses.replace(args, n_layers=n))


_register_flavors()
