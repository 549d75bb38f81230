"""Dataset files -> normalised records (conversations or preformatted text), with the file and
line of every malformed row.

Records are conversations (`{"conversations"|"messages": [{"role", "content"}]}`, ShareGPT
`{"from", "value"}` accepted) or preformatted `{"text"}` strings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

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


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (cache keys and resume fingerprints)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
