"""Records -> tokenised samples with assistant loss masks, cached per source.

A conversation is rendered with the tokenizer's own chat template (render.py finds each
assistant turn in the rendering); the loss mask covers every token of an assistant turn after
its role header through its end-of-turn special token (e.g. `<|im_end|>`): reasoning, content
and tool-call text, which is what the target generates and what a drafter must learn to
propose. System, user and tool-output text is never supervised. Preformatted text is supervised
in full: there is no role structure to tell prompt from answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from .records import (
    BAD_LINE_REASONS,
    DataError,
    Record,
    check_on_bad_line,
    count_bad_line,
    dataset_sources,
    file_digest,
    read_records,
)
from .render import ChatRenderer, tokenizer_name

# Bump when the tokenisation rules change, so stale caches are never reused.
CACHE_FORMAT = "dflash-data-v2"
TOKENIZE_CHUNK = 512  # texts per call into the Rust tokenizer (it batches in parallel)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(path):
    """The tokenizer saved in a local directory; never looks anything up on a model hub."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        problem = "is a file, not a directory" if path.exists() else "does not exist"
        raise DataError(f"tokenizer path {str(path)!r} {problem}; give the local directory of a saved tokenizer "
                        f"(nothing is downloaded from a model hub)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"tokenizer path {str(path)!r} holds no tokenizer ({' or '.join(TOKENIZER_FILES)})")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# ------------------------------------------------------------------------- tokenising
def _loss_mask(offsets: torch.Tensor, spans: list[tuple[int, int]] | None) -> torch.Tensor:
    """1 on every token that overlaps a supervised character span; all ones when spans is None.

    offsets: [T, 2] character spans of the tokens.
    """
    if spans is None:
        return torch.ones(len(offsets), dtype=torch.long)
    mask = torch.zeros(len(offsets), dtype=torch.bool)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return mask.long()


def _render(record: Record, renderer: ChatRenderer | None, last_turn_only: bool):
    """(text, supervised spans or None for preformatted text)."""
    if record.text is not None:
        return record.text, None
    return renderer.conversation(record, last_turn_only)


def _new_stats() -> dict:
    return {"read": 0, "kept": 0, "dropped_no_pair": 0, "bad_lines_skipped": 0,
            **{f"skipped_{reason}": 0 for reason in BAD_LINE_REASONS}, "truncated": 0, "tokens": 0,
            "supervised_tokens": 0}


def _tokenize_source(path: Path, tokenizer, *, max_length: int, last_turn_only: bool, on_bad_line: str,
                     chat_template_kwargs: dict):
    stats, rendered, renderer = _new_stats(), [], None
    for location, record in read_records(path, on_bad_line=on_bad_line, stats=stats):
        if record.messages is not None and renderer is None:  # the template is checked only when needed
            renderer = ChatRenderer(tokenizer, chat_template_kwargs)
        try:
            rendered.append(_render(record, renderer, last_turn_only))
        except Exception as err:  # noqa: BLE001 - a template may fail in any way on one conversation: a bad line
            count_bad_line(f"{path} {location}", "unrenderable", err, on_bad_line=on_bad_line, stats=stats)

    samples = []
    for chunk_start in range(0, len(rendered), TOKENIZE_CHUNK):
        chunk = rendered[chunk_start:chunk_start + TOKENIZE_CHUNK]
        encoded = tokenizer([text for text, _ in chunk], add_special_tokens=False, return_offsets_mapping=True)
        for (_, spans), ids, offsets in zip(chunk, encoded["input_ids"], encoded["offset_mapping"]):
            ids = torch.tensor(ids, dtype=torch.long)
            mask = _loss_mask(torch.tensor(offsets, dtype=torch.long).reshape(-1, 2), spans)
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


def _load_cache(file: Path) -> tuple[list[dict], dict] | None:
    """The cached samples and stats, or None (with a warning) when the file is unreadable."""
    try:
        payload = torch.load(file, weights_only=True)
        lengths = payload["lengths"].tolist()
        ids = payload["input_ids"].long().split(lengths)
        masks = payload["loss_mask"].long().split(lengths)
        stats = dict(payload["stats"])
    except Exception as err:  # noqa: BLE001 - a torn or foreign file fails in many ways; it is rebuilt
        warnings.warn(f"tokenised cache {file} is unreadable ({type(err).__name__}: {err}); rebuilding it",
                      stacklevel=3)
        return None
    return [{"input_ids": i, "loss_mask": m} for i, m in zip(ids, masks)], stats


# ------------------------------------------------------------------------- public loader
def load_samples(paths, tokenizer, *, max_length: int, last_turn_only: bool = False, on_bad_line: str = "fail",
                 cache_dir=None, chat_template_kwargs: dict | None = None) -> tuple[list[dict], dict]:
    """Tokenise local chat datasets into training samples.

    paths: a path or a list of them, each a file, a datasets directory or a directory of files
    (records.dataset_sources). chat_template_kwargs go to every apply_chat_template call (e.g.
    {"enable_thinking": False}).
    Returns (samples, stats): samples are dicts of `input_ids` and `loss_mask` LongTensors [S_i];
    stats counts read, kept, dropped_no_pair, bad_lines_skipped (and per reason skipped_<reason>),
    truncated, tokens and supervised_tokens over all sources, plus first_bad_line (where and why)
    when a line was skipped; read == kept + dropped_no_pair + bad_lines_skipped. Each source's
    result is cached under cache_dir, keyed by its bytes, the tokenizer and the settings.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    check_on_bad_line(on_bad_line)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"tokenizer {tokenizer_name(tokenizer)} is not a fast tokenizer; "
                        f"loss masks need its offset mapping")
    kwargs = dict(chat_template_kwargs or {})
    try:
        json.dumps(kwargs)
    except TypeError as err:
        raise ValueError(f"chat_template_kwargs must hold JSON values, got {chat_template_kwargs!r}: {err}") from None
    settings = {"max_length": max_length, "last_turn_only": last_turn_only, "on_bad_line": on_bad_line,
                "chat_template_kwargs": kwargs}
    sources = dataset_sources(paths)
    samples, totals = [], {}
    for path in sources:
        cache_file = Path(cache_dir) / f"{_cache_key(path, tokenizer, settings)}.pt" if cache_dir else None
        cached = _load_cache(cache_file) if cache_file is not None and cache_file.is_file() else None
        if cached is None:
            cached = _tokenize_source(path, tokenizer, **settings)
            if cache_file is not None:
                _save_cache(cache_file, *cached)
        samples += cached[0]
        for key, value in cached[1].items():
            totals[key] = totals.get(key, 0) + value if isinstance(value, int) else totals.get(key, value)
    if not samples:
        raise DataError(f"no usable samples in {[str(p) for p in sources]} after filtering: {totals}")
    return samples, totals


# ------------------------------------------------------------------------- reporting
def describe_drops(stats: dict) -> str:
    """One line: how many records were kept, how many dropped and why."""
    dropped = stats.get("read", 0) - stats.get("kept", 0)
    reasons = [f"{stats[f'skipped_{reason}']} {text}" for reason, text in BAD_LINE_REASONS.items()
               if stats.get(f"skipped_{reason}")]
    if stats.get("dropped_no_pair"):
        reasons.append(f"{stats['dropped_no_pair']} with fewer than two supervised tokens")
    line = f"kept {stats.get('kept', 0)} of {stats.get('read', 0)} records, dropped {dropped}"
    line += f" ({', '.join(reasons)})" if reasons else ""
    if stats.get("truncated"):
        line += f"; {stats['truncated']} truncated to max_length"
    if stats.get("first_bad_line"):
        line += f"; first skipped line: {stats['first_bad_line']}"
    return line


def drop_warning(stats: dict, *, threshold: float = 0.5) -> str | None:
    """A loud warning when more than `threshold` of the records read were dropped, else None."""
    read = stats.get("read", 0)
    if not read or (read - stats.get("kept", 0)) / read <= threshold:
        return None
    return f"WARNING: most of the dataset was dropped: {describe_drops(stats)}"
