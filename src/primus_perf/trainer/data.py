"""Training data: synthetic learnable sequences, or a text file as byte tokens.

Both sources are deterministic functions of ``(seed, step)``: they build the *global*
batch of an optimizer step (``micro_batch * accumulation * dp`` sequences), each
data-parallel rank takes its own consecutive rows and each of its micro-batches the next
``micro_batch`` of them, so one process and ``dp`` processes, and any split of the global
batch into micro-batches, see the same global batch.

Synthetic: each sequence is an arithmetic progression modulo the vocabulary,
``x[i] = (start + stride * i) % vocab`` with a random start and a stride in 1..4: the next
token follows from the previous two, so the loss falls quickly (from ``ln(vocab)``).

Text: the file's bytes are the tokens (a byte-level tokenizer, vocabulary 256); each
sequence is a window at a random offset.
"""

from __future__ import annotations

from pathlib import Path

import torch

from primus_perf.base.errors import ConfigError

MAX_STRIDE = 4


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class SyntheticData:
    def __init__(self, vocab_size: int, seq_len: int, global_batch: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.global_batch, self.seed = (
            vocab_size,
            seq_len,
            global_batch,
            seed,
        )

    def global_tokens(self, step: int) -> torch.Tensor:
        """(global_batch, seq_len + 1) int64 tokens for ``step``."""
        g = _generator(self.seed, step)
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=g)
        stride = torch.randint(1, MAX_STRIDE + 1, (self.global_batch, 1), generator=g)
        pos = torch.arange(self.seq_len + 1).unsqueeze(0)
        return (start + stride * pos) % self.vocab_size


class TextData:
    def __init__(self, path: str, seq_len: int, global_batch: int, seed: int) -> None:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"config key 'data.path': cannot read {path} ({exc.strerror})"
            ) from None
        if len(raw) < seq_len + 2:
            raise ConfigError(
                f"config key 'data.path': {path} has {len(raw)} bytes, fewer than train.seq_len + 2 ({seq_len + 2})"
            )
        self.tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed

    def global_tokens(self, step: int) -> torch.Tensor:
        g = _generator(self.seed, step)
        starts = torch.randint(
            0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=g
        )
        idx = starts.unsqueeze(1) + torch.arange(self.seq_len + 1).unsqueeze(0)
        return self.tokens[idx]


class Batches:
    """This rank's (inputs, targets) for a micro-batch of a step, each (micro_batch, seq_len)
    int64 on CPU."""

    def __init__(self, source: SyntheticData | TextData, micro_batch: int, accumulation: int, dp_rank: int) -> None:
        self.source, self.micro_batch, self.dp_rank = source, micro_batch, dp_rank
        self.per_rank = micro_batch * accumulation
        self._step: tuple[int, torch.Tensor] | None = None

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self._step is None or self._step[0] != step:
            self._step = (step, self.source.global_tokens(step))
        lo = self.dp_rank * self.per_rank + micro * self.micro_batch
        mine = self._step[1][lo : lo + self.micro_batch]
        return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def make_batches(
    path: str | None,
    vocab_size: int,
    seq_len: int,
    micro_batch: int,
    dp: int,
    dp_rank: int,
    seed: int,
    accumulation: int = 1,
) -> Batches:
    global_batch = micro_batch * accumulation * dp
    source: SyntheticData | TextData
    if path is None:
        source = SyntheticData(vocab_size, seq_len, global_batch, seed)
    else:
        source = TextData(path, seq_len, global_batch, seed)
    return Batches(source, micro_batch, accumulation, dp_rank)
