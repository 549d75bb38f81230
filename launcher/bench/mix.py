"""Length mixes: how long real prompts and answers are, and rows built from them.

A mix is a list of (prompt tokens, answer tokens) per conversation: read from a user's dataset
(`--lengths FILE`: rendered and tokenised exactly as training does, by dflash_core.data.load_samples
with the bench target's tokenizer; the prompt is every unsupervised token, the answer every
supervised one, so a multi-turn conversation counts its turns together), or the built-in mix.

The built-in mix (BUILTIN_COMPONENTS): chat turns with ShareGPT-like lognormal prompt and answer
lengths, and a smaller share of reasoning traces with long answers (a long tail cut at the row
length). docs/perf_notes.md ("How to measure", "Length mixes") gives the medians and means it
draws and the published ShareGPT figures it is modelled on.

From a mix the bench builds (1) in-memory samples with random token ids and the loss mask on the
answer span, fed through the real MicroBatchSource in padded and packed mode for the stage rows,
and (2) a conversation file whose rendered token lengths equal the mix under the bench target's
tokenizer, so the end-to-end rows run the launcher's own tokenisation and packing.
"""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

REFERENCE_LENGTH = 4096   # the row length the built-in mix's token counts are meant for
# (name, share, prompt median, prompt sigma, answer median, answer sigma): lognormal token counts.
BUILTIN_COMPONENTS = (("chat", 0.8, 120, 1.0, 140, 0.9),
                      ("reasoning", 0.2, 150, 0.8, 1800, 0.7))
MODES = ("padded", "packed")


class MixError(ValueError):
    """A length mix or a tokenizer the mix rows cannot use; the message says why."""


@dataclass(frozen=True)
class LengthMix:
    source: str                 # "built-in" or the dataset path
    prompts: tuple[int, ...]    # unsupervised tokens per conversation
    answers: tuple[int, ...]    # supervised tokens per conversation

    def capped(self, seq_len: int) -> "LengthMix":
        """Each conversation cut to seq_len tokens from the end, as data.max_length truncation does
        (the answer loses tokens first; at least 2 stay supervised, so it keeps an anchor)."""
        prompts, answers = [], []
        for prompt, answer in zip(self.prompts, self.answers):
            total = min(prompt + answer, seq_len)
            answer = max(2, total - prompt)
            prompts.append(total - answer)
            answers.append(answer)
        return LengthMix(self.source, tuple(prompts), tuple(answers))

    def describe(self) -> dict:
        totals = [p + a for p, a in zip(self.prompts, self.answers)]
        return {"source": self.source, "conversations": len(totals),
                "median_prompt": statistics.median(self.prompts), "median_answer": statistics.median(self.answers),
                "mean_prompt": statistics.fmean(self.prompts), "mean_answer": statistics.fmean(self.answers),
                "mean_tokens": statistics.fmean(totals), "max_tokens": max(totals)}


def builtin_mix(count: int, *, seed: int = 0, scale: float = 1.0) -> LengthMix:
    """`count` conversations drawn from BUILTIN_COMPONENTS; `scale` shrinks every length (tiny rows)."""
    if count < 1:
        raise MixError(f"a length mix needs at least one conversation, got count={count}")
    rng = random.Random(f"dflash-bench-mix/{seed}")
    shares = [component[1] for component in BUILTIN_COMPONENTS]
    prompts, answers = [], []
    for _ in range(count):
        _, _, p_median, p_sigma, a_median, a_sigma = rng.choices(BUILTIN_COMPONENTS, weights=shares)[0]
        prompts.append(max(1, round(rng.lognormvariate(math.log(p_median), p_sigma) * scale)))
        answers.append(max(2, round(rng.lognormvariate(math.log(a_median), a_sigma) * scale)))
    return LengthMix("built-in", tuple(prompts), tuple(answers))


def mix_from_file(path, tokenizer, *, max_length: int, count: int, seed: int = 0,
                  chat_template_kwargs: dict | None = None) -> LengthMix:
    """The lengths of a dataset's conversations under `tokenizer`, rendered as training renders
    them; `count` of them drawn at random (all when the file has fewer)."""
    from dflash_core.data import load_samples

    samples, _ = load_samples([Path(path)], tokenizer, max_length=max_length, chat_template_kwargs=chat_template_kwargs)
    samples = random.Random(f"dflash-bench-lengths/{seed}").sample(samples, min(count, len(samples)))
    answers = [int(s["loss_mask"].sum()) for s in samples]
    return LengthMix(str(path), tuple(len(s["input_ids"]) - a for s, a in zip(samples, answers)), tuple(answers))


def synthesize_samples(mix: LengthMix, *, id_limit: int, seed: int = 0) -> list[dict]:
    """Training samples of the mix's lengths: random ids below id_limit, loss mask on the answer."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for prompt, answer in zip(mix.prompts, mix.answers):
        ids = torch.randint(0, id_limit, (prompt + answer,), generator=gen)
        mask = torch.cat([torch.zeros(prompt, dtype=torch.long), torch.ones(answer, dtype=torch.long)])
        samples.append({"input_ids": ids, "loss_mask": mask})
    return samples


@dataclass
class MixRows:
    """The micro-batches one mode's stage rows time, and what a whole epoch of that mode holds.
    A step's cost does not depend on what its row holds (static shapes), so the epoch figures turn a
    measured step time into the rates a whole epoch trains at, free of the sampling noise of the
    few rows timed."""
    mode: str
    batches: list            # dflash_core.data.MicroBatch, micro-batch size 1
    real_tokens: list[int]   # non-padding tokens per batch
    padding_fraction: float  # padding / all tokens of one epoch's rows (what the launcher's target forwards)
    epoch_anchor_fill: float  # valid anchor slots / all slots over one epoch's rows


def mix_batches(samples: list[dict], *, mode: str, seq_len: int, count: int, pad_token_id: int, num_anchors: int,
                seed: int = 0) -> MixRows:
    """The first `count` micro-batches (micro-batch 1) of the real MicroBatchSource in `mode`, and
    its epoch's padding and anchor fill (each row fills min(anchor candidates, num_anchors) slots)."""
    from dflash_core.data import MicroBatchSource
    from dflash_core.loss.anchors import anchor_candidates

    if mode not in MODES:
        raise MixError(f"unknown mode {mode!r}; choose from {MODES}")
    source = MicroBatchSource(samples, micro_batch_size=1, seed=seed, pad_token_id=pad_token_id,
                              fixed_length=seq_len, packing=mode == "packed")
    epoch = [source.batch(i) for i in range(source.num_batches_per_epoch)]
    valid = [int(anchor_candidates(b.loss_mask, b.position_ids).sum().clamp(max=num_anchors)) for b in epoch]
    batches = [source.batch(i) for i in range(count)]
    return MixRows(mode, batches, [b.num_tokens for b in batches], source.padding_fraction(),
                   sum(valid) / (num_anchors * len(epoch)))
