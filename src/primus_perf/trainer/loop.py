"""The training loop: set-up (process groups, device, model, TP/DP, optimizer, data) and
one optimizer step at a time, with per-step metrics.

Launch: one process (``primus-train``), or ``torchrun`` (``WORLD_SIZE > 1``): NCCL on
GPUs, gloo on CPU. Ranks are tensor-parallel-major (see ``parallel.py``); data parallel is
DDP over the data-parallel group, or with ``parallel.dp_shard > 1`` FSDP2 (``fsdp.py``)
over ``dp_shard`` ranks, hybrid with ``parallel.dp_replicate > 1`` replicas. Every rank
builds the *full* model from the same seed, then :func:`parallelize.parallelize` keeps its
shard and applies TP, EP and FSDP2 or DDP from outside the model, so the initial weights
do not depend on the parallel sizes.

An optimizer step takes ``train.global_batch`` sequences over all data-parallel ranks: each
rank runs ``accumulation = global_batch / (micro_batch x dp)`` forward/backward passes of
``micro_batch`` sequences, their gradients accumulated without a data-parallel reduction
until the last (DDP's ``no_sync``; FSDP2's gradient sync off), the loss the mean over the
micro-batches, the learning-rate schedule per optimizer step. So the micro-batch, the
recompute mode, compile and the optimizer are speed knobs: the recipe stays.

Precision: bf16 autocast on GPU with fp32 master weights, fp32 on CPU. AdamW
(``train.optimizer``: ``optim.py``), linear warmup then cosine decay to ``min_lr``,
global-norm gradient clipping, activation recompute (none, selective, full).

Metrics are per optimizer step: tokens/s of the global batch, MFU = model FLOPs
(``flops.flops_per_token`` x global tokens) / step time / (dense bf16 datasheet peak of the
device x number of GPUs; None on CPU or a device the peak table does not know), a
micro-batch's mean time and the optimizer step's. Running out of device memory is a result:
one line with the memory estimate and the measured peak (``errors.OutOfMemory``, exit 2).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from primus_perf.base import environment
from primus_perf.base.errors import ConfigError, DeviceError, DivergedError, OutOfMemory
from primus_perf.base.files import LineLog
from primus_perf.kernels.grouped.router import TORCH_KERNEL
from primus_perf.kinds import GROUPED
from primus_perf.runtime import Handle, OnlineTuning, dispatch, enable
from primus_perf.trainer.config import TrainConfig, TrainerConfig, accumulation
from primus_perf.trainer.data import make_batches
from primus_perf.trainer.flops import flops_per_token
from primus_perf.trainer.fp8 import apply_plan, fp8_plan
from primus_perf.trainer.moe import (
    aux_loss,
    build_model,
    grouped_backend,
    tokens_per_expert,
    update_router_biases,
)
from primus_perf.trainer.optim import make_optimizer
from primus_perf.trainer.parallel import (
    clip_grad_norm_,
    join_torchrun,
    leave_torchrun,
    make_groups,
    reduce_expert_grads,
)
from primus_perf.trainer.parallelize import parallelize
from primus_perf.trainer.resources import check_fits, device_memory, estimate_memory


@dataclass
class StepMetrics:
    step: int  # 1-based
    loss: float
    step_time_s: float
    tokens_per_s: float
    mfu: float | None  # fraction of the dense bf16 peak, None when the device is unknown
    peak_mem_bytes: int
    lr: float
    grad_norm: float
    aux_loss: float | None = None  # MoE load-balancing loss (not in ``loss``)
    tokens_per_expert: list[list[int]] | None = None  # MoE: global counts per layer, over the step
    micro_batches: int = 1  # forward/backward passes the step accumulated
    micro_step_s: float | None = None  # a micro-batch's forward and backward, the step's mean
    optimizer_s: float | None = None  # the optimizer step's time

    def to_dict(self) -> dict:
        return asdict(self)


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate of 0-based ``step``: linear warmup, then cosine to ``min_lr``."""
    if t.warmup and step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    span = max(1, t.steps - t.warmup)
    progress = min(1.0, (step - t.warmup) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


def data_parallel_degrees(cfg: TrainerConfig, dp: int) -> tuple[int, int]:
    """(dp_shard, dp_replicate) for ``dp`` data-parallel ranks: ``parallel.dp_replicate=0``
    takes what ``dp_shard`` leaves; ConfigError when they do not multiply to ``dp``."""
    p = cfg.parallel
    replicate = p.dp_replicate or dp // p.dp_shard
    if p.dp_shard * replicate != dp:
        raise ConfigError(
            f"config keys 'parallel.dp_shard' ({p.dp_shard}) x 'parallel.dp_replicate'"
            f" ({p.dp_replicate or 'auto'}) must equal the data-parallel size {dp}"
            " (world size / parallel.tp)"
        )
    return p.dp_shard, replicate


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # peak RSS


class Trainer:
    """Set up once, then call :meth:`train_step` per optimizer step."""

    def __init__(self, cfg: TrainerConfig, online: OnlineTuning | None = None) -> None:
        """``online``: the tuning ``tuning.online=true`` runs inside the steps, given by the
        program that starts the trainer (``primus_perf.tuner.online.InStepTuning()``:
        primus-train and the closed loop give it); the trainer never imports the tuner."""
        if cfg.tuning.online and online is None:
            raise ConfigError("config key 'tuning.online' needs online tuning from the program that starts the"
                              " trainer: Trainer(cfg, online=primus_perf.tuner.online.InStepTuning())")
        self.cfg = cfg
        t = cfg.train
        self.device = self._pick_device(t.device)
        check_fits(cfg, self.device.type, self.device.index or 0)  # before any large allocation
        self._owns_process_group = join_torchrun(self.device.type == "cuda")
        world = dist.get_world_size() if dist.is_initialized() else 1
        tp = cfg.parallel.tp
        if world % tp:
            raise ConfigError(
                f"config key 'parallel.tp' ({tp}) must divide the number of processes ({world});"
                f" launch with torchrun --nproc-per-node {tp}"
            )
        if cfg.parallel.dp not in (0, world // tp):
            raise ConfigError(
                f"config key 'parallel.dp' ({cfg.parallel.dp}) must be 0 or world size / tp ({world // tp})"
            )
        ep = cfg.parallel.ep
        if (world // tp) % ep:
            raise ConfigError(
                f"config key 'parallel.ep' ({ep}) must divide the data-parallel size ({world // tp})"
            )
        dp_shard, dp_replicate = data_parallel_degrees(cfg, world // tp)
        self.groups = make_groups(tp, ep, dp_shard, dp_replicate, self.device.type)
        self.accumulation = accumulation(t, self.groups.dp)  # micro-batches an optimizer step accumulates
        self.is_main = self.groups.rank == 0
        if t.dtype == "bf16" and self.device.type != "cuda":
            raise ConfigError("config key 'train.dtype': bf16 needs a GPU (the CPU path runs fp32)")
        self.autocast = self.device.type == "cuda" and t.dtype in ("auto", "bf16")

        torch.manual_seed(t.seed)
        with torch.device(self.device):
            model = build_model(cfg.model)
        model.set_sdpa_backend(None if t.sdpa_backend == "auto" else t.sdpa_backend)
        model.recompute = t.recompute
        model.set_compile(t.compile)
        self.model = model
        self.fp8: dict[str, str] = {}  # layer name -> FP8 recipe or bf16 (train.fp8)

        def apply_fp8(m: torch.nn.Module) -> None:  # after TP and EP (local shapes), before FSDP2/DDP
            if t.fp8 != "off":  # the tuning cache's plan (auto) or one recipe for every block
                layers = fp8_plan(self.model, t.fp8, cfg.tuning.cache, t.micro_batch * t.seq_len)
                self.fp8 = apply_plan(m, layers, self.device, compile=t.compile == "pointwise",
                                      fsdp_float8_all_gather=dp_shard > 1)

        self._forward: torch.nn.Module = parallelize(
            model, self.groups, cfg.parallel, device=self.device, bf16=self.autocast, before_data_parallel=apply_fp8
        )
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        # weight decay on matrices only; FSDP2's DTensors apart from the plain tensors it leaves
        # out (routed experts): a foreach or fused kernel takes one kind of tensor
        groups: dict[tuple[bool, bool], list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault((p.dim() >= 2, type(p.data).__name__ == "DTensor"), []).append(p)
        self.optimizer = make_optimizer(
            [{"params": ps, "weight_decay": t.weight_decay if decay else 0.0} for (decay, _), ps in groups.items()],
            t.optimizer, self.device, lr=lr_at(0, t), betas=(t.beta1, t.beta2), eps=t.eps)
        self.batches = make_batches(cfg.data.path, cfg.model.vocab_size, t.seq_len, t.micro_batch, self.groups.dp,
                                    self.groups.dp_rank, t.seed, self.accumulation)
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.tokens_per_step = t.micro_batch * self.accumulation * t.seq_len * self.groups.dp
        self.device_name = (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )
        self.peak_tflops = self._peak_tflops()
        self.step = 0
        self.last_finite_loss: tuple[int, float] | None = None  # (step, loss)
        # the MoE layers' torch._grouped_mm calls run the configured backend: the grouped
        # dispatch's, held while this trainer lives (a tuning cache's choices go first)
        self.grouped: str | None = None
        self._grouped_dispatch = None
        self.use_grouped_backend(cfg.model.moe.grouped_gemm_backend)
        self.tuning: Handle | None = None  # primus_perf.enable's handle, when tuning.cache is set
        self._online = online
        try:
            self.use_tuning_cache(cfg.tuning.cache)
        except BaseException:  # no trainer to close: the grouped backend goes back now
            self._release_grouped()
            raise

    # ---- set-up ------------------------------------------------------------------------

    @staticmethod
    def _pick_device(choice: str) -> torch.device:
        if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise DeviceError("config key 'train.device' is cuda but no GPU is visible to torch")
        index = environment.get("LOCAL_RANK")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _peak_tflops(self) -> float | None:
        if self.device.type != "cuda":
            return None
        from primus_perf.base.devices import lookup_peaks

        row = lookup_peaks(self.device_name)
        return row.peak_tflops("bf16") if row is not None else None

    def use_grouped_backend(self, name: str) -> None:
        """The MoE layers' ``torch._grouped_mm`` calls run ``name`` (``auto``: the default
        rule's), through the grouped dispatch held while this trainer lives (a tuning cache's
        choices go first); callable again between steps."""
        backend = grouped_backend(self.model, name, self.device, torch.bfloat16 if self.autocast else torch.float32)
        self._release_grouped()
        self.grouped = backend
        if backend is None:
            return
        self._grouped_dispatch = dispatch.of(GROUPED.name)
        self._grouped_dispatch.set_backend(backend, owner=self)
        if backend != TORCH_KERNEL:
            self._grouped_dispatch.keep_overrides(self, self.device.type)
        # a trainer dropped without close() lets go of them too
        self._grouped_release = weakref.finalize(self, self._grouped_dispatch.release_id, id(self))

    def use_tuning_cache(self, cache: str | None) -> None:
        """Run the tuned kernels of ``cache`` (``primus_perf.enable``; None: none), with the
        online tuning ``tuning.online`` asks for; callable again between steps."""
        if self.tuning is not None:
            self.tuning.disable()
            self.tuning = None
        if cache:
            self.tuning = enable(cache, self._online if self.cfg.tuning.online else None,
                                 device_type=self.device.type)

    def set_fp8(self, layers: dict[str, str], *, compile: bool | None = None) -> None:
        """Switch the FP8 plan between steps (layer name -> recipe or bf16; the plan tuner
        measures candidates this way); ``compile`` (each FP8 layer's quantization compiled)
        defaults to train.compile=pointwise (a compiled block compiles them with it)."""
        self.fp8 = apply_plan(self.model, layers, self.device,
                              compile=self.cfg.train.compile == "pointwise" if compile is None else compile)

    # ---- training ----------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients reduced over the data-parallel ranks on the step's last micro-batch only:
        DDP's ``no_sync`` before it, FSDP2's reduce-scatter switched off."""
        if self.groups.dp_shard > 1:
            self.model.set_requires_gradient_sync(last)
        elif self._forward is not self.model and not last:
            return self._forward.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _fits(self) -> Iterator[None]:
        """Running out of device memory is a result: one line with the estimate and the peak."""
        try:
            yield
        except torch.OutOfMemoryError:
            peak = _peak_memory(self.device)
            have, where = device_memory(self.device.type, self.device.index or 0)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise OutOfMemory(f"out of memory at step {self.step + 1}: {where} ({have / 2**30:,.1f} GiB) held"
                              f" {peak / 2**30:,.1f} GiB at its peak, the estimate for this config"
                              f" {estimate_memory(self.cfg, self.device.type).line()}; lower train.micro_batch,"
                              " or set train.recompute=selective or full") from None

    def train_step(self) -> StepMetrics:
        """One optimizer step: ``accumulation`` micro-batches per data-parallel rank."""
        t = self.cfg.train
        start = time.perf_counter()
        lr = lr_at(self.step, t)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        sums = torch.zeros(2, device=self.device)  # language-model and balancing losses, summed
        counts: list[list[int]] | None = None
        with self._fits():
            for micro in range(self.accumulation):
                inputs, targets = self.batches.batch(self.step, micro)
                inputs = inputs.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
                with self._grad_sync(micro == self.accumulation - 1):
                    with self._autocast():
                        logits = self._forward(inputs)
                        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
                        balance = aux_loss(self.model)
                    ((loss if balance is None else loss + balance) / self.accumulation).backward()
                sums[0] += loss.detach().float()
                if balance is not None:
                    sums[1] += balance.detach().float()
                step_counts = tokens_per_expert(self.model)
                counts = step_counts if counts is None else [[a + b for a, b in zip(x, y)]
                                                             for x, y in zip(counts, step_counts)]
            reduce_expert_grads(self.model, self.groups)
            grad_norm = clip_grad_norm_(self.params, t.grad_clip, self.groups.tp_group, self.groups.ep_group,
                                        self.groups.shard_group)
            optimizer_s = self._timed(self.optimizer.step)
            update_router_biases(self.model, counts)
            self.optimizer.zero_grad(set_to_none=True)
        # the losses of the step, averaged over its micro-batches and the data-parallel ranks
        loss_value = sums / self.accumulation
        if self.groups.dp_group is not None:
            dist.all_reduce(loss_value, group=self.groups.dp_group)
            loss_value /= self.groups.dp
        (loss_f, balance_f), norm_f = loss_value.tolist(), float(grad_norm)
        self._check_finite(loss_f)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        mfu = None
        if self.peak_tflops:
            achieved = self.flops_per_token * self.tokens_per_step / elapsed
            mfu = achieved / (self.peak_tflops * 1e12 * self.groups.world_size)
        optimizer_s = optimizer_s()
        return StepMetrics(
            step=self.step,
            loss=loss_f,
            step_time_s=elapsed,
            tokens_per_s=self.tokens_per_step / elapsed,
            mfu=mfu,
            peak_mem_bytes=_peak_memory(self.device),
            lr=lr,
            grad_norm=norm_f,
            aux_loss=balance_f if balance is not None else None,
            tokens_per_expert=counts,
            micro_batches=self.accumulation,
            micro_step_s=(elapsed - optimizer_s) / self.accumulation,
            optimizer_s=optimizer_s,
        )

    @torch.no_grad()
    def batch_loss(self, step: int = 0) -> float:
        """The loss of the first micro-batch of ``step`` under the current weights, forward
        only (no update): two sides of an A/B compared on the same data and weights."""
        inputs, targets = self.batches.batch(step, 0)
        with self._autocast():
            logits = self._forward(inputs.to(self.device))
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.to(self.device).view(-1))
        if self.groups.dp_group is not None:
            dist.all_reduce(loss, group=self.groups.dp_group)
            loss /= self.groups.dp
        return float(loss)

    def _timed(self, fn: Callable[[], Any]) -> Callable[[], float]:
        """Run ``fn``; returns what reads its seconds once the step has synchronized (device
        events on a GPU, the host clock on a CPU)."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            took = time.perf_counter() - t0
            return lambda: took
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        return lambda: start.elapsed_time(end) / 1e3

    def _check_finite(self, loss: float) -> None:
        """Stop at a non-finite loss, naming the step and the last finite loss."""
        if math.isfinite(loss):
            self.last_finite_loss = (self.step + 1, loss)
            return
        last = self.last_finite_loss
        before = f"last finite loss {last[1]:.4f} at step {last[0]}" if last else "no finite loss before it"
        raise DivergedError(f"loss became {loss} at step {self.step + 1} ({before}); lower train.lr or check the data")

    def _release_grouped(self) -> None:
        """This trainer's hold on the grouped dispatch's override, and its backend, released."""
        if self._grouped_dispatch is not None:
            self._grouped_release()  # the hold and the backend
            self._grouped_dispatch = None

    def close(self, finished: bool = False) -> None:
        """Release the DDP wrapper, then leave the process group if this trainer made it
        (``finished``: every rank ran its steps, see :func:`leave_torchrun`).

        Order matters with gloo: dropping DDP's reducer while it holds the last reference
        to its process group joins gloo's worker threads with the GIL held, and a worker
        still freeing a finished all-reduce needs the GIL: a deadlock at exit. So all ranks
        meet at a barrier first, and the reducer goes while the group is still registered.
        """
        if self.tuning is not None:
            self.tuning.disable()
        self._release_grouped()
        if self._forward is not self.model:
            if dist.is_initialized():
                dist.barrier(group=self.groups.dp_group)
            self._forward = self.model
            gc.collect()
        if self._owns_process_group:
            leave_torchrun(finished)
            self._owns_process_group = False


class JsonLog:
    """One JSON object per step (JSON lines), written to a temporary name next to PATH and
    renamed to PATH on close: the CLI closes it at the end, on Ctrl-C, SIGTERM or an error,
    so PATH holds every finished step (an old PATH stays intact until then)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._log = LineLog(path)

    @property
    def steps(self) -> int:
        return self._log.lines

    def write(self, metrics: StepMetrics) -> None:
        self._log.write(json.dumps(metrics.to_dict()))

    def close(self) -> None:
        self._log.close()


def train(
    cfg: TrainerConfig, on_step: Callable[[StepMetrics], None] | None = None
) -> list[StepMetrics]:
    """Run ``cfg.train.steps`` steps; ``on_step`` sees each step's metrics (on every rank)."""
    trainer = Trainer(cfg)
    history: list[StepMetrics] = []
    try:
        for _ in range(cfg.train.steps):
            metrics = trainer.train_step()
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
    finally:
        trainer.close()
    return history
