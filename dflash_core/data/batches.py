"""Tokenised samples -> fixed-shape micro-batches, micro-batch i a pure function of i."""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass
class MicroBatch:
    index: int
    input_ids: torch.Tensor     # LongTensor [B, S], right-padded with pad_token_id
    loss_mask: torch.Tensor     # LongTensor [B, S], 0 on padding
    position_ids: torch.Tensor  # LongTensor [B, S]: 0 at every document start; unpacked rows 0..S-1,
    #                             packed rows' end padding a segment of its own starting at 0
    sample_ids: list[tuple[int, ...]]  # per row, the samples it holds in order; () for a filler row
    num_tokens: int             # the samples' tokens (not padding), counted from their lengths


class MicroBatchSource:
    """Micro-batch i as a pure function of (samples, settings, i), so resume is exact.

    A row holds one sample (unpacked) or, with packing=True, several whole samples back to back
    in a row of fixed_length tokens. Rows are then dealt into micro-batches per epoch:
    epoch e = i // num_batches_per_epoch uses its own seeded permutation; every sample appears
    exactly once per epoch, and every batch has the same number of rows (one batch per epoch is
    topped up with filler rows: all pad, loss_mask 0, when the row count is not a multiple of
    micro_batch_size).

    Unpacked: the epoch's permutation of the samples is cut into windows of `bucket_window`
    batches; inside a window the samples are sorted by length before being cut into batches
    (little padding), and the window's batches are then shuffled so lengths do not trend within
    the epoch.
    Packed: the rows are formed once (their composition does not depend on the epoch; documents
    in a row never see each other, so only the row order matters): a seeded permutation of the
    samples is cut into windows of about `pack_window_rows` rows' worth of tokens, and each window
    is bin-packed best-fit decreasing (the padding left is about one part-filled row per window).
    Each epoch shuffles the rows.
    """

    def __init__(self, samples: Sequence[dict], *, micro_batch_size: int, seed: int, pad_token_id: int,
                 length_multiple: int = 64, fixed_length: int | None = None, bucket_window: int = 8,
                 packing: bool = False, pack_window_rows: int = 64):
        if not samples:
            raise ValueError("MicroBatchSource needs at least one sample")
        if min(micro_batch_size, length_multiple, bucket_window, pack_window_rows) < 1:
            raise ValueError(f"micro_batch_size ({micro_batch_size}), length_multiple ({length_multiple}), "
                             f"bucket_window ({bucket_window}) and pack_window_rows ({pack_window_rows}) "
                             f"must be positive")
        if packing and fixed_length is None:
            raise ValueError("packing needs a fixed row length: set fixed_length (data.fixed_length)")
        self.samples = samples
        # A store's view (store.Samples) knows its lengths without reading a sample.
        lengths = getattr(samples, "lengths", None)
        self.lengths = lengths.tolist() if lengths is not None else [len(s["input_ids"]) for s in samples]
        if fixed_length is not None:
            longest = max(range(len(samples)), key=self.lengths.__getitem__)
            if self.lengths[longest] > fixed_length:
                raise ValueError(f"sample {longest} has {self.lengths[longest]} tokens, more than "
                                 f"fixed_length={fixed_length}: raise fixed_length, or truncate in "
                                 f"tokenisation with max_length <= {fixed_length}")
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.pad_token_id = pad_token_id
        self.length_multiple = length_multiple
        self.fixed_length = fixed_length
        self.bucket_window = bucket_window
        self.packing = packing
        self.pack_window_rows = pack_window_rows
        self._packed_rows = self._pack() if packing else None
        self._epoch_plan = lru_cache(maxsize=2)(self._plan_epoch)

    @property
    def num_rows(self) -> int:
        """Rows holding samples (filler rows not counted)."""
        return len(self._packed_rows) if self.packing else len(self.samples)

    @property
    def num_batches_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.micro_batch_size)

    def _pack(self) -> list[tuple[int, ...]]:
        """Rows of whole samples, best-fit decreasing inside windows of a seeded permutation."""
        order = list(range(len(self.samples)))
        random.Random(f"dflash-packing/{self.seed}").shuffle(order)  # str seeds hash stably across runs
        window_tokens = self.pack_window_rows * self.fixed_length
        rows, start = [], 0
        while start < len(order):
            end, tokens = start, 0
            while end < len(order) and tokens < window_tokens:
                tokens += self.lengths[order[end]]
                end += 1
            rows += self._best_fit_decreasing(order[start:end])
            start = end
        return rows

    def _best_fit_decreasing(self, sample_ids: list[int]) -> list[tuple[int, ...]]:
        """Longest first, each sample into the open row it fills most tightly (a new row if none fits)."""
        rows: list[list[int]] = []
        space: list[tuple[int, int]] = []  # (free tokens, row) ascending
        for sid in sorted(sample_ids, key=lambda s: (-self.lengths[s], s)):
            need = self.lengths[sid]
            tightest = bisect.bisect_left(space, (need, -1))
            if tightest == len(space):
                rows.append([sid])
                free, row = self.fixed_length - need, len(rows) - 1
            else:
                free, row = space.pop(tightest)
                rows[row].append(sid)
                free -= need
            bisect.insort(space, (free, row))
        return [tuple(row) for row in rows]

    def _plan_epoch(self, epoch: int) -> list[list[tuple[int, ...]]]:
        """The rows (tuples of sample ids) of each batch of one epoch."""
        rng = random.Random(f"dflash-batches/{self.seed}/{epoch}")  # str seeds hash stably across runs
        size = self.micro_batch_size
        if self.packing:
            order = list(range(len(self._packed_rows)))
            rng.shuffle(order)
            return [[self._packed_rows[r] for r in order[i:i + size]] for i in range(0, len(order), size)]
        order = list(range(len(self.samples)))
        rng.shuffle(order)
        window = size * self.bucket_window
        plan = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda sid: self.lengths[sid])
            batches = [chunk[i:i + size] for i in range(0, len(chunk), size)]
            rng.shuffle(batches)
            plan += [[(sid,) for sid in batch] for batch in batches]
        return plan

    def _row_tokens(self, row: tuple[int, ...]) -> int:
        return sum(self.lengths[sid] for sid in row)

    def _padded_length(self, rows: list[tuple[int, ...]]) -> int:
        if self.fixed_length is not None:
            return self.fixed_length
        longest = max(self._row_tokens(row) for row in rows)
        return math.ceil(longest / self.length_multiple) * self.length_multiple

    def batch(self, i: int) -> MicroBatch:
        if i < 0:
            raise ValueError(f"micro-batch index must be >= 0, got {i}")
        epoch, position = divmod(i, self.num_batches_per_epoch)
        rows = self._epoch_plan(epoch)[position]
        rows = rows + [()] * (self.micro_batch_size - len(rows))
        length = self._padded_length(rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((len(rows), length), dtype=torch.long)
        position_ids = torch.arange(length).repeat(len(rows), 1)
        for r, row in enumerate(rows):
            offset = 0
            for sid in row:
                n = self.lengths[sid]
                sample = self.samples[sid]
                input_ids[r, offset:offset + n] = sample["input_ids"]
                loss_mask[r, offset:offset + n] = sample["loss_mask"]
                position_ids[r, offset:offset + n] = torch.arange(n)
                offset += n
            if self.packing:
                position_ids[r, offset:] = torch.arange(length - offset)
        return MicroBatch(index=i, input_ids=input_ids, loss_mask=loss_mask, position_ids=position_ids,
                          sample_ids=rows, num_tokens=sum(self._row_tokens(row) for row in rows))

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of the token slots of one epoch's batches that are padding (filler rows included).
        Packed rows do not depend on the epoch."""
        plan = self._epoch_plan(epoch)
        slots = sum(self._padded_length(rows) * self.micro_batch_size for rows in plan)
        return 1.0 - sum(self.lengths) / slots
