"""Chat data: local files -> tokenised samples with assistant loss masks -> micro-batches.

Records are conversations (`{"conversations"|"messages": [{"role", "content"}]}`, ShareGPT
`{"from", "value"}` accepted) or preformatted `{"text"}` strings. A conversation is rendered
with the tokenizer's own chat template; the loss mask covers each assistant turn from the
end of its role header through its end-of-turn special token (e.g. `<|im_end|>`), which is
what the target generates and what a drafter must learn to propose. Preformatted text is
supervised in full: there is no role structure to tell prompt from answer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from jinja2 import TemplateError

# Bump when the tokenisation rules change, so stale caches are never reused.
CACHE_FORMAT = "dflash-data-v1"
TOKENIZE_CHUNK = 512  # texts per call into the Rust tokenizer (it batches in parallel)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


class DataError(ValueError):
    """A dataset or tokenizer problem the user must fix; the message says where."""


@dataclass(frozen=True)
class Record:
    """One normalised dataset entry: either a conversation or a preformatted text."""

    messages: tuple[dict, ...] | None = None  # each {"role": str, "content": str}
    text: str | None = None


# ------------------------------------------------------------------------- reading
def normalise_record(obj) -> Record:
    """Map one raw JSON object to a Record; raises ValueError with the reason if malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "text" in obj and not ("conversations" in obj or "messages" in obj):
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise ValueError('"text" must be a non-empty string')
        return Record(text=obj["text"])
    turns = obj.get("conversations", obj.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ValueError('expected a non-empty "conversations" (or "messages") list or a "text" string')
    return Record(messages=tuple(_normalise_message(turn) for turn in turns))


def _normalise_message(turn) -> dict:
    if not isinstance(turn, dict):
        raise ValueError(f"a message must be an object, got {type(turn).__name__}")
    if "from" in turn:  # ShareGPT
        raw_role, content = turn["from"], turn.get("value")
    else:
        raw_role, content = turn.get("role"), turn.get("content")
    role = SHAREGPT_ROLES.get(raw_role)
    if role is None:
        raise ValueError(f"unknown role {raw_role!r} (expected one of {sorted(SHAREGPT_ROLES)})")
    if not isinstance(content, str):
        raise ValueError(f"message content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def _raw_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """Yield (location, parse) per row. Parsing is deferred so that invalid JSON goes
    through the same skip-or-fail path as a well-formed but invalid record."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    yield f"line {line_no}", lambda line=line: json.loads(line)
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: invalid JSON: {err}") from err
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json dataset must hold a list of records")
        for index, row in enumerate(rows, start=1):
            yield f"record {index}", lambda row=row: row
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise DataError(f"{path}: reading .parquet needs pyarrow, which is not installed") from err
        for index, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"row {index}", lambda row=row: row
    else:
        raise DataError(f"{path}: unsupported dataset format {suffix!r} (use .jsonl, .json or .parquet)")


def read_records(path, *, on_bad_line: str = "fail", stats: dict | None = None) -> Iterator[tuple[str, Record]]:
    """(location, record) for each row of one file, location being e.g. "line 7". A malformed
    row raises DataError naming the file and line, or with on_bad_line="skip" is counted in
    stats["bad_lines_skipped"]."""
    if on_bad_line not in ("fail", "skip"):
        raise ValueError(f'on_bad_line must be "fail" or "skip", got {on_bad_line!r}')
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file not found: {path}")
    stats = stats if stats is not None else {}
    for location, parse in _raw_rows(path):
        stats["read"] = stats.get("read", 0) + 1
        try:
            record = normalise_record(parse())
        except ValueError as err:  # json.JSONDecodeError is a ValueError
            if on_bad_line == "fail":
                raise DataError(f"{path} {location}: malformed record: {err}") from err
            stats["bad_lines_skipped"] = stats.get("bad_lines_skipped", 0) + 1
            continue
        yield location, record


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


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cache_key(path: Path, tokenizer, settings: dict) -> str:
    parts = [CACHE_FORMAT, _file_digest(path), _tokenizer_fingerprint(tokenizer), json.dumps(settings, sort_keys=True)]
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


# ------------------------------------------------------------------------- micro-batches
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
