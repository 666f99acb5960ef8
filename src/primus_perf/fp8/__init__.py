"""FP8 training where it pays: per-layer plans chosen by measurement in the step, with the
loss checked (:func:`tune_trainer`, :func:`tune_plan`: ``tuner.fp8``), stored in the tuning
cache as ``fp8_plan`` entries, and applied to any PyTorch program's ``nn.Linear`` modules
(:func:`apply`: ``runtime.fp8``) or to the trainer (``train.fp8=auto``)."""

from primus_perf.runtime.fp8 import apply, find_plan
from primus_perf.tuner.fp8 import Fp8TuneResult, loss_check, tune_plan, tune_trainer

__all__ = ["Fp8TuneResult", "apply", "find_plan", "loss_check", "tune_plan", "tune_trainer"]
