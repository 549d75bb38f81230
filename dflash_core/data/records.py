"""Dataset files -> normalised records (conversations or preformatted text), with the file and
line of every bad row.

Sources (`dataset_sources`): a `.jsonl`, `.json` (a list of records) or `.parquet` file; a local
Hugging Face `datasets` directory (`save_to_disk` output: `state.json` or `dataset_dict.json`
inside; of a DatasetDict the `train` split is read, or its only split); or a plain directory,
which stands for the supported files directly inside it (not its subdirectories), in name order.

Records are conversations (`{"conversations"|"messages": [...], "tools": [...]}`) or preformatted
`{"text"}` strings. Messages are `{"role", "content"}` (OpenAI style) or `{"from", "value"}`
(ShareGPT). Roles: system, user, assistant and tool; `human`/`gpt` are user/assistant,
`function`/`observation` are tool outputs, and ShareGPT's `function_call` is an assistant turn
whose value holds the call(s). An assistant turn may carry `reasoning_content` (also read from
`reasoning` or `thinking`) and `tool_calls` (`{"function": {"name", "arguments"}}` or flat
`{"name", "arguments"}`; arguments an object or a JSON string of one: they are stored as an
object, as chat templates expect) and `token_ids`, the ids the target generated for the turn
(launcher.regenerate writes them; render.py trains on them where they agree with the template);
a tool turn may carry `name` and `tool_call_id`. `tools` (a
list of function schemas, or a JSON string of one) goes to the chat template with the record.
Keys that are null are absent: Arrow sources (parquet, `datasets`) fill missing struct fields
with null. Arrow also gives every struct of a column the same keys, so store tool schemas and
call arguments there as JSON strings.

A bad row (undecodable bytes, invalid JSON, a malformed record; tokenize adds conversations the
chat template cannot render) raises DataError naming the file and line, or under
on_bad_line="skip" is counted: stats["bad_lines_skipped"], per reason stats["skipped_<reason>"],
and stats["first_bad_line"] says where the first one was and why. A `.json` file that does not
parse cannot be read at all and fails under either policy.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")
DATASETS_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes: a Dataset, a DatasetDict
ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "function": "tool", "observation": "tool"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
# Why a row is bad: the stats key is skipped_<reason>, the message says the text.
BAD_LINE_REASONS = {"invalid_utf8": "invalid UTF-8", "invalid_json": "invalid JSON", "malformed": "malformed record",
                    "unrenderable": "the chat template cannot render the conversation"}


class DataError(ValueError):
    """A dataset or tokenizer problem the user must fix; the message says where."""


class BadRecord(ValueError):
    """One row that cannot be used; reason is a key of BAD_LINE_REASONS."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Record:
    """One normalised dataset entry: either a conversation or a preformatted text."""

    messages: tuple[dict, ...] | None = None  # {"role", "content"} and the optional keys of the docstring
    text: str | None = None
    tools: tuple[dict, ...] | None = None     # function schemas for apply_chat_template(tools=...)
    id: object = None                          # the row's "id", when it has one


# ------------------------------------------------------------------------- sources
def is_datasets_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in DATASETS_MARKERS)


def dataset_sources(paths) -> list[Path]:
    """The files and `datasets` directories that `paths` (a path, or a list of them) stand for."""
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise DataError("no dataset path given")
    sources = []
    for path in map(Path, entries):
        if is_datasets_dir(path):
            sources.append(path)
        elif path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES
                            and not p.name.startswith("."))
            if not inside:
                raise DataError(f"dataset directory {path} holds no {'/'.join(SUPPORTED_SUFFIXES)} file and is not "
                                f"a datasets save_to_disk directory (no {' or '.join(DATASETS_MARKERS)})")
            sources += inside
        elif not path.exists():
            raise DataError(f"dataset path not found: {path}")
        elif path.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise DataError(f"{path}: unsupported dataset format {path.suffix!r} (use {', '.join(SUPPORTED_SUFFIXES)}"
                            f" or a datasets save_to_disk directory)")
        else:
            sources.append(path)
    return sources


# ------------------------------------------------------------------------- normalising
def _present(obj, key: str):
    return obj.get(key) if isinstance(obj, dict) else None


