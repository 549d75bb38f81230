"""Records -> tokenised samples with assistant loss masks, cached per file.

A conversation is rendered with the tokenizer's own chat template; the loss mask covers each
assistant turn from the end of its role header through its end-of-turn special token (e.g.
`<|im_end|>`), which is what the target generates and what a drafter must learn to propose.
Preformatted text is supervised in full: there is no role structure to tell prompt from answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from jinja2 import TemplateError

from .records import DataError, Record, file_digest, read_records

# Bump when the tokenisation rules change, so stale caches are never reused.
CACHE_FORMAT = "dflash-data-v1"
TOKENIZE_CHUNK = 512  # texts per call into the Rust tokenizer (it batches in parallel)


# ------------------------------------------------------------------------- tokenising
def _tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def _check_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = _tokenizer_name(tokenizer)
        raise DataError(f"tokenizer {name} has no chat template; conversations cannot be rendered "
                        f"(set tokenizer.chat_template or use preformatted {{\"text\"}} records)")


def _render(record: Record, tokenizer, last_turn_only: bool) -> tuple[str, list[int] | None]:
    """The text to tokenise and the character offsets where supervised spans start
    (None for preformatted text, which is supervised in full).

    A conversation's assistant turn k starts where the rendering of messages[:k] with the
    generation prompt ends, i.e. right after the assistant role header. That rendering must
    be a prefix of the full one, which holds for ChatML, Qwen3 and Llama-3 templates; a
    template that rewrites earlier turns is reported rather than guessed around.
    """
    if record.text is not None:
        return record.text, None
    _check_chat_template(tokenizer)
    messages = list(record.messages)

    def render(msgs, add_generation_prompt):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)

    full = render(messages, False)
    assistant_turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        assistant_turns = assistant_turns[-1:]
    starts = []
    for k in assistant_turns:
        head = render(messages[:k], True)
        if not full.startswith(head):
            raise DataError(f"chat template of tokenizer {_tokenizer_name(tokenizer)} renders the conversation "
                            f"differently from its prefix before assistant turn {k}; cannot locate the turn")
        starts.append(len(head))
    return full, starts


def _loss_mask(offsets: torch.Tensor, special: torch.Tensor, starts: list[int] | None) -> torch.Tensor:
    """1 on tokens from each span start through the next special token (the end of turn);
    all ones when starts is None.

    offsets: [T, 2] character spans of the tokens; special: [T] bool, token is a special token.
    """
    if starts is None:
        return torch.ones(len(offsets), dtype=torch.long)
    mask = torch.zeros(len(offsets), dtype=torch.long)
    token_ends = offsets[:, 1].contiguous()
    special_positions = special.nonzero().flatten()
    for start in starts:
        first = int(torch.searchsorted(token_ends, start, side="right"))  # first token ending after start
        after = special_positions[special_positions >= first]
        if len(after) == 0:
            raise DataError("no end-of-turn special token follows an assistant turn; "
                            "the chat template is not supported")
        mask[first:int(after[0]) + 1] = 1
    return mask


def _tokenize_file(path: Path, tokenizer, *, max_length: int, last_turn_only: bool, on_bad_line: str):
    stats = {"read": 0, "kept": 0, "dropped_no_pair": 0, "bad_lines_skipped": 0, "truncated": 0,
             "tokens": 0, "supervised_tokens": 0}
    rendered = []
    for location, record in read_records(path, on_bad_line=on_bad_line, stats=stats):
        try:
            rendered.append(_render(record, tokenizer, last_turn_only))
        except TemplateError as err:  # the template may reject a conversation (e.g. raise_exception)
            if on_bad_line == "fail":
                raise DataError(f"{path} {location}: the chat template rejected the conversation: {err}") from err
            stats["bad_lines_skipped"] += 1

    special_ids = torch.tensor(sorted(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special))
    samples = []
    for chunk_start in range(0, len(rendered), TOKENIZE_CHUNK):
        chunk = rendered[chunk_start:chunk_start + TOKENIZE_CHUNK]
        encoded = tokenizer([text for text, _ in chunk], add_special_tokens=False, return_offsets_mapping=True)
        for (_, starts), ids, offsets in zip(chunk, encoded["input_ids"], encoded["offset_mapping"]):
            ids = torch.tensor(ids, dtype=torch.long)
            mask = _loss_mask(torch.tensor(offsets, dtype=torch.long).reshape(-1, 2),
                              torch.isin(ids, special_ids), starts)
            if len(ids) > max_length:
                ids, mask = ids[:max_length], mask[:max_length]
                stats["truncated"] += 1
            if not bool((mask[:-1] & mask[1:]).any()):  # no anchor with a following label
                stats["dropped_no_pair"] += 1
                continue
            samples.append({"input_ids": ids, "loss_mask": mask})
            stats["kept"] += 1
            stats["tokens"] += len(ids)
            stats["supervised_tokens"] += int(mask.sum())
    return samples, stats


# ------------------------------------------------------------------------- caching
def _tokenizer_fingerprint(tokenizer) -> str:
    state = tokenizer.backend_tokenizer.to_str() + "\0" + str(tokenizer.chat_template)
    return hashlib.sha256(state.encode()).hexdigest()


def _cache_key(path: Path, tokenizer, settings: dict) -> str:
    parts = [CACHE_FORMAT, file_digest(path), _tokenizer_fingerprint(tokenizer), json.dumps(settings, sort_keys=True)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _save_cache(file: Path, samples: list[dict], stats: dict) -> None:
    def flat(key, dtype):  # stored narrow: ids fit int32, the mask is 0/1
        return torch.cat([torch.zeros(0, dtype=dtype)] + [s[key].to(dtype) for s in samples])

    payload = {
        "input_ids": flat("input_ids", torch.int32),
        "loss_mask": flat("loss_mask", torch.uint8),
        "lengths": torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.long),
        "stats": stats,
    }
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name, suffix=".tmp")
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, file)  # atomic: concurrent readers see the old file or the whole new one


def _load_cache(file: Path) -> tuple[list[dict], dict]:
    payload = torch.load(file, weights_only=True)
    lengths = payload["lengths"].tolist()
    ids = payload["input_ids"].long().split(lengths)
    masks = payload["loss_mask"].long().split(lengths)
    return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks)], payload["stats"]


# ------------------------------------------------------------------------- public loader
def load_samples(paths, tokenizer, *, max_length: int, last_turn_only: bool = False, on_bad_line: str = "fail",
                 cache_dir=None) -> tuple[list[dict], dict]:
    """Tokenise local chat datasets into training samples.

    Returns (samples, stats): samples are dicts of `input_ids` and `loss_mask` LongTensors [S_i];
    stats counts read, kept, dropped_no_pair, bad_lines_skipped, truncated, tokens and
    supervised_tokens over all files. Each file's result is cached under cache_dir, keyed by
    its bytes, the tokenizer and the settings.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"tokenizer {_tokenizer_name(tokenizer)} is not a fast tokenizer; "
                        f"loss masks need its offset mapping")
    settings = {"max_length": max_length, "last_turn_only": last_turn_only, "on_bad_line": on_bad_line}
    samples, totals = [], {}
    for path in map(Path, paths):
        if not path.is_file():
            raise DataError(f"dataset file not found: {path}")
        cache_file = Path(cache_dir) / f"{_cache_key(path, tokenizer, settings)}.pt" if cache_dir else None
        if cache_file is not None and cache_file.is_file():
            file_samples, file_stats = _load_cache(cache_file)
        else:
            file_samples, file_stats = _tokenize_file(path, tokenizer, **settings)
            if cache_file is not None:
                _save_cache(cache_file, file_samples, file_stats)
        samples += file_samples
        for key, value in file_stats.items():
            totals[key] = totals.get(key, 0) + value
    if not samples:
        raise DataError(f"no usable samples in {[str(p) for p in paths]} after filtering: {totals}")
    return samples, totals
