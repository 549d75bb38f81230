"""Tokenised samples -> fixed-shape micro-batches, micro-batch i a pure function of i."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

import torch


@dataclass
class MicroBatch:
    index: int
    input_ids: torch.Tensor  # LongTensor [B, S], right-padded with pad_token_id
    loss_mask: torch.Tensor  # LongTensor [B, S], 0 on padding
    sample_ids: list[int]  # index into samples per row; -1 for a filler row in an epoch's last batch


class MicroBatchSource:
    """Micro-batch i as a pure function of (samples, settings, i), so resume is exact.

    Epoch e = i // num_batches_per_epoch uses its own seeded permutation of the samples.
    The permutation is cut into windows of `bucket_window` batches; inside a window the
    samples are sorted by length before being cut into batches (little padding), and the
    window's batches are then shuffled so lengths do not trend within the epoch. When the
    sample count is not a multiple of micro_batch_size, one batch per epoch is topped up
    with empty rows (all pad, loss_mask 0): every sample appears exactly once per epoch and
    every batch has the same number of rows.
    """

    def __init__(self, samples: list[dict], *, micro_batch_size: int, seed: int, pad_token_id: int,
                 length_multiple: int = 64, fixed_length: int | None = None, bucket_window: int = 8):
        if not samples:
            raise ValueError("MicroBatchSource needs at least one sample")
        if micro_batch_size < 1 or length_multiple < 1 or bucket_window < 1:
            raise ValueError("micro_batch_size, length_multiple and bucket_window must be positive")
        self.samples = samples
        self.lengths = [len(s["input_ids"]) for s in samples]
        if fixed_length is not None and max(self.lengths) > fixed_length:
            raise ValueError(f"fixed_length={fixed_length} is shorter than the longest sample "
                             f"({max(self.lengths)} tokens); raise it or lower max_length")
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.length_multiple = length_multiple
        self.fixed_length = fixed_length
        self.bucket_window = bucket_window
        self._epoch_plan = lru_cache(maxsize=2)(self._plan_epoch)

    @property
    def num_batches_per_epoch(self) -> int:
        return math.ceil(len(self.samples) / self.micro_batch_size)

    def _plan_epoch(self, epoch: int) -> list[list[int]]:
        """The sample ids of each batch of one epoch."""
        rng = random.Random(f"dflash-batches/{self.seed}/{epoch}")  # str seeds hash stably across runs
        order = list(range(len(self.samples)))
        rng.shuffle(order)
        size, window = self.micro_batch_size, self.micro_batch_size * self.bucket_window
        plan = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda sid: self.lengths[sid])
            batches = [chunk[i:i + size] for i in range(0, len(chunk), size)]
            rng.shuffle(batches)
            plan += batches
        return plan

    def _padded_length(self, sample_ids: Iterable[int]) -> int:
        if self.fixed_length is not None:
            return self.fixed_length
        longest = max(self.lengths[sid] for sid in sample_ids)
        return math.ceil(longest / self.length_multiple) * self.length_multiple

    def batch(self, i: int) -> MicroBatch:
        if i < 0:
            raise ValueError(f"micro-batch index must be >= 0, got {i}")
        epoch, position = divmod(i, self.num_batches_per_epoch)
        sample_ids = self._epoch_plan(epoch)[position]
        rows, length = self.micro_batch_size, self._padded_length(sample_ids)
        input_ids = torch.full((rows, length), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((rows, length), dtype=torch.long)
        for row, sid in enumerate(sample_ids):
            n = self.lengths[sid]
            input_ids[row, :n] = self.samples[sid]["input_ids"]
            loss_mask[row, :n] = self.samples[sid]["loss_mask"]
        filler = [-1] * (rows - len(sample_ids))
        return MicroBatch(index=i, input_ids=input_ids, loss_mask=loss_mask, sample_ids=list(sample_ids) + filler)

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of the token slots of one epoch's batches that are padding (filler rows included)."""
        plan = self._epoch_plan(epoch)
        slots = sum(self._padded_length(ids) * self.micro_batch_size for ids in plan)
        return 1.0 - sum(self.lengths) / slots