def _json_value(value, what: str):
    """A JSON string decoded; anything else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as err:
        raise BadRecord(f"{what} is a string that is not valid JSON: {err}") from None


def normalise_record(obj) -> Record:
    """Map one raw JSON object to a Record; raises BadRecord (a ValueError) saying why if malformed."""
    if not isinstance(obj, dict):
        raise BadRecord(f"expected a JSON object, got {type(obj).__name__}")
    turns = obj["conversations"] if obj.get("conversations") is not None else obj.get("messages")
    if turns is None and obj.get("text") is not None:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise BadRecord('"text" must be a non-empty string')
        return Record(text=obj["text"], id=obj.get("id"))
    if not isinstance(turns, list) or not turns:
        raise BadRecord('expected a non-empty "conversations" (or "messages") list or a "text" string')
    messages = [_normalise_message(turn) for turn in turns]
    if isinstance(obj.get("system"), str) and obj["system"] and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": obj["system"]})  # ShareGPT's record-level system prompt
    tools = _json_value(obj.get("tools"), '"tools"')
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRecord(f'"tools" must be a list of function schemas (objects), got {type(tools).__name__}')
    return Record(messages=tuple(messages), tools=tuple(tools) if tools else None, id=obj.get("id"))


def _normalise_message(turn) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord(f"a message must be an object, got {type(turn).__name__}")
    sharegpt = turn.get("from") is not None
    raw_role, content = (turn["from"], turn.get("value")) if sharegpt else (turn.get("role"), turn.get("content"))
    if sharegpt and raw_role == "function_call":  # ShareGPT tool call: the value holds the call(s)
        calls = _json_value(content, "a function_call value")
        turn = {"tool_calls": calls if isinstance(calls, list) else [calls]}
        raw_role, content = "assistant", ""
    role = ROLE_ALIASES.get(raw_role, raw_role)
    if role not in ROLES:
        raise BadRecord(f"unknown role {raw_role!r} (expected one of {sorted(ROLES + tuple(ROLE_ALIASES))})")
    message = {"role": role}
    reasoning = next((turn[key] for key in REASONING_KEYS if turn.get(key) is not None), None)
    tool_calls = turn.get("tool_calls") or None
    if (reasoning is not None or tool_calls is not None) and role != "assistant":
        raise BadRecord(f"a {role} message cannot carry reasoning or tool_calls (only assistant turns do)")
    if content is None and role == "assistant" and (reasoning is not None or tool_calls is not None):
        content = ""
    message["content"] = _text_content(content)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise BadRecord(f"reasoning_content must be a string, got {type(reasoning).__name__}")
        message["reasoning_content"] = reasoning
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise BadRecord(f"tool_calls must be a list, got {type(tool_calls).__name__}")
        message["tool_calls"] = [_normalise_tool_call(call) for call in tool_calls]
    token_ids = turn.get("token_ids")
    if token_ids is not None:
        if role != "assistant" or not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids):
            raise BadRecord("token_ids must be a list of non-negative integers, on an assistant turn")
        message["token_ids"] = token_ids
    for key in ("name", "tool_call_id"):
        if turn.get(key) is not None:
            if not isinstance(turn[key], str):
                raise BadRecord(f"message {key} must be a string, got {type(turn[key]).__name__}")
            message[key] = turn[key]
    return message


def _text_content(content) -> str:
    """A message's text: a string, or a list of text parts (OpenAI style) joined."""
    if isinstance(content, list):
        kinds = {_present(part, "type") for part in content} - {"text"}
        if kinds:
            raise BadRecord(f"only text content parts are supported, got {sorted(map(str, kinds))}")
        content = "".join(str(part.get("text") or "") for part in content)
    if not isinstance(content, str):
        raise BadRecord(f"message content must be a string, got {type(content).__name__}")
    return content


def _normalise_tool_call(call) -> dict:
    function = _present(call, "function") or call
    name = _present(function, "name")
    if not isinstance(name, str) or not name:
        raise BadRecord(f"a tool call needs a function name, got {call!r}")
    arguments = _json_value(function.get("arguments"), f"the arguments of tool call {name!r}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise BadRecord(f"the arguments of tool call {name!r} must be an object, got {type(arguments).__name__}")
    normalised = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call.get("id"), str):
        normalised["id"] = call["id"]
    return normalised


# ------------------------------------------------------------------------- reading
def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _parse_jsonl_line(raw: bytes, line_no: int):
    try:
        text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM may open the file
    except UnicodeDecodeError as err:
        raise BadRecord(f"byte {err.start} of the line ({raw[err.start:err.start + 1]!r})", "invalid_utf8") from None
    try:
        return json.loads(text)
    except ValueError as err:
        raise BadRecord(str(err), "invalid_json") from None


