"""Trainer configuration: nested dataclasses loaded from YAML presets, validated, with
``key=value`` overrides.

Each field carries its rule (choices, or a range); :data:`SCHEMA`, each key's :class:`Key`
derived from the dataclasses, validates a config and reads the settings other parts hand over
typed (the step tuner's levers, the analyzer's advice, a step plan: :func:`with_settings`).

A preset name (``tiny``, ``llama3-8b``, ...) resolves to the package data file
``primus_perf/trainer/presets/NAME.yaml`` (installed with the wheel); any other argument is
read as a path. Every key is checked against the dataclass fields: an
unknown key, a value of the wrong type, or a model that cannot be split over the
tensor-parallel size raises :class:`~primus_perf.base.errors.ConfigError` whose message names
the key (the CLI prints it as one line and exits with code 2).

Overrides use dotted keys, e.g. ``train.steps=50`` or ``model.n_layers=4``; the value is
parsed as a YAML scalar (``true``, ``3e-4``, ``null`` work).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from primus_perf.base.errors import ConfigError, UserError
from primus_perf.base.files import check_input_file, load_yaml, read_input
from primus_perf.kernels.fp8.recipes import RECIPES as FP8_RECIPES
from primus_perf.kernels.grouped.backends import AUTO as GROUPED_GEMM_AUTO
from primus_perf.kernels.grouped.backends import BACKENDS as GROUPED_GEMM_BACKENDS

PRESETS = "primus_perf.trainer.presets"  # package holding the preset YAML files
SEED_MAX = 2**32 - 1
SIZE_MAX = 2**31 - 1  # a size past a 32-bit index is no model (and the estimate must stay quick)


def _key(default: Any, *, choices: Sequence[str] = (), positive: bool = False, least: float | None = None,
         most: float | None = None, below: float | None = None, bools: tuple[str, str] | None = None) -> Any:
    """A config field with its rule (:class:`Key`'s)."""
    return field(default=default, metadata={"choices": tuple(choices), "positive": positive, "least": least,
                                            "most": most, "below": below, "bools": bools})


def _size(default: int, most: int = SIZE_MAX) -> Any:  # a positive count
    return _key(default, positive=True, most=most)


def _one_of(*choices: str, bools: tuple[str, str] | None = None) -> Any:  # the first by default
    return _key(choices[0], choices=choices, bools=bools)


@dataclass
class MoEConfig:
    """Mixture of experts in place of the dense MLP (``n_experts=0``: a dense model).

    Layers ``first_k_dense`` and on route each token to ``top_k`` of ``n_experts`` SwiGLU
    experts of width ``expert_dim`` (plus ``n_shared_experts`` experts every token takes,
    run as one dense SwiGLU of width ``n_shared_experts * expert_dim``); the first
    ``first_k_dense`` layers keep the dense MLP of ``model.ffn_dim``. ``router``: softmax or
    sigmoid scores; ``balance``: the classic load-balancing loss (``aux_loss``, weighted by
    ``aux_loss_coef``), a per-expert selection bias moved by ``bias_update_rate`` after each
    step towards the mean load (``bias``, auxiliary-loss-free), or nothing. Expert GEMMs run
    on ``grouped_gemm_backend`` unless a tuning cache routes them: ``auto`` (the default) is
    the fixed backend of ``kernels.grouped.backends.DEFAULT_RULE`` for the device, the
    dtype and the layer's expert count; a backend's name runs that backend."""

    n_experts: int = _key(0, least=0)
    top_k: int = 2
    expert_dim: int = 0
    n_shared_experts: int = _key(0, least=0)
    first_k_dense: int = _key(0, least=0)
    router: str = _one_of("softmax", "sigmoid")
    norm_topk_prob: bool = True  # renormalize the top-k weights to sum to 1
    routed_scale: float = _key(1.0, least=0)  # multiplies the routed experts' weights
    balance: str = _one_of("aux_loss", "bias", "none")
    aux_loss_coef: float = _key(0.01, least=0)
    bias_update_rate: float = _key(1e-3, least=0)
    grouped_gemm_backend: str = _one_of(GROUPED_GEMM_AUTO, *GROUPED_GEMM_BACKENDS)


@dataclass
class ModelConfig:
    """A Llama-3-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
    untied output head; with ``moe.n_experts > 0`` an MoE decoder (:class:`MoEConfig`)."""

    name: str = "custom"
    vocab_size: int = _size(256)
    dim: int = _size(128)
    n_layers: int = _size(2, most=100_000)  # the model's layers are walked one by one
    n_heads: int = _size(4)
    n_kv_heads: int = _size(2)
    ffn_dim: int = _size(384)
    rope_theta: float = _key(10000.0, positive=True)
    norm_eps: float = _key(1e-5, positive=True)
    qkv_bias: bool = False  # Qwen2.5 has biases on the Q/K/V projections
    init_std: float = _key(0.02, positive=True)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass
class ParallelConfig:
    """Tensor-parallel size and data-parallel size; ``dp=0`` means world size / tp.
    ``ep``: expert-parallel size, the MoE experts split over ``ep`` data-parallel ranks
    (it divides the data-parallel size and ``model.moe.n_experts``).

    The data-parallel ranks are ``dp_replicate x dp_shard``: ``dp_shard`` > 1 shards
    parameters, gradients and optimizer state over that many ranks (FSDP2);
    ``dp_replicate`` replicas (0: the data-parallel size / ``dp_shard``) hold the same
    parameters (DDP when ``dp_shard`` is 1, hybrid sharding otherwise). With FSDP2,
    ``fsdp_prefetch`` blocks are all-gathered ahead of use (0: FSDP2's own schedule) and
    ``fsdp_reshard_after_forward=false`` keeps gathered blocks until backward."""

    tp: int = _size(1)
    dp: int = _key(0, least=0)
    ep: int = _size(1)
    dp_shard: int = _size(1)
    dp_replicate: int = _key(0, least=0)
    fsdp_prefetch: int = _key(0, least=0)
    fsdp_reshard_after_forward: bool = True


@dataclass
class TrainConfig:
    steps: int = _size(30)
    seq_len: int = _size(128)
    micro_batch: int = _size(8)  # sequences per data-parallel rank per forward/backward
    # sequences per optimizer step over all data-parallel ranks (0: micro_batch x data-parallel
    # ranks); its gradients accumulate over global / (micro_batch x dp) micro-batches
    global_batch: int = _key(0, least=0)
    lr: float = _key(3e-3, positive=True)
    min_lr: float = _key(3e-4, least=0)  # at most lr
    warmup: int = _key(5, least=0)
    weight_decay: float = _key(0.1, least=0)
    beta1: float = _key(0.9, least=0, below=1)
    beta2: float = _key(0.95, least=0, below=1)
    eps: float = _key(1e-8, positive=True)
    grad_clip: float = _key(1.0, least=0)  # 0 disables clipping
    seed: int = _key(1234, least=0, most=SEED_MAX)  # what a generator takes
    device: str = _one_of("auto", "cpu", "cuda")  # auto: cuda when available
    dtype: str = _one_of("auto", "bf16", "fp32")  # auto: bf16 autocast on GPU, fp32 on CPU
    # activation recompute per transformer block: "none"; "selective" (the GEMM and attention
    # outputs are kept, the norms and elementwise work recomputed); "full" (the block's input kept)
    recompute: str = _one_of("none", "selective", "full", bools=("none", "full"))
    # torch.compile: "off"; "pointwise" (RoPE, SwiGLU and RMSNorm, the GEMMs eager); "block" (each
    # transformer block whole, its GEMMs too: a tuning cache's reach them through the runtime's pass)
    compile: str = _one_of("off", "pointwise", "block", bools=("off", "pointwise"))
    # AdamW: "auto" (fused on a GPU, foreach on a CPU), "fused", "foreach", "bf16" (foreach with
    # the two moments stored in bf16: 4 bytes a parameter less, the update computed in fp32)
    optimizer: str = _one_of("auto", "fused", "foreach", "bf16")
    # FP8 linear layers (torchao float8): "off"; "auto": the tuning cache's measured plan;
    # a recipe name: every block's linear layers (not the output head, not MoE routers)
    fp8: str = _one_of("off", "auto", *FP8_RECIPES)
    sdpa_backend: str = _one_of("auto", "cudnn", "flash", "efficient", "math")  # auto: torch picks
    log_every: int = _size(1)


@dataclass
class DataConfig:
    """``path=None``: synthetic, learnable token sequences; else a text file read with a
    byte-level tokenizer (token = byte value, so ``model.vocab_size`` must be >= 256)."""

    path: str | None = None


@dataclass
class TuningConfig:
    """``cache``: path of a tuning cache to load at start-up (GEMM and attention
    solutions); None runs the default torch kernels. ``online``: tune the problems the
    cache does not hold during the first steps and add them to it (``primus_perf.enable``
    with ``online=True``; the cache file is created if missing)."""

    cache: str | None = None
    online: bool = False


@dataclass
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


MAX_CONFIG_BYTES = 1 << 20  # a config file larger than this is not a config


@dataclass(frozen=True)
class Key:
    """One key of the config's schema: its dotted ``name``, the field's ``type`` and ``default``,
    and the values it takes: ``choices`` (a string key), or a number ``positive``, from ``least``,
    up to ``most`` (or ``below``). ``bools``: the two values an earlier true/false spelled."""

    name: str
    type: Any
    default: Any
    choices: tuple[str, ...] = ()
    positive: bool = False
    least: float | None = None
    most: float | None = None
    below: float | None = None
    bools: tuple[str, str] | None = None

    def read(self, value: Any) -> Any:
        """``value`` as YAML or JSON types it, as this key's: ConfigError naming the key."""
        value = _coerce(self, value, self.type)
        self.check(value)
        return value

    def check(self, value: Any) -> None:
        """ConfigError naming the key where ``value`` is not one it takes."""
        name = self.name
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key {name!r} must be a finite number, got {value}")
        if self.choices and value not in self.choices:
            raise ConfigError(f"config key {name!r} must be one of {', '.join(self.choices)}, got {value!r}")
        if self.positive and value <= 0:
            raise ConfigError(f"config key {name!r} must be positive, got {value}")
        if self.least is not None and value < self.least:
            raise ConfigError(f"config key {name!r} must be >= {self.least}, got {value}")
        if self.most is not None and value > self.most:
            raise ConfigError(f"config key {name!r} must be at most {self.most:,}, got {value:,}")
        if self.below is not None and value >= self.below:
            raise ConfigError(f"config key {name!r} must be below {self.below}, got {value}")


def _schema(cls: type, prefix: str = "") -> dict[str, Key]:
    hints = typing.get_type_hints(cls)
    out: dict[str, Key] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_schema(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = Key(prefix + f.name, hints[f.name], f.default, **f.metadata)
    return out


SCHEMA: dict[str, Key] = _schema(TrainerConfig)  # dotted key -> its record


def _leaves(node: Mapping[Any, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every value of a nested mapping that is not a mapping, in order."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def flat(cfg: TrainerConfig) -> dict[str, Any]:
    """The config as dotted keys (``train.micro_batch`` -> 4)."""
    return dict(_leaves(cfg.to_dict()))


def _preset_files() -> dict[str, Any]:
    """Preset name -> its YAML resource (a Traversable: a file, or an entry of a zip)."""
    root = importlib.resources.files(PRESETS)
    return {f.name[: -len(".yaml")]: f for f in root.iterdir() if f.name.endswith(".yaml")}


def resolve_config_path(name_or_path: str) -> Any:
    """``tiny`` -> the ``tiny.yaml`` preset resource; an existing path is used as is."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ConfigError(f"config file not found: {name_or_path}")
        return path
    presets = _preset_files()
    if name_or_path in presets:
        return presets[name_or_path]
    names = ", ".join(sorted(presets)) or "none"
    raise ConfigError(f"unknown config {name_or_path!r} (presets: {names}; or give a YAML path)")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(k: Key, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    key = k.name
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(k, value, arg)
            except ConfigError:
                continue
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise ConfigError(f"config key {key!r} must be {names} or null, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool) and k.bools:
            return k.bools[value]
        if value is False and "off" in k.choices:  # YAML 1.1 reads off/no/false as False
            return "off"
    else:  # pragma: no cover - internal: an annotation this loader does not know
        raise TypeError(f"unsupported annotation {tp!r} for {key}")
    raise ConfigError(
        f"config key {key!r} must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
    )


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key {prefix.rstrip('.') or '<root>'!r} must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp = hints[f.name]
        key = prefix + f.name
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, data[f.name], key + ".")
        else:
            kwargs[f.name] = _coerce(SCHEMA[key], data[f.name], tp)
    return cls(**kwargs)


def _apply_override(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key=value")
    key, _, text = override.partition("=")
    key = key.strip()
    if len(key.split(".")) < 2 or not all(key.split(".")):
        raise ConfigError(f"override key {key!r} must be dotted, e.g. train.steps=50")
    try:
        value = load_yaml(text) if text.strip() else None
    except ValueError:  # not YAML (or a bomb): the text itself, which the key's type then checks
        value = text
    _put(data, key, value)


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    """``value`` at the dotted ``key`` of a config's nested mapping."""
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"unknown config key {key!r}")
        node = child
    node[parts[-1]] = value


def validate(cfg: TrainerConfig) -> TrainerConfig:
    """Cross-field checks; raises ConfigError naming the offending key."""
    for key, value in flat(cfg).items():
        SCHEMA[key].check(value)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.dp and p.dp % p.dp_shard:
        raise ConfigError(f"config key 'parallel.dp_shard' ({p.dp_shard}) must divide parallel.dp ({p.dp})")
    if m.dim % m.n_heads:
        raise ConfigError(
            f"config key 'model.dim' ({m.dim}) must be divisible by model.n_heads ({m.n_heads})"
        )
    if m.head_dim % 2:
        raise ConfigError(
            f"config key 'model.dim' gives an odd head dim {m.head_dim}; RoPE needs it even"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"config key 'model.n_kv_heads' ({m.n_kv_heads}) must divide model.n_heads ({m.n_heads})"
        )
    for key, value in (
        ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", m.n_kv_heads),
        ("model.ffn_dim", m.ffn_dim),
        ("model.vocab_size", m.vocab_size),
    ):
        if value % p.tp:
            raise ConfigError(
                f"config key {key!r} ({value}) is not divisible by parallel.tp ({p.tp})"
            )
    _validate_moe(cfg)
    if p.dp:
        accumulation(t, p.dp)
    if t.min_lr > t.lr:
        raise ConfigError("config key 'train.lr' must be > 0 and train.min_lr in [0, train.lr]")
    if cfg.data.path is not None and m.vocab_size < 256:
        raise ConfigError(
            f"config key 'model.vocab_size' ({m.vocab_size}) must be >= 256 for data.path (byte tokens)"
        )
    if t.fp8 == "auto" and cfg.tuning.cache is None:
        raise ConfigError("config key 'train.fp8' is auto but tuning.cache is not set (auto uses the cache's FP8 plan)")
    if cfg.tuning.online and cfg.tuning.cache is None:
        raise ConfigError("config key 'tuning.online' needs tuning.cache (the file it writes)")
    if cfg.data.path is not None:
        _check_file("data.path", cfg.data.path)
    if cfg.tuning.cache is not None and not cfg.tuning.online:  # online tuning may start the file
        _check_file("tuning.cache", cfg.tuning.cache)
    return cfg


def _validate_moe(cfg: TrainerConfig) -> None:
    moe, ep = cfg.model.moe, cfg.parallel.ep
    if moe.n_experts == 0:
        if ep != 1:
            raise ConfigError(f"config key 'parallel.ep' ({ep}) needs an MoE model (model.moe.n_experts > 0)")
        return
    if not 1 <= moe.top_k <= moe.n_experts:
        raise ConfigError(
            f"config key 'model.moe.top_k' must be in 1..model.moe.n_experts ({moe.n_experts}), got {moe.top_k}"
        )
    if moe.expert_dim <= 0:
        raise ConfigError(f"config key 'model.moe.expert_dim' must be positive, got {moe.expert_dim}")
    if moe.first_k_dense > cfg.model.n_layers:
        raise ConfigError(
            f"config key 'model.moe.first_k_dense' ({moe.first_k_dense}) exceeds model.n_layers ({cfg.model.n_layers})"
        )
    if moe.n_experts % ep:
        raise ConfigError(
            f"config key 'parallel.ep' ({ep}) must divide model.moe.n_experts ({moe.n_experts})"
        )
    shared = moe.n_shared_experts * moe.expert_dim
    if shared % cfg.parallel.tp:
        raise ConfigError(
            f"config key 'model.moe.n_shared_experts' gives a shared width {shared} not divisible by parallel.tp ({cfg.parallel.tp})"
        )


def accumulation(t: TrainConfig, dp: int) -> int:
    """Micro-batches an optimizer step accumulates over ``dp`` data-parallel ranks:
    global_batch / (micro_batch x dp); a one-line ConfigError where it does not divide."""
    if not t.global_batch:
        return 1
    if t.global_batch % (t.micro_batch * dp):
        raise ConfigError(f"config key 'train.global_batch' ({t.global_batch}) must be a multiple of train.micro_batch"
                          f" ({t.micro_batch}) x {dp} data-parallel rank{'s' if dp > 1 else ''}")
    return t.global_batch // (t.micro_batch * dp)


def _check_file(key: str, path: str) -> None:
    try:
        check_input_file(path)
    except UserError as exc:
        raise ConfigError(f"config key {key!r}: {exc}") from None


def config_from_dict(data: dict[str, Any]) -> TrainerConfig:
    return validate(_build(TrainerConfig, data, ""))


def _read_yaml(path: Any, what: str) -> Any:
    """A YAML file read like every input (a FIFO, a device or a binary refused unread; aliases
    past a million values refused), or a packaged preset; one ConfigError line otherwise."""
    try:
        if isinstance(path, Path):
            raw = read_input(path, what=what, max_bytes=MAX_CONFIG_BYTES, text=True).decode("utf-8")
        else:  # a preset inside the package
            raw = path.read_text(encoding="utf-8")
        return load_yaml(raw)
    except UserError as exc:
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: a binary file, not YAML") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def load_config(name_or_path: str, overrides: Sequence[str] = ()) -> TrainerConfig:
    """Load a preset (by name) or a YAML file, apply ``key=value`` overrides, validate."""
    path = resolve_config_path(name_or_path)
    data = _read_yaml(path, "config file")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for override in overrides:
        _apply_override(data, override)
    return config_from_dict(data)


def with_settings(cfg: TrainerConfig, settings: Mapping[str, Any]) -> TrainerConfig:
    """``cfg`` with ``settings`` (dotted key -> typed value), each read by :data:`SCHEMA`, the
    whole validated again: what the step tuner runs, a step plan over the command line's."""
    data = cfg.to_dict()
    for key, value in settings.items():
        _put(data, key, value)
    return config_from_dict(data)


def plan_yaml(settings: dict[str, Any]) -> str:
    """Settings as a step plan's YAML (the config's sections, typed values; :func:`read_plan`
    reads them back)."""
    import yaml

    nested: dict[str, Any] = {}
    for key, value in settings.items():
        _put(nested, key, value)
    return yaml.safe_dump(nested, sort_keys=False) if nested else "{}\n"


def read_plan(path: str | Path) -> dict[str, Any]:
    """A step plan (``primus-tune step``'s ``plan.yaml``: a YAML overlay of config sections) as
    settings, each value read by :data:`SCHEMA`; ``with_settings`` applies them over the command
    line's overrides (the plan was tuned with those: ``train.micro_batch=1`` on the command line
    does not undo its micro-batch)."""
    p = Path(path)
    data = _read_yaml(p, "step plan")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a step plan is a mapping of config sections (train:, parallel:, ...)")
    out: dict[str, Any] = {}
    for key, value in _leaves(data):
        if key not in SCHEMA:
            raise ConfigError(f"unknown config key {key!r}")
        out[key] = SCHEMA[key].read(value)
    return out
