"""Every model, config and checkpoint file is read through here: a target's or an export's
config.json and safetensors, a checkpoint's JSON files and torch.distributed.checkpoint (DCP) shards
(and the single state.pt of earlier versions). None of them is opened in a way that runs code: a torch
file is unpickled with `weights_only=True` (tensors and plain containers of numbers and strings only),
and a DCP checkpoint's `.metadata` (a plain pickle, which torch's own reader opens with `pickle.load`)
with an unpickler that knows only DCP's metadata records, sizes, dtypes and paths; so one that asks for
anything else is an UnsafeFileError and nothing in it runs (a state file is untrusted input:
checkpoints are copied between machines and teams). A file that is there but cannot
be used (cut short by an interrupted copy or write, corrupt, or not what it should be) is a
BadFileError naming the file, its size and what is wrong with it; the libraries' own errors
(`SafetensorError: invalid header length`, `PytorchStreamReader failed`, a JSONDecodeError) name
neither. A missing file stays a FileNotFoundError (it names the path), so callers can tell "gone"
from "broken".
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta


class BadFileError(ValueError):
    """A file that exists but cannot be used; the message names it and says what is wrong."""


class UnsafeFileError(BadFileError):
    """A torch file whose pickle asks for code or objects beyond tensors and plain values: refused
    unopened, nothing in it run."""


def _size(path: Path) -> str:
    try:
        return f"{path.stat().st_size:,} bytes"
    except OSError:
        return "size unknown"


def bad_file(path, problem: str, hint: str = "") -> BadFileError:
    """The error for `path`: `problem` says what is wrong, `hint` what to do (default: the usual cause)."""
    path = Path(path)
    hint = hint or "truncated or corrupt: an interrupted copy, download or write; copy or write it again"
    return BadFileError(f"{path}: {problem} ({_size(path)}; {hint})")


def read_json(path) -> dict:
    """The JSON object in `path` (a config.json, a meta.json)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise bad_file(path, f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise bad_file(path, f"holds a JSON {type(data).__name__}, not an object",
                       "not the file it should be")
    return data


@contextlib.contextmanager
def open_safetensors(path):
    """safetensors' safe_open handle of `path` (its header is checked on opening, the tensors are
    read on demand)."""
    path = Path(path)
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise bad_file(path, f"not a readable safetensors file: {str(exc).removeprefix('Error while ')}") from None
    with handle as f:
        yield f


def load_safetensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file."""
    with open_safetensors(path) as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle is not a dict)


def tensor_files(directory) -> dict[str, Path]:
    """{tensor name: safetensors file} of a checkpoint directory, single-file or sharded."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise bad_file(index, "has no weight_map (tensor name -> shard file)")
        return {name: directory / shard for name, shard in weight_map.items()}
    single = directory / "model.safetensors"
    if single.is_file():
        with open_safetensors(single) as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"{directory} has no model.safetensors or model.safetensors.index.json")


def read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    """One tensor of a checkpoint, from tensor_files()' map."""
    with open_safetensors(files[name]) as f:
        return f.get_tensor(name)


def tensor_shapes(files: dict[str, Path], names) -> dict[str, list[int]]:
    """The shapes of some of a checkpoint's tensors, from the files' headers (no tensor read)."""
    shapes = {}
    for name in names:
        with open_safetensors(files[name]) as f:
            shapes[name] = f.get_slice(name).get_shape()
    return shapes


def check_safetensors(path) -> None:
    """Open only the header of a safetensors file: catches a truncated or corrupt file (the header
    records the byte length of the tensor data) without reading any tensor."""
    with open_safetensors(path):
        pass


def _unsafe(path: Path, asked_for: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path}: refused: it holds code or objects a checkpoint must not hold ({asked_for}); it "
                           f"was not loaded and nothing in it ran ({_size(path)}; this project's checkpoints hold only "
                           f"tensors and plain values, so something else wrote or changed this file: use a checkpoint "
                           f"from a source you trust)")


def load_torch(path, **kwargs):
    """torch.load(path, weights_only=True, **kwargs): tensors and plain containers only, nothing in the file
    run; the file named in any failure but a missing or unreadable one."""
    path = Path(path)
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except pickle.UnpicklingError as exc:   # torch's weights-only unpickler refused what the pickle asks for
        raise _unsafe(path, _refused(exc)) from None
    except Exception as exc:  # noqa: BLE001 (torch.load raises RuntimeError, EOFError, OSError...)
        if path.stat().st_size == 0:
            raise bad_file(path, "an empty file, not a torch file") from None
        raise bad_file(path, f"not a readable torch file ({type(exc).__name__}: {_first_sentence(exc)})") from None


def _refused(exc: pickle.UnpicklingError) -> str:
    """What the pickle asked for, from torch's long message (which goes on about allow-listing it)."""
    named = re.search(r"GLOBAL (\S+)", str(exc))
    return f"its pickle asks for {named[1]}" if named else "its pickle asks for more than tensors and plain values"


def _first_sentence(exc: BaseException) -> str:
    """PytorchStreamReader's message goes on, on the same line, about miniz and where to report it."""
    text = str(exc).strip()
    return re.split(r"(?<=\w)\. ", text.splitlines()[0], maxsplit=1)[0] if text else ""


# What a DCP `.metadata` pickle names when torch writes it: its metadata records, torch.Size, dtypes (checked
# apart), the layout and memory-format encodings, and the checkpoint's path. Each is data: building one runs
# no code of the file's choosing.
_DCP_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING", "StorageMeta", "MetadataIndex")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")   # worded as torch's refusals (see _refused)


def read_dcp_metadata(path) -> Metadata:
    """A DCP checkpoint's `.metadata` (which tensors it holds, their chunks and where each chunk's bytes are),
    unpickled knowing only what torch writes there (_DCP_METADATA_GLOBALS)."""
    path = Path(path)
    with open(path, "rb") as file:
        try:
            metadata = _DcpMetadataUnpickler(file).load()
        except pickle.UnpicklingError as exc:
            if str(exc).startswith("GLOBAL "):
                raise _unsafe(path, _refused(exc)) from None
            raise bad_file(path, f"not a readable DCP metadata file ({_first_sentence(exc)})") from None
        except Exception as exc:  # noqa: BLE001 (a torn pickle raises EOFError, ValueError, KeyError, ...)
            raise bad_file(path, f"not a readable DCP metadata file ({type(exc).__name__}: {_first_sentence(exc)})")\
                from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise bad_file(path, f"holds a {type(metadata).__name__}, not DCP metadata", "not the file it should be")
    return metadata


class DcpReader(FileSystemReader):
    """torch.distributed.checkpoint's reader of a checkpoint directory, its `.metadata` read by
    read_dcp_metadata; the tensors it reads torch loads with weights_only=True, and a tensor file whose
    pickle asks for more is an UnsafeFileError naming the directory."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_dcp_metadata(Path(self.path) / ".metadata")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except pickle.UnpicklingError as exc:
            raise _unsafe(Path(self.path), _refused(exc)) from None
