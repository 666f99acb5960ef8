"""Train a Qwen2-style causal LM with the Hugging Face ``Trainer``, as such scripts are written:
``TrainingArguments`` with a per-device batch size and gradient-accumulation steps, bf16, AdamW.
Nothing in it knows about primus-perf: ``primus-tune step -- examples/hf_trainer.py`` moves the
per-device batch size and the accumulation steps with their product held (the recipe), and
applies its other levers from outside.

    python examples/hf_trainer.py --max-steps 20
    primus-tune step --out runs/hft -- examples/hf_trainer.py --max-steps 1000
    python -m primus_perf.launch --plan runs/hft/plan.yaml -- examples/hf_trainer.py

On a GPU the model has Qwen2-7B's dimensions with ``--layers`` decoder layers and seq 2048; on
a CPU a small one of the same shape. The data are random tokens from a fixed seed.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

SIZES = {  # hidden, heads, kv heads, MLP, vocabulary, seq
    "7b": (3584, 28, 4, 18944, 152064, 2048),
    "small": (128, 4, 2, 384, 1024, 64),
}


class RandomTokens(torch.utils.data.Dataset):
    """``n`` sequences of random tokens, each drawn from its own seed when it is read (the same
    sequence for the same index, none held in memory; the labels are the inputs: the model
    shifts them)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(1234 + i))
        return {"input_ids": tokens, "labels": tokens}


def main(argv: list[str] | None = None) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="7b" if torch.cuda.is_available() else "small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=2, help="per_device_train_batch_size")
    ap.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="gradient_checkpointing (saves memory)")
    args = ap.parse_args(argv)
    hidden, heads, kv_heads, mlp, vocab, seq = SIZES[args.size]
    config = Qwen2Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=mlp, vocab_size=vocab, num_hidden_layers=args.layers,
                         max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, per_device_train_batch_size=args.batch_size,
                                     gradient_accumulation_steps=args.accumulation, max_steps=args.max_steps,
                                     learning_rate=1e-4, bf16=torch.cuda.is_available(), logging_steps=10,
                                     save_strategy="no", report_to=[], dataloader_num_workers=0, seed=0,
                                     gradient_checkpointing=args.gradient_checkpointing)
        data = RandomTokens(args.max_steps * args.batch_size * args.accumulation, seq, vocab)
        Trainer(model=model, args=training, train_dataset=data).train()


if __name__ == "__main__":
    main()
