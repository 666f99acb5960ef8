"""A torchtitan run for the script step tuner: ``primus-tune step -- -m torchtitan.train ...`` on
torchtitan's llama3, its debug model or a flavor's dimensions sliced to a few layers (the 8B at
4 layers, seq 2048 and global batch 8 fits one H200: ``torchtitan_flavors.py``), with a
tokenizer and a data set written here (the GPU machines reach no hub). Its own flags carry the
levers (the local batch at the global batch, compile, float8, activation checkpointing, the
optimizer: ``primus_perf.tuner.step.own_flags``), for the torchtitan installed (0.2 under
torch 2.11, 0.3 under newer torch).

:func:`torchtitan_case` gives the target and its environment; as a script it runs the tuner
(every argument after ``--`` goes to ``primus-tune step``)::

    python benchmarks/trainer/torchtitan_case.py --workdir /tmp/titan --flavor 8B --layers 4 \\
        -- --budget-min 45 --levers micro_batch,compile,recompute,fp8,optimizer
    python benchmarks/trainer/torchtitan_case.py --workdir /tmp/titan --flavor debugmodel --layers 0 --print
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks import ROOT

FLAVORS = "benchmarks.trainer.torchtitan_flavors"  # torchtitan imports it: its sliced flavors
WORDS = 1000  # the tokenizer's words (the debug model's vocabulary is 2048)
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"


def write_assets(out: Path, *, docs: int = 4000, seed: int = 0) -> Path:
    """A word-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``, as torchtitan's
    ``HuggingFaceTokenizer`` reads them) and ``data/train.json`` (lines of ``{"text": ...}``, as
    its ``c4_test`` loader reads a folder): texts of words drawn from a Pareto law, so that the
    loss falls as the model learns their frequencies. The same files for the same seed."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {tok: i for i, tok in enumerate([BOS, EOS, UNK, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    rng = random.Random(seed)
    (out / "data").mkdir(exist_ok=True)
    with open(out / "data" / "train.json", "w") as f:
        for _ in range(docs):
            n = rng.randint(64, 512)
            text = " ".join(words[min(int(rng.paretovariate(1.2)) - 1, WORDS - 1)] for _ in range(n))
            f.write(json.dumps({"text": text}) + "\n")
    return out


def torchtitan_case(workdir: str | Path, *, flavor: str = "8B", layers: int | None = 4, seq: int = 2048,
                    local_batch: int = 1, global_batch: int = 8, steps: int = 1000) -> tuple[list[str], dict[str, str]]:
    """The target (``-m torchtitan.train`` and its options, for the torchtitan installed: 0.2 or
    0.3) and the environment variables to add for a run of its llama3 ``flavor`` (``layers``
    None: all of them; else its first ``layers``: ``torchtitan_flavors.py``) on the tokenizer
    and data written under ``workdir`` (once), at ``seq`` tokens, ``local_batch`` sequences a
    forward and backward and ``global_batch`` an optimizer step (their ratio its gradient
    accumulation), ``steps`` steps at most (a measured run stops itself), its learning rate
    warmed up in 2 steps (the loss moves within a run), its weights from one seed (runs start
    alike, for the loss guard); no TensorBoard, no profiler of its own,
    its outputs under ``workdir``."""
    from primus_perf.tuner.step.own_flags import installed_version

    workdir = Path(workdir).resolve()
    assets = workdir / "assets"
    if not (assets / "tokenizer.json").is_file():
        write_assets(assets)
    version = installed_version("torchtitan")
    if version is None:
        raise SystemExit("torchtitan is not installed (pip install torchtitan; examples/torchtitan/README.md)")
    common = ["--training.seq-len", str(seq), "--training.local-batch-size", str(local_batch),
              "--training.global-batch-size", str(global_batch), "--training.steps", str(steps),
              "--lr-scheduler.warmup-steps", "2", "--debug.seed", "0", "--metrics.no-enable-tensorboard"]
    if version >= (0, 3):
        config = f"llama3_{flavor.lower()}" if layers is None else f"llama3_{flavor}_{layers}layers"
        target = ["-m", "torchtitan.train", "--module", "llama3" if layers is None else FLAVORS, "--config", config,
                  "--hf-assets-path", str(assets), "--dataloader.dataset", "c4_test",
                  "--dataloader.dataset-path", str(assets / "data"), "--dump-folder", str(workdir / "outputs"),
                  "--profiler.no-enable-profiling", *common]
    else:
        target = ["-m", "torchtitan.train", "--model.name", "llama3",
                  "--model.flavor", flavor if layers is None else f"{flavor}_{layers}layers",
                  "--experimental.custom-import", FLAVORS, "--model.hf-assets-path", str(assets),
                  "--training.dataset", "c4_test", "--training.dataset-path", str(assets / "data"),
                  "--job.dump-folder", str(workdir / "outputs"), "--profiling.no-enable-profiling", *common]
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return target, env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="the tokenizer, the data and the tuner's folder (step/)")
    parser.add_argument("--flavor", default="8B", help="torchtitan's llama3 flavor: debugmodel, 8B, 70B, ...")
    parser.add_argument("--layers", type=int, default=4, help="its first N layers (0: all)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--local-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--print", action="store_true", help="print the command, run nothing but the assets")
    opts = parser.parse_args(argv[:cut])
    target, env = torchtitan_case(opts.workdir, flavor=opts.flavor, layers=opts.layers or None, seq=opts.seq,
                                  local_batch=opts.local_batch, global_batch=opts.global_batch)
    cmd = [sys.executable, "-m", "primus_perf.cli.tune", "step", "--out", str(Path(opts.workdir) / "step"),
           *argv[cut + 1:], "--", *target]
    if opts.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return 0
    return subprocess.run(cmd, env={**os.environ, **env}, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
