"""Parallelism applied from outside the model: the model modules import nothing of it, a
one-rank parallelize leaves the model as built, and the module swap keeps the module's
state and reaches the model's own methods. (TP, EP, DDP and FSDP2 against one process:
tests/trainer/test_trainer.py, test_moe.py, test_fsdp.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

from primus_perf.trainer.config import load_config
from primus_perf.trainer.moe import build_model
from primus_perf.trainer.parallel import ProcessGroups, swap_class
from primus_perf.trainer.parallelize import parallelize

TRAINER = Path(__file__).resolve().parents[2] / "src" / "primus_perf" / "trainer"
PARALLEL = {"comm", "parallel", "parallelize", "tensor_parallel", "expert_parallel", "fsdp"}


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_model_modules_import_nothing_of_parallelism() -> None:
    for name in ("model.py", "moe.py"):
        imports = _imports(TRAINER / name)
        assert not any(m.startswith("torch.distributed") for m in imports), (name, imports)
        assert not {f"primus_perf.trainer.{p}" for p in PARALLEL} & imports, (name, imports)


def test_one_rank_parallelize_leaves_the_model_as_built() -> None:
    cfg = load_config("tiny-moe", ["model.moe.n_shared_experts=1"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    classes = {name: type(m) for name, m in model.named_modules()}
    params = dict(model.named_parameters())
    out = parallelize(model, ProcessGroups(), cfg.parallel, device=torch.device("cpu"), bf16=False)
    assert out is model
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert all(p is params[name] for name, p in model.named_parameters())


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight * self.scale


class _Negate:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -super().forward(x)  # type: ignore[misc]


def test_swap_class_layers_the_mixin_over_the_module_class() -> None:
    a, b = _Plain(), _Plain()
    weight = a.weight
    swap_class(a, _Negate)
    swap_class(b, _Negate)
    assert type(a) is type(b) and type(a).__name__ == "_Negate_Plain"
    assert isinstance(a, _Plain) and isinstance(a, _Negate)
    assert a.weight is weight and a.scale == 2.0
    torch.testing.assert_close(a(torch.ones(3)), torch.full((3,), -2.0))
