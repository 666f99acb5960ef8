"""FSDP2 in the trainer on the CPU (gloo): sharded data parallel, alone, with recompute
and prefetch, with expert parallelism, with tensor parallelism on a 2-D mesh and hybrid
(replicate x shard), reproduces the losses of one process of the same seed; the degree
keys are checked. The bf16 GPU path (and ``train.compile``) is in the ``gpu`` tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inprocess import one_process_losses
from primus_perf.base.errors import ConfigError
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import data_parallel_degrees
from trainer_runs import _losses, _run

STEPS = ["--steps", "5"]


@pytest.mark.parametrize(
    "preset,nproc,parallel_args,single_args",
    [
        # FSDP2 over 2 ranks at micro-batch 4 = one process at 8; explicit prefetch and
        # gathered blocks kept to backward must not change a number
        ("tiny", 2, ["parallel.dp_shard=2", "parallel.fsdp_prefetch=1",
                     "parallel.fsdp_reshard_after_forward=false"], ["train.micro_batch=8"]),
        # recompute inside FSDP2 units; MoE experts split over EP=2, left out of FSDP2
        ("tiny-moe", 2, ["parallel.dp_shard=2", "parallel.ep=2", "train.recompute=true"],
         ["train.micro_batch=8", "train.recompute=true"]),
        # TP=2 x FSDP2=2 on the 2-D mesh: the same global batch of 8
        ("tiny", 4, ["parallel.tp=2", "parallel.dp_shard=2"], ["train.micro_batch=8"]),
        # hybrid: 2 replicas of 2 shards = a global batch of 16
        ("tiny", 4, ["parallel.dp_shard=2", "parallel.dp_replicate=2"], ["train.micro_batch=16"]),
    ],
    ids=["fsdp2-prefetch", "fsdp2-ep2-recompute-moe", "tp2xfsdp2", "hsdp2x2"],
)
def test_fsdp2_reproduces_one_process(
    tmp_path: Path, preset: str, nproc: int, parallel_args: list[str], single_args: list[str]
) -> None:
    common = ["--config", preset, *STEPS, "train.micro_batch=4"]
    many = tmp_path / "many.jsonl"
    r2 = _run([*common, *parallel_args, "--json-log", str(many)], nproc=nproc)
    assert r2.returncode == 0, r2.stderr
    assert "FSDP2 shard 2" in r2.stdout
    a, b = one_process_losses(preset, f"train.steps={STEPS[1]}", "train.micro_batch=4", *single_args), _losses(many)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-4 * abs(x), (a, b)


def test_data_parallel_degrees() -> None:
    cfg = load_config("tiny", ["parallel.dp_shard=2"])
    assert data_parallel_degrees(cfg, 4) == (2, 2)  # dp_replicate 0: what dp_shard leaves
    assert data_parallel_degrees(load_config("tiny"), 4) == (1, 4)  # no FSDP2: DDP over 4
    with pytest.raises(ConfigError, match="parallel.dp_shard"):
        data_parallel_degrees(cfg, 3)
    with pytest.raises(ConfigError, match="parallel.dp_shard"):
        data_parallel_degrees(load_config("tiny", ["parallel.dp_shard=2", "parallel.dp_replicate=3"]), 4)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["parallel.dp_shard=0"], "parallel.dp_shard"),
        (["parallel.dp_replicate=-1"], "parallel.dp_replicate"),
        (["parallel.fsdp_prefetch=-2"], "parallel.fsdp_prefetch"),
        (["parallel.fsdp_reshard_after_forward=sometimes"], "parallel.fsdp_reshard_after_forward"),
        (["parallel.dp=4", "parallel.dp_shard=3"], "parallel.dp_shard"),
    ],
)
def test_bad_fsdp_keys_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config("tiny", overrides)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compile"])
def test_fsdp2_bf16_matches_ddp_on_two_gpus(tmp_path: Path, compile_: bool) -> None:
    """bf16 parameters, fp32 reduction: FSDP2 and DDP losses of the same seed agree to bf16
    noise over 10 steps (with and without ``train.compile``)."""
    common = ["--config", "tiny", "--steps", "10", "train.device=cuda", f"train.compile={str(compile_).lower()}"]
    ddp, fsdp = tmp_path / "ddp.jsonl", tmp_path / "fsdp.jsonl"
    r1 = _run([*common, "--json-log", str(ddp)], nproc=2)
    assert r1.returncode == 0, r1.stderr
    r2 = _run([*common, "parallel.dp_shard=2", "--json-log", str(fsdp)], nproc=2)
    assert r2.returncode == 0, r2.stderr
    a, b = _losses(ddp), _losses(fsdp)
    assert len(a) == len(b) == 10
    for x, y in zip(a, b):
        assert abs(x - y) <= 2e-2 * abs(x), (a, b)


GROUPS_SCRIPT = """
import os

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from primus_perf.trainer.config import load_config
from primus_perf.trainer.loop import Trainer

dist.init_process_group("gloo")  # made once, as the step tuner does: no trainer owns it
counts = []
for mb in (1, 2, 1):  # three trainers one after another, the same layout
    t = Trainer(load_config("tiny", ["parallel.dp_shard=2", "train.global_batch=4", f"train.micro_batch={mb}",
                                     "model.n_layers=1", "train.seq_len=16", "train.device=cpu"]))
    t.train_step()
    t.close()
    counts.append(len(c10d._world.pg_map))
if dist.get_rank() == 0:
    print("groups", counts, flush=True)
dist.destroy_process_group()
os._exit(0)  # what is checked is printed; gloo's threads at interpreter exit are not this test's
"""


def test_trainers_made_one_after_another_share_their_process_groups(tmp_path: Path) -> None:
    """The step tuner builds trainers of one layout one after another over one default group:
    they share the groups of that layout (each trainer had made a set of its own, left alive)."""
    import ast
    import os
    import subprocess
    import sys

    from trainer_runs import _free_port

    script = tmp_path / "groups.py"
    script.write_text(GROUPS_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(script)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("groups")]
    assert len(lines) == 1, r.stdout
    counts = ast.literal_eval(lines[0].split(" ", 1)[1])
    assert counts[0] == counts[1] == counts[2], counts