def _json_list_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """The records of a .json list, each located by the line it starts on. A file that does not
    parse cannot be read at all: DataError whatever the on_bad_line policy."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        where = f"{path} line {_line_of(data, err.start)}"
        raise DataError(f"{where}: invalid UTF-8 (a .json file is read whole)") from None
    decoder = json.JSONDecoder()

    def line_at(position: int) -> str:
        return f"line {text.count(chr(10), 0, position) + 1}"

    def skip_space(position: int) -> int:
        while position < len(text) and text[position] in " \t\r\n":
            position += 1
        return position

    position = skip_space(0)
    if not text.startswith("[", position):
        raise DataError(f"{path}: a .json dataset must hold a list of records")
    position = skip_space(position + 1)
    while not text.startswith("]", position):
        try:
            row, end = decoder.raw_decode(text, position)
        except ValueError as err:
            raise DataError(f"{path} {line_at(position)}: invalid JSON (a .json file is read whole): {err}") from None
        yield line_at(position), lambda row=row: row
        position = skip_space(end)
        if text.startswith(",", position):
            position = skip_space(position + 1)
        elif not text.startswith("]", position):
            raise DataError(f"{path} {line_at(position)}: expected ',' or ']' in the list of records")


def _arrow_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    prefix = ""
    if path.is_dir():
        try:
            import datasets
        except ImportError as err:
            raise DataError(f"{path}: reading a datasets directory needs the `datasets` library "
                            f"(pip install datasets)") from err
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as err:  # e.g. a folder of files that happens to hold a state.json
            raise DataError(f"{path}: not a readable datasets save_to_disk directory: {err}") from err
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            split = "train" if "train" in splits else (splits[0] if len(splits) == 1 else None)
            if split is None:
                raise DataError(f"{path}: a DatasetDict with splits {splits} and no 'train' split; "
                                f"name one split's directory, e.g. {path / splits[0]}")
            loaded, prefix = loaded[split], f"split {split} "
        rows = iter(loaded)
    else:
        import pyarrow.parquet as pq
        rows = (row for batch in pq.ParquetFile(path).iter_batches() for row in batch.to_pylist())
    for index, row in enumerate(rows, start=1):
        yield f"{prefix}row {index}", lambda row=row: row


def jsonl_rows(lines, first_line_no: int = 1) -> Iterator[tuple[str, Callable[[], object]]]:
    """(location, parse) per non-blank line of a .jsonl file (or of a stretch of it starting at line
    first_line_no), each line as bytes."""
    for line_no, raw in enumerate(lines, start=first_line_no):
        if raw.strip():
            yield f"line {line_no}", lambda raw=raw, line_no=line_no: _parse_jsonl_line(raw, line_no)


def _raw_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """Yield (location, parse) per row. Parsing is deferred so that an unparsable row goes
    through the same skip-or-fail path as a well-formed but invalid record."""
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".parquet":
        yield from _arrow_rows(path)
    elif suffix == ".jsonl":
        with open(path, "rb") as f:  # bytes: one undecodable line is one bad line, not a dead file
            yield from jsonl_rows(f)
    elif suffix == ".json":
        yield from _json_list_rows(path)
    else:
        raise DataError(f"{path}: unsupported dataset format {suffix!r} (use {', '.join(SUPPORTED_SUFFIXES)})")


def count_bad_line(where: str, reason: str, err: Exception, *, on_bad_line: str, stats: dict) -> None:
    """Fail with DataError naming where and why, or (on_bad_line="skip") count the row as skipped."""
    message = f"{where}: {BAD_LINE_REASONS[reason]}: {err}"
    if on_bad_line == "fail":
        raise DataError(message) from err
    stats["bad_lines_skipped"] = stats.get("bad_lines_skipped", 0) + 1
    stats[f"skipped_{reason}"] = stats.get(f"skipped_{reason}", 0) + 1
    stats.setdefault("first_bad_line", message)


def check_on_bad_line(on_bad_line: str) -> None:
    if on_bad_line not in ("fail", "skip"):
        raise ValueError(f'on_bad_line must be "fail" or "skip", got {on_bad_line!r}')


def read_records(path, *, on_bad_line: str = "fail", stats: dict | None = None) -> Iterator[tuple[str, Record]]:
    """(location, record) for each row of one source (see dataset_sources), location being e.g.
    "line 7". A bad row raises DataError naming the file and line, or with on_bad_line="skip"
    is counted in stats (see the module docstring)."""
    check_on_bad_line(on_bad_line)
    path = Path(path)
    if not (path.is_file() or is_datasets_dir(path)):
        raise DataError(f"dataset file not found: {path}")
    return records_from_rows(path, _raw_rows(path), on_bad_line=on_bad_line,
                             stats=stats if stats is not None else {})


def records_from_rows(path, rows, *, on_bad_line: str, stats: dict) -> Iterator[tuple[str, Record]]:
    """read_records' (location, record) from (location, parse) rows of the source at `path`."""
    for location, parse in rows:
        stats["read"] = stats.get("read", 0) + 1
        try:
            record = normalise_record(parse())
        except BadRecord as err:
            count_bad_line(f"{path} {location}", err.reason, err, on_bad_line=on_bad_line, stats=stats)
            continue
        yield location, record


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, or of a directory's files (names and bytes): cache keys and
    resume fingerprints."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


_FINGERPRINTS: dict[tuple, str] = {}


def file_fingerprint(path: Path) -> str:
    """`<bytes>:<sha256>` of a source's content (file_digest), hashed once per process for as long
    as its files' sizes and modification times stay the same."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [f.stat() for f in files]
    key = (str(path.resolve()), tuple((str(f), s.st_size, s.st_mtime_ns, s.st_ino) for f, s in zip(files, stats)))
    if key not in _FINGERPRINTS:
        _FINGERPRINTS[key] = f"{sum(s.st_size for s in stats)}:{file_digest(path)}"
    return _FINGERPRINTS[key]
