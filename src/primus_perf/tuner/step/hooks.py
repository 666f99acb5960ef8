"""A step plan applied to a program running in this process, from outside: the levers of a
user's script (``levers.ScriptPart``) through hooks on the objects it builds, and the settings
it consents to have tuned (:func:`knob`).

What is found, not configured: the first optimizer built (``torch.optim.Optimizer``) holds the
model's parameters; the model is the outermost module called whose parameters hold the
optimizer's first; its repeated blocks are the children of the ``nn.ModuleList`` or
``nn.ModuleDict`` (torchtitan's ``layers``) holding most of its parameters (two or more). On the model's first call, before its forward runs, the plan's
model levers apply (:func:`_apply_model`): blocks compiled in place or the whole model,
activation checkpointing of the blocks, torchao float8 on the blocks' linear layers (never the
output head), FSDP2's reshard after forward and prefetch where ``fully_shard`` was applied; on
the first optimizer step, the optimizer's implementation (fused, foreach). Set at start-up:
the SDPA backend, the allocator's expandable segments (before CUDA starts), DDP's bucket size,
``gradient_as_bucket_view`` and ``static_graph`` (its constructor's keywords), and for an HF
``Trainer`` script the micro-batch (``per_device_train_batch_size`` against
``gradient_accumulation_steps``, their product held). A lever that cannot apply says why in one
line (:attr:`Applied.notes`) and the program runs on without it.

:func:`knob` is the script's consent: ``mb = primus_perf.knob("micro_batch", 2)`` returns 2
outside a plan, the plan's value inside one; the script derives the rest (its accumulation
steps at its fixed global batch). Importing this module imports no torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from primus_perf.base import environment

MICRO_BATCH = "micro_batch"


@dataclass
class Applied:
    """What the plan did to the running program: ``notes`` (one line each for a lever that
    could not apply), ``found`` (the model, its blocks, the optimizer, the parallel wrappers,
    the knobs the program asked for), ``levers`` applied."""

    plan: dict[str, str] = field(default_factory=dict)
    levers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    found: dict[str, Any] = field(default_factory=dict)
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def note(self, lever: str, why: str) -> None:
        line = f"{lever}: not applied ({why})"
        if line not in self.notes:
            self.notes.append(line)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": dict(self.plan), "levers": list(self.levers), "notes": list(self.notes),
                "found": dict(self.found), "knobs": {k: dict(v) for k, v in self.knobs.items()}}


_applied = Applied()


def applied() -> Applied:
    """What :func:`install` applied in this process (empty outside a plan)."""
    return _applied


def knob(name: str, default: Any, *, choices: Any = None) -> Any:
    """The value of a setting the program consents to have tuned: ``default`` outside a plan,
    the plan's value (of ``default``'s type) inside one. ``choices``: the values that are legal
    for the program (the step tuner tries only those; by default, for ``micro_batch``, powers
    of two from 1 to 8 x ``default``). ``micro_batch``: sequences per forward and backward;
    the program keeps its global batch by deriving its accumulation steps from it."""
    entry = {"default": default}
    if choices is not None:
        entry["choices"] = list(choices)
    _applied.knobs[name] = entry
    value = _applied.plan.get(name)
    if value is None or value == "":
        return default
    if isinstance(default, bool):
        return value in ("true", "1", "yes")
    try:
        return type(default)(value) if default is not None else value
    except (TypeError, ValueError):
        from primus_perf.base.errors import UserError

        raise UserError(f"knob {name!r}: the plan's value {value!r} is not a {type(default).__name__}") from None


# ---- start-up ---------------------------------------------------------------------------------


def install(plan: Mapping[str, str]) -> Applied:
    """Apply ``plan`` (lever name -> value, as text) to the program about to run in this
    process: what is set at start-up now, the rest through hooks on what it builds."""
    global _applied
    uninstall()
    _applied = Applied(plan={k: str(v) for k, v in plan.items()})
    if plan.get("allocator") == "expandable":
        conf = environment.get("PYTORCH_CUDA_ALLOC_CONF")
        if "expandable_segments" not in conf:
            environment.set_here("PYTORCH_CUDA_ALLOC_CONF", ",".join(x for x in (conf, "expandable_segments:True") if x))
        _applied.levers.append("allocator")
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized() and plan.get("allocator") == "expandable":
        _applied.note("allocator", "CUDA started before the plan was applied")
    _install_sdpa(plan.get("sdpa"))
    _install_ddp({k: plan[k] for k in ("ddp_bucket_mb", "ddp_bucket_view", "ddp_static_graph") if k in plan})
    _after_import("transformers.training_args", _patch_hf_arguments, MICRO_BATCH)
    _Finder.install()
    import torch.optim.optimizer as optim

    _state["hooks"] = [optim.register_optimizer_step_pre_hook(_optimizer_step)]
    _patch_optimizer_init()
    _state["hooks"] += [torch.nn.modules.module.register_module_forward_pre_hook(_enter),
                        torch.nn.modules.module.register_module_forward_hook(_leave, always_call=True)]
    return _applied


_state: dict[str, Any] = {}


def uninstall() -> None:
    """Remove every hook and patch :func:`install` made and give the SDPA backends back their
    flags (what it applied to objects stays, and the allocator's setting, read once by CUDA)."""
    for h in _state.get("hooks", []):
        h.remove()
    for owner, name, original in reversed(_state.get("restore", [])):
        setattr(owner, name, original)
    for enable, was in _state.get("sdpa", []):
        enable(was)
    _after.clear()
    _state.clear()


def _install_sdpa(backend: str | None) -> None:
    """Only the named SDPA backend (and the math path as the fallback torch needs)."""
    if backend in (None, "", "default"):
        return
    import torch

    cuda = torch.backends.cuda
    flags = {"cudnn": (cuda.enable_cudnn_sdp, cuda.cudnn_sdp_enabled),
             "flash": (cuda.enable_flash_sdp, cuda.flash_sdp_enabled),
             "efficient": (cuda.enable_mem_efficient_sdp, cuda.mem_efficient_sdp_enabled)}
    if backend not in flags:
        _applied.note("sdpa", f"unknown backend {backend!r} (one of {', '.join(flags)})")
        return
    for name, (enable, enabled) in flags.items():
        _state.setdefault("sdpa", []).append((enable, enabled()))
        enable(name == backend)
    _applied.levers.append("sdpa")


def _install_ddp(options: Mapping[str, str]) -> None:
    """DDP's constructor takes the plan's bucket size, bucket view and static graph."""
    if not options:
        return
    from torch.nn.parallel import DistributedDataParallel as DDP

    def init(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        if "ddp_bucket_mb" in options:
            kwargs["bucket_cap_mb"] = float(options["ddp_bucket_mb"])
        if "ddp_bucket_view" in options:
            kwargs["gradient_as_bucket_view"] = options["ddp_bucket_view"] == "true"
        if "ddp_static_graph" in options:
            kwargs["static_graph"] = options["ddp_static_graph"] == "true"
        _applied.found["ddp"] = True
        original(self, *args, **kwargs)

    if _replace(DDP, "__init__", init):
        _applied.levers += [k for k in options]


def _replace(owner: Any, name: str, wrapper: Callable[..., Any]) -> bool:
    """``owner.name`` becomes ``wrapper(original, *args, **kwargs)`` until :func:`uninstall`
    gives the original back; False (nothing done) where it is this module's already."""
    original = getattr(owner, name)
    if getattr(original, "_primus_perf", False):
        return False

    def patched(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    patched._primus_perf = True  # type: ignore[attr-defined]
    setattr(owner, name, patched)
    _state.setdefault("restore", []).append((owner, name, original))
    return True


# ---- a module imported later: HF transformers' TrainingArguments --------------------------------


_after: dict[str, list[Callable[[Any], None]]] = {}


def _after_import(name: str, patch: Callable[[Any], None], lever: str) -> None:
    """``patch(module)`` once ``name`` is imported (now, if it is already); a patch that fails
    is ``lever``'s note, never the program's error (its import goes on unpatched)."""
    def safe(module: Any) -> None:
        try:
            patch(module)
        except Exception as exc:  # another version of the module: the lever does not apply
            from primus_perf.base.errors import one_line

            _applied.note(lever, f"{name} could not be hooked: {one_line(exc)}")

    if name in sys.modules:
        safe(sys.modules[name])
    else:
        _after.setdefault(name, []).append(safe)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a module :func:`_after_import` waits for."""

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _after:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader, patches = spec.loader, _after.pop(name)

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                for patch in patches:
                    patch(module)

        spec.loader = _Loader()
        return spec


def _patch_hf_arguments(module: Any) -> None:
    """HF ``TrainingArguments``: the plan's micro-batch as ``per_device_train_batch_size`` with
    ``gradient_accumulation_steps`` moved so that their product (the recipe) holds."""
    def post_init(original: Any, self: Any) -> None:
        original(self)
        per_device, accum = int(self.per_device_train_batch_size), int(self.gradient_accumulation_steps)
        product = per_device * accum
        _applied.found["hf_trainer"] = True
        _applied.knobs[MICRO_BATCH] = {"default": per_device, "choices": divisors(product), "via": "hf_trainer"}
        wanted = _applied.plan.get(MICRO_BATCH)
        if not wanted:
            return
        m = int(wanted)
        if product % m:
            _applied.note(MICRO_BATCH, f"{m} does not divide per_device_train_batch_size x gradient_accumulation_steps"
                                       f" = {product}")
            return
        self.per_device_train_batch_size, self.gradient_accumulation_steps = m, product // m
        _applied.levers.append(MICRO_BATCH)

    _replace(module.TrainingArguments, "__post_init__", post_init)


def divisors(n: int) -> list[int]:
    """The powers of two that divide ``n``, and ``n``."""
    out = [m for m in range(1, n + 1) if n % m == 0 and m & (m - 1) == 0]
    return out + ([n] if n not in out else [])


# ---- the optimizer --------------------------------------------------------------------------------


def _patch_optimizer_init() -> None:
    """Every optimizer built is seen (the first one leads to the model)."""
    import torch

    def init(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _state.setdefault("optimizers", []).append(self)

    _replace(torch.optim.Optimizer, "__init__", init)


def _optimizer_step(optimizer: Any, *_: Any) -> None:
    """On the first step of the first optimizer: its implementation."""
    if _state.get("stepped"):
        return
    _state["stepped"] = True
    _applied.found["optimizer"] = type(optimizer).__name__
    impl = _applied.plan.get("optimizer")
    if impl not in ("fused", "foreach"):
        return
    groups = optimizer.param_groups
    if not all(impl in g for g in groups):
        _applied.note("optimizer", f"{type(optimizer).__name__} has no {impl} implementation")
        return
    if impl == "fused" and not all(p.is_cuda and p.is_floating_point() for g in groups for p in g["params"]):
        _applied.note("optimizer", "fused needs every parameter on the GPU")
        return
    for g in groups:
        g["fused"], g["foreach"] = impl == "fused", impl == "foreach"
    _applied.levers.append("optimizer")


# ---- the model ------------------------------------------------------------------------------------


def _enter(module: Any, _args: Any) -> None:
    depth = _state.get("depth", 0)
    _state["depth"] = depth + 1
    if depth or "model" in _state:
        return
    first = next((p for opt in _state.get("optimizers", []) for g in opt.param_groups for p in g["params"]), None)
    if first is None or not any(p is first for p in module.parameters()):
        return
    _state["model"] = module
    for h in _state.get("hooks", [])[1:]:  # the module hooks: their work is done
        h.remove()
    _apply_model(module)


def _leave(_module: Any, _args: Any, _out: Any) -> None:
    _state["depth"] = max(0, _state.get("depth", 1) - 1)


NO_BLOCKS = "no repeated blocks found (no nn.ModuleList or nn.ModuleDict of two or more modules of one class)"


def blocks_of(model: Any) -> tuple[str, list[Any]]:
    """The model's repeated blocks: the children of the ``nn.ModuleList`` or ``nn.ModuleDict``
    holding most of its parameters (two or more children of one class, under a checkpoint or
    compile wrapper or not), with the container's name; ("", []) where none."""
    import torch

    best: tuple[int, str, list[Any]] = (0, "", [])
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)) or len(mod) < 2:
            continue
        children = list(mod.children())
        if len({_kind(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best[0]:
            best = (size, name, children)
    return best[1], best[2]


def _kind(module: Any) -> type:
    """A module's own class under the wrappers a program may put on some blocks only (activation
    checkpointing of every other block, torch.compile's module) and under FSDP2's subclass
    (``fully_shard`` turns a ``Block`` into an ``FSDPBlock``)."""
    inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
    if inner is not None:
        return _kind(inner)
    cls = type(module)  # fully_shard's class: type(f"FSDP{name}", (FSDPModule, the class), {})
    return cls.__bases__[-1] if cls.__name__ == f"FSDP{cls.__bases__[-1].__name__}" else cls


def _wrapped(model: Any) -> list[Any]:
    """``model`` and the modules it wraps, outermost first: torch.compile's ``_orig_mod`` and
    DDP's ``module``, in either order (``torch.compile(DDP(model))``, ``DDP(torch.compile(model))``)."""
    from torch.nn.parallel import DistributedDataParallel

    layers = [model]
    while (inner := getattr(layers[-1], "_orig_mod", None)
           or (layers[-1].module if isinstance(layers[-1], DistributedDataParallel) else None)) is not None:
        layers.append(inner)
    return layers


def _compiled(layers: list[Any], blocks: list[Any]) -> str:
    """What the program compiles itself: "model" (``torch.compile(model)`` or ``model.compile()``,
    at any of its ``layers``: :func:`_wrapped`), "block" (every block), or ""."""
    def compiled(m: Any) -> bool:
        return hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None

    return "model" if any(map(compiled, layers)) else "block" if blocks and all(map(compiled, blocks)) else ""


def _recomputed(model: Any, blocks: list[Any]) -> str:
    """How the program recomputes its blocks itself: "transformers" (``gradient_checkpointing_enable``,
    which the plan can turn off), "wrapper" (``checkpoint_wrapper`` on every block), or ""."""
    if any(getattr(m, "gradient_checkpointing", None) is True for m in model.modules()):
        return "transformers"
    return "wrapper" if blocks and all(hasattr(b, "_checkpoint_wrapped_module") for b in blocks) else ""


def _shard_ranks(model: Any) -> int:
    """The most ranks a parameter of ``model`` is spread over (its DTensor's mesh: FSDP2's
    shards); 0 where none is a DTensor."""
    from torch.distributed.tensor import DTensor

    return max((p.device_mesh.size() for p in model.parameters() if isinstance(p, DTensor)), default=0)


def _apply_model(model: Any) -> None:
    plan = _applied.plan
    name, blocks = blocks_of(model)
    params = sum(p.numel() for p in model.parameters())
    from torch.nn.parallel import DistributedDataParallel

    layers = _wrapped(model)
    ddp = any(isinstance(m, DistributedDataParallel) for m in layers)
    _applied.found.update(model=_kind(layers[-1]).__name__, params=params, blocks=len(blocks),
                          block=_kind(blocks[0]).__name__ if blocks else None, blocks_at=name,
                          compiled=_compiled(layers, blocks), recompute=_recomputed(layers[-1], blocks))
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        FSDPModule = ()
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)] if FSDPModule else []
    _applied.found["fsdp2"] = bool(sharded)
    _applied.found["fsdp2_ranks"] = _shard_ranks(model) if sharded else 0
    _applied.found["ddp"] = ddp
    wants_blocks = [k for k in ("recompute", "fp8") if plan.get(k) not in (None, "", "off", "none")]
    if plan.get("compile") == "block":
        wants_blocks.append("compile")
    if not blocks:
        for lever in wants_blocks:
            _applied.note(lever, NO_BLOCKS)
    if blocks and plan.get("fp8") not in (None, "", "off"):
        _apply_fp8(model, name, plan["fp8"], sharded=bool(sharded))
    if blocks and plan.get("recompute") == "full":
        _apply_checkpoint(blocks)
    elif plan.get("recompute") == "off" and _applied.found["recompute"] == "transformers":
        inner = layers[-1]  # newer transformers' name, the older one kept as an alias
        (getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable)()
        _applied.levers.append("recompute")
    elif plan.get("recompute") == "off":
        _applied.note("recompute", "the program does not turn on transformers' gradient checkpointing")
    if sharded:
        _apply_fsdp(model, blocks, sharded, plan)
    else:
        for k in ("fsdp_reshard", "fsdp_prefetch"):
            if k in plan:
                _applied.note(k, "the program does not use FSDP2 (fully_shard)")
    compile_scope = plan.get("compile")
    if compile_scope == "block" and blocks:
        for b in blocks:
            b.compile()
        _applied.levers.append("compile")
    elif compile_scope == "model":
        model.compile()  # from the next call on: this one is under way
        _applied.levers.append("compile")


def _apply_fp8(model: Any, blocks_at: str, recipe: str, *, sharded: bool) -> None:
    """torchao float8 training on the blocks' linear layers (the output head and embeddings
    stay: their names are not under the blocks' list)."""
    if sharded:
        _applied.note("fp8", "FSDP2 already sharded the model: torchao float8 converts before fully_shard")
        return
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        _applied.note("fp8", "FP8 needs torchao (pip install torchao)")
        return
    import torch

    prefix = f"{blocks_at}." if blocks_at else ""

    def chosen(mod: Any, fqn: str) -> bool:
        return (isinstance(mod, torch.nn.Linear) and fqn.startswith(prefix)
                and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)

    try:
        convert_to_float8_training(model, module_filter_fn=chosen, config=Float8LinearConfig.from_recipe_name(recipe))
    except Exception as exc:  # an unknown recipe, a device without FP8 GEMMs
        from primus_perf.base.errors import one_line

        _applied.note("fp8", one_line(exc))
        return
    _applied.levers.append("fp8")


def _apply_checkpoint(blocks: list[Any]) -> None:
    """Each block's forward recomputed in backward (non-reentrant checkpointing)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for b in blocks:
        forward = b.forward
        b.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    _applied.levers.append("recompute")


def _apply_fsdp(model: Any, blocks: list[Any], sharded: list[Any], plan: Mapping[str, str]) -> None:
    reshard = plan.get("fsdp_reshard")
    if reshard in ("true", "false"):
        for m in sharded:
            if m is not model:
                m.set_reshard_after_forward(reshard == "true")
        _applied.levers.append("fsdp_reshard")
    ahead = int(plan.get("fsdp_prefetch") or 0)
    if ahead:
        mine = [b for b in blocks if b in sharded]
        if len(mine) < 2:
            _applied.note("fsdp_prefetch", "the blocks are not each fully_shard-ed")
            return
        for i, b in enumerate(mine):
            b.set_modules_to_forward_prefetch(mine[i + 1:i + 1 + ahead])
            b.set_modules_to_backward_prefetch(list(reversed(mine[max(0, i - ahead):i])))
        _applied.levers.append("fsdp_prefetch")
