"""torchtitan 0.3's own float8 on its blocks' linear layers, reached from its command line (the
step tuner's ``fp8`` lever as torchtitan's flag, ``own_flags``): an ``@override`` of its config
override mechanism (``--override.imports primus_perf.tuner.step.torchtitan_fp8.float8_linears=
'{"recipe": "rowwise"}'``) that hands each linear layer's config under the model's ``layers`` to
torchtitan's own ``Float8LinearConverter`` with the recipe given (``tensorwise`` or
``rowwise``); the output head and the embeddings stay as they are. torchtitan applies it to its
config tree before it builds the model (so before FSDP2), as it applies a converter of its
model registry. Imported by torchtitan alone, where the flag names it.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.config import override
from torchtitan.models.common.linear import Linear

_converters: dict[str, Any] = {}  # recipe -> torchtitan's converter (built once: it logs)


@override(target=Linear.Config, fqns=["model_spec.model.layers.*"],
          description="primus-perf: the blocks' linear layers in float8 (torchtitan's converter)")
def float8_linears(cfg: Linear.Config, recipe: str = "rowwise") -> Linear.Config:
    if recipe not in _converters:
        _converters[recipe] = Float8LinearConverter.Config(recipe_name=recipe).build()  # type: ignore[arg-type]
    return _converters[recipe].convert(cfg)
