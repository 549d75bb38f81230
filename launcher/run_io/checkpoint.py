"""Atomic, sharded checkpoints of one run lineage: every drafter rank writes its own shard of the state
in the background; the lead drafter publishes the checkpoint once every rank's write is done.

A checkpoint is a directory `step_XXXXXXXX/` holding
- torch.distributed.checkpoint (DCP) files: `__<r>_0.distcp` per drafter rank r (its `Piece`s: the elements
  of its shard of each weight's fp32 master and AdamW moments, each a flat tensor at its global offset)
  and `.metadata` (which ranks wrote which elements, and where their bytes are);
- `trainer.json`: the rest of the trainer's state (optimiser step count and hyper-parameters, learning-rate
  schedule, RNG states, tokens seen, the drafter's config and its weights' shapes);
- `meta.json`, written last: the step, the lineage and what the run was trained with (resume.record).
As flat tensors at global offsets, the state loads at any drafter count: each rank reads, for its new
shard, the overlapping parts of whatever ranks wrote them (DCP's resharding). Nothing is unpickled but
tensors (torch.load with weights_only) and `.metadata` (dflash_core/files/readers.read_dcp_metadata, which
knows only DCP's own records); the state.pt of earlier versions is still read, with weights_only.

A save (`Checkpointer.save`) copies each rank's pieces to host memory (on CUDA queued behind the step's
kernels, into pinned buffers kept for the run: the only part on the step's path) and writes them from a
background thread through a gloo group of the drafter ranks; the next save, or the end, waits for it.
Every rank writes into one temporary directory named by the lead's pid; DCP's last collective returns
once every rank's files are written and fsynced, and then the lead publishes: trainer.json, meta.json,
fsync, rename to `step_XXXXXXXX/`, then the `latest` pointer. A reader only ever trusts a directory that
holds `meta.json`, so a crash (any rank, SIGKILL) mid-save leaves the previous checkpoint as the latest
complete one; the next save removes what the dead writer left (the job's lock makes this job the only
writer). A *lineage* is one training history in a checkpoints dir (a fresh start and every resume after
it): its id is in `lineage.json` and in each checkpoint's `meta.json`. `latest` names what this lineage's
last complete save wrote; pruning removes only this lineage's older checkpoints, never the one just
written nor the one `latest` names. A failed write (a full disk) removes its temporary dir and leaves the
previous checkpoint and `latest` as they were.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dflash_core.files.durable import durable_file, fsync_path, temporary_sibling, write_atomic
from dflash_core.files.readers import (
    DcpReader,
    UnsafeFileError,
    bad_file,
    load_torch,
    read_dcp_metadata,
    read_json,
)

log = logging.getLogger("dflash")
_NAME = re.compile(r"^step_(\d{8})$")
# What a writer names a checkpoint, the pointer and the lineage record before the rename that publishes them
# (durable.temporary_sibling): .step_XXXXXXXX.<pid>.tmp, .latest.<pid>.tmp, .lineage.json.<pid>.tmp; and the
# names writers used before (.tmp_step_XXXXXXXX_<pid>, .latest_<pid>, .lineage.json_<pid>), which a run dir
# written by an older version may still hold.
_TEMPORARY = re.compile(r"^\.(?:(?:step_\d{8}|latest|lineage\.json)\.(\d+)\.tmp"
                        r"|(?:tmp_step_\d{8}|latest|lineage\.json)_(\d+))$")
LINEAGE_FILE = "lineage.json"
POINTER = "latest"
STATE_FILE = "trainer.json"
LEGACY_STATE = "state.pt"     # the one pickle per checkpoint of earlier versions (read, never written)
_DCP_METADATA = ".metadata"
# The tensors a checkpoint holds, per weight name: its fp32 master and its two AdamW moments.
KINDS = ("model", "exp_avg", "exp_avg_sq")
# DCP says so on every save or load without a process group, even one asked for with no_dist=True.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the path and the cause."""


def rng_state() -> dict:
    """This process's RNG states as JSON values (trainer.json)."""
    version, words, gauss = random.getstate()
    state = {"python": [version, list(words), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """From rng_state()'s values (or the tensors and tuples a state.pt of earlier versions holds)."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]])


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [offset, offset + tensor.numel()) of the flat tensor `key` of `numel` elements: the part of it
    one rank writes into a checkpoint, or reads from one."""
    key: str
    numel: int
    offset: int
    tensor: torch.Tensor   # 1-D

    @staticmethod
    def whole(key: str, tensor: torch.Tensor) -> Piece:
        flat = tensor.reshape(-1)
        return Piece(key, flat.numel(), 0, flat)


class _SavePieces(DefaultSavePlanner):
    """DCP's default save planner, the state being Pieces: each is written as the chunk at its offset of its
    key's [numel] tensor, so the checkpoint's metadata records every rank's chunk at its global place."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {piece.key: piece for piece in pieces}

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan([WriteItem(
            index=MetadataIndex(p.key, torch.Size([p.offset])), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([p.offset]), p.tensor.size()),
                                        properties=TensorProperties.create_from_tensor(p.tensor),
                                        size=torch.Size([p.numel])))
            for p in self._pieces.values()])
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[index.fqn].tensor


class _LoadPieces(DefaultLoadPlanner):
    """DCP's default load planner, the state being Pieces: each reads the parts of the saved chunks (any
    rank's) that overlap its elements."""

    def __init__(self, pieces: list[Piece]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {piece.key: piece for piece in pieces}

    def create_local_plan(self) -> LoadPlan:
        stored = self.metadata.state_dict_metadata
        missing = [key for key in self._pieces if key not in stored]
        if missing:
            raise KeyError(f"the checkpoint holds no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                           f"({len(missing)} tensors the drafter has are missing)")
        items = []
        for piece in self._pieces.values():
            saved = stored[piece.key]
            if tuple(saved.size) != (piece.numel,):
                raise ValueError(f"{piece.key} holds {tuple(saved.size)} elements in the checkpoint, the drafter "
                                 f"{piece.numel}")
            items += create_read_items_for_chunk_list(
                piece.key, saved, [ChunkStorageMetadata(torch.Size([piece.offset]), piece.tensor.size())])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[index.fqn].tensor


def _failure(exc: BaseException) -> BaseException:
    """What failed under a CheckpointException (DCP's report of every rank's failures): the lowest
    rank's exception, or `exc` itself."""
    if isinstance(exc, CheckpointException) and exc.failures:
        failed = exc.failures[min(exc.failures)]
        return failed[0] if isinstance(failed, tuple) else failed
    return exc


# ----------------------------------------------------------------------------------- lineage
def read_lineage(root: Path) -> dict | None:
    """{"id", "parent", "started"} of the lineage writing into `root`, or None."""
    path = Path(root) / LINEAGE_FILE
    return read_json(path) if path.is_file() else None


def start_lineage(root: Path, parent: str | None = None, **about) -> str:
    """A new lineage in `root`: a fresh run, or one continuing the checkpoint `parent` of another dir;
    `about` (e.g. which job started it) is recorded with it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lineage = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
    write_atomic(root / LINEAGE_FILE, json.dumps({"id": lineage, "parent": parent, "started": time.time(), **about}))
    return lineage


def _lineage_id(root: Path) -> str:
    record = read_lineage(root)
    return record["id"] if record else start_lineage(root)


def read_meta(path: Path) -> dict:
    return read_json(Path(path) / "meta.json")


def complete(root: Path) -> list[Path]:
    """Every complete checkpoint in `root`, whatever its lineage, by step."""
    root = Path(root)
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "meta.json").is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: p.name)


def _belongs(path: Path, lineage: str) -> bool:
    """A checkpoint from before lineages counts as the dir's; so does a torn meta.json (load() reports it)."""
    try:
        return read_meta(path).get("lineage", lineage) == lineage
    except (OSError, ValueError):
        return True


def _members(root: Path, lineage: str) -> list[Path]:
    """This lineage's complete checkpoints by step."""
    return [path for path in complete(root) if _belongs(path, lineage)]


def pointed(root: Path) -> Path | None:
    """The checkpoint `latest` names, when it exists."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


# ----------------------------------------------------------------------------------- writing
def _why(exc: BaseException) -> str:
    """The OS error under `exc` (torch.save and DCP wrap it), named by errno, or the exception itself."""
    failed = cause = _failure(exc)
    while cause is not None and not isinstance(cause, OSError):
        under = cause.__cause__ or cause.__context__
        cause = None if under is None else _failure(under)
    if cause is None:
        return f"{type(failed).__name__}: {failed}"
    name = errno.errorcode.get(cause.errno, "") if cause.errno else ""
    return f"{cause.strerror or cause} ({name})" if name else str(cause.strerror or cause)


def _check_ours(final: Path, lineage: str) -> None:
    if (final / "meta.json").is_file() and not _belongs(final, lineage):
        raise CheckpointWriteError(f"{final} belongs to another run (lineage {read_meta(final).get('lineage')}, "
                                   f"this run is {lineage}): not overwriting it")


class Checkpointer:
    """This process's part of a run's checkpoints: one per drafter rank, all created at the same point of
    the run (the first call is collective over `group`, a gloo group of the drafter ranks used for nothing
    else, since the writes run on it from a background thread; None: this process alone). The group's
    first rank publishes. `pieces` (optional): the state's layout, so that the host buffers are taken now
    rather than on the step of the first save."""

    def __init__(self, root: Path, keep: int, group: dist.ProcessGroup | None = None,
                 pieces: list[Piece] = ()):
        self.root, self.keep, self.group = Path(root), keep, group
        self.lead = group is None or dist.get_rank(group) == 0
        pid = [os.getpid()]   # the lead's names the temporary directory every rank writes into
        if group is not None and dist.get_world_size(group) > 1:
            dist.broadcast_object_list(pid, src=dist.get_global_rank(group, 0), group=group)
        self._pid = pid[0]
        self._buffers: dict[str, torch.Tensor] = {}
        for piece in pieces:
            self._buffer(piece)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None

    def _buffer(self, piece: Piece) -> torch.Tensor:
        """The host tensor `piece` is copied into, kept from save to save (pinned for a CUDA tensor, so the
        copy is queued, not waited for)."""
        buffer = self._buffers.get(piece.key)
        if buffer is None or buffer.shape != piece.tensor.shape or buffer.dtype != piece.tensor.dtype:
            buffer = torch.empty(piece.tensor.shape, dtype=piece.tensor.dtype, pin_memory=piece.tensor.is_cuda)
            self._buffers[piece.key] = buffer
        return buffer

    def save(self, step: int, pieces: list[Piece], state: dict, record: dict | None = None) -> None:
        """Start the checkpoint of `step` (the optimiser steps done; a run resumes at that step index):
        this rank's `pieces` and, from the lead, `state` (JSON values: trainer.json) and `record` (meta.json).
        Waits for the save before it first (its failure is raised here); returns once the pieces' copies
        are queued (CUDA) or made (CPU): the caller may change them right after."""
        self.wait()
        staged = []
        for piece in pieces:
            buffer = self._buffer(piece)
            buffer.copy_(piece.tensor, non_blocking=True)
            staged.append(dataclasses.replace(piece, tensor=buffer))
        copied = None
        if any(piece.tensor.is_cuda for piece in pieces):
            copied = torch.cuda.Event()
            copied.record()
        # As JSON now: the trainer goes on changing what `state` describes.
        text = json.dumps(state) if self.lead else ""
        self._pending = self._writer.submit(self._write, step, staged, copied, text, record or {})

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any, to be written by every rank and (on the lead) published:
        its path on the lead, else None. A failed save raises its CheckpointWriteError here."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def settle(self) -> None:
        """wait(), then meet every rank of the group (the lead has published by then): every checkpoint saved
        so far is on disk. Collective."""
        self.wait()
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)

    def close(self) -> Path | None:
        """wait(), then end the writer thread."""
        try:
            return self.wait()
        finally:
            self._writer.shutdown(wait=True)

    def _write(self, step: int, staged: list[Piece], copied, state: str, record: dict) -> Path | None:
        """The writer thread: this rank's files, then (the lead) the publication."""
        if copied is not None:
            copied.synchronize()
        final = self.root / f"step_{step:08d}"
        tmp = temporary_sibling(final, self._pid)
        try:
            if self.lead:
                self.root.mkdir(parents=True, exist_ok=True)
                _remove_stale_temporaries(self.root, self._pid)
            dcp.save({piece.key: piece.tensor for piece in staged}, storage_writer=FileSystemWriter(tmp),
                     planner=_SavePieces(staged), process_group=self.group, no_dist=self.group is None)
            if not self.lead:
                return None
            lineage = _publish(self.root, tmp, final, step, state, record)
        except BaseException as exc:  # noqa: BLE001 (DCP reports failures as a CheckpointException, a BaseException)
            if not self.lead:
                raise CheckpointWriteError(f"could not write this rank's part of checkpoint {final}: "
                                           f"{_why(exc)}") from exc
            shutil.rmtree(tmp, ignore_errors=True)
            previous = pointed(self.root)
            kept = f"latest still names {previous.name}" if previous else "there is no earlier checkpoint"
            raise CheckpointWriteError(f"could not write checkpoint {final}: {_why(exc)}; {kept} and no temporary "
                                       f"files were left (free space there: "
                                       f"{shutil.disk_usage(self.root).free / 2**30:.1f} GiB)") from exc
        log.info("checkpoint %s", final)
        _prune(self.root, lineage, self.keep, final)
        return final


def _publish(root: Path, tmp: Path, final: Path, step: int, state: str, record: dict) -> str:
    """Make the written directory `tmp` the checkpoint `final` and point `latest` at it -> the lineage."""
    lineage = _lineage_id(root)
    _check_ours(final, lineage)
    with durable_file(tmp / STATE_FILE, "w") as file:
        file.write(state)
    meta = {"step": step, "lineage": lineage, "saved": time.time(), **record}
    with durable_file(tmp / "meta.json", "w") as file:
        file.write(json.dumps(meta))
    fsync_path(tmp)
    if final.exists():   # this lineage re-saving a step (after falling back from a broken one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root)
    write_atomic(root / POINTER, final.name)
    return lineage


def save(root: Path, step: int, pieces: list[Piece], state: dict, keep: int, record: dict | None = None) -> Path:
    """The whole checkpoint of `step` written by this process alone (no process group), once published."""
    writer = Checkpointer(root, keep)
    writer.save(step, pieces, state, record)
    return writer.close()


def _remove_stale_temporaries(root: Path, writer: int) -> None:
    """Remove what a writer killed mid-write (SIGKILL, the OOM killer) left behind. The job holds
    run.dir/job.lock, so no other live job writes here, and within the job every temporary is named by
    the lead drafter's pid `writer`: a temporary of another pid is a dead writer's."""
    for entry in root.iterdir():
        match = _TEMPORARY.match(entry.name)
        pid = None if match is None else int(match.group(1) or match.group(2))
        if pid is None or pid == writer:
            continue
        log.warning("removing %s: a checkpoint writer (pid %d) died while writing it", entry, pid)
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _prune(root: Path, lineage: str, keep: int, written: Path) -> None:
    """Keep this lineage's `keep` newest checkpoints; never the one just written or `latest`'s."""
    protected = {written, pointed(root)}
    older = [p for p in _members(root, lineage) if p not in protected]
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------- reading
def load_latest(root: Path) -> tuple[Path, int] | None:
    """(path, step) of the checkpoint `latest` names, or when it is broken (warned) this lineage's newest one
    that checks out (`verify`). One holding code or objects a checkpoint must not is an UnsafeFileError,
    not passed over: no save of this project writes such a file, so someone else did, and the user decides
    what to resume from."""
    root = Path(root)
    record = read_lineage(root)
    lineage = record["id"] if record else None
    candidates = list(reversed(_members(root, lineage))) if lineage else list(reversed(complete(root)))
    first = pointed(root)
    if first is not None and first in candidates:
        candidates.remove(first)
        candidates.insert(0, first)
    for path in candidates:
        try:
            return path, verify(path)
        except UnsafeFileError:
            raise
        except Exception as exc:  # noqa: BLE001 (a torn or corrupt file, whatever the readers raise: fall back)
            log.warning("checkpoint %s is unreadable (%s: %s); trying the previous one", path, type(exc).__name__, exc)
    return None


def why_incomplete(path: Path) -> str:
    """Why `path` is not a complete checkpoint and what to do ("" when it is one), for an error message."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return ""
    pruned = _NAME.match(path.name) and complete(path.parent)
    if not path.exists():
        return (f"no such directory: {_pruned_by_its_job(path, 'it may have removed this one')}" if pruned
                else "no such directory; pass a run's checkpoints/step_XXXXXXXX directory")
    if pruned:  # saves appear whole (a rename): a step directory without its meta.json is one being removed
        return f"not a complete checkpoint (no meta.json): {_pruned_by_its_job(path, 'it is removing this one')}"
    return "not a complete checkpoint (no meta.json); pass a run's checkpoints/step_XXXXXXXX directory"


def _pruned_by_its_job(path: Path, what: str) -> str:
    newest = complete(path.parent)
    newest = f"; the newest complete one now is {newest[-1].name}" if newest else ""
    return (f"the job writing {path.parent} removes its older checkpoints as it saves new ones "
            f"(it keeps run.keep_checkpoints), and {what}{newest}")


class CheckpointGoneError(FileNotFoundError):
    """A checkpoint removed while it was read: its job pruned it."""


def _legacy(path: Path) -> bool:
    """A checkpoint of earlier versions: one state.pt, gathered and written by the lead drafter."""
    return (path / LEGACY_STATE).is_file() and not (path / _DCP_METADATA).exists()


@contextlib.contextmanager
def _reading(path: Path):
    """A FileNotFoundError while `path` is read is a CheckpointGoneError when the checkpoint went whole
    (meta.json too: its job pruned it)."""
    try:
        yield
    except FileNotFoundError as exc:
        if (path / "meta.json").is_file():
            raise   # one file alone is missing: not a removal in progress (that takes meta.json too)
        raise CheckpointGoneError(f"checkpoint {path} was removed while being read: "
                                  f"{_pruned_by_its_job(path, 'it removed this one')}") from exc


def _check_lengths(path: Path, metadata) -> None:
    """Every file the checkpoint's .metadata points into holds the bytes it says (a torn copy or write is
    caught here, without reading any tensor)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        held = (path / name).stat().st_size
        if held < size:
            raise bad_file(path / name, f"cut short: its checkpoint's {_DCP_METADATA} records {size:,} bytes in it")


def verify(path: Path) -> int:
    """The step of the complete checkpoint `path`, once its files check out without reading the tensors:
    one that disappears meanwhile (the running job's pruning) is a CheckpointGoneError, an unreadable or
    cut-short file a BadFileError naming it, one whose pickle asks for more than it may an UnsafeFileError
    (refused unopened)."""
    path = Path(path)
    with _reading(path):
        meta = read_meta(path)
        if _legacy(path):
            # mmap: checking a large checkpoint does not read it all; a torn zip still fails here.
            saved = load_torch(path / LEGACY_STATE, map_location="cpu", mmap=True).get("step")
        else:
            _check_lengths(path, read_dcp_metadata(path / _DCP_METADATA))
            saved = read_json(path / STATE_FILE).get("step")
    if saved != meta["step"]:
        raise ValueError(f"{path}: state step {saved} != meta step {meta['step']}")
    return meta["step"]


def read_state(path: Path) -> dict:
    """The trainer's state besides its tensors (trainer.json's values)."""
    path = Path(path)
    with _reading(path):
        if _legacy(path):
            return _legacy_state(path)[0]
        return read_json(path / STATE_FILE)


def read_pieces(path: Path, pieces: list[Piece], group: dist.ProcessGroup | None = None) -> None:
    """Fill `pieces` from the checkpoint `path`, whatever drafter count wrote it. Collective over `group`
    (the Checkpointer's; None: this process alone)."""
    path = Path(path)
    with _reading(path):
        if _legacy(path):
            log.warning("checkpoint %s is in the single-file format of earlier versions (state.pt): read whole, "
                        "with weights_only; this run's own checkpoints are sharded", path)
            tensors = _legacy_state(path)[1]
            for piece in pieces:
                whole = tensors[piece.key]
                piece.tensor.copy_(whole[piece.offset:piece.offset + piece.tensor.numel()])
            return
        try:
            dcp.load({piece.key: piece.tensor for piece in pieces}, storage_reader=DcpReader(path),
                     planner=_LoadPieces(pieces), process_group=group, no_dist=group is None)
        except CheckpointException as exc:   # a BaseException: the first failure (of any rank) is what to say
            raise _failure(exc) from None


def load_weights(path: Path) -> tuple[int, dict, dict[str, torch.Tensor]]:
    """(step, the drafter's config, its fp32 weights by name) of the checkpoint `path`, read by this process
    alone (launcher.export, launcher.evaluate)."""
    path = Path(path)
    step, state = verify(path), read_state(path)
    pieces = {name: Piece.whole(f"model.{name}", torch.empty(shape)) for name, shape in state["shapes"].items()}
    read_pieces(path, list(pieces.values()))
    return step, state["drafter_config"], {name: piece.tensor.view(state["shapes"][name])
                                           for name, piece in pieces.items()}


def _legacy_state(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A state.pt of earlier versions as (trainer.json's values, {key: flat tensor}): read with weights_only
    (its weights, torch AdamW's state by parameter index in the weights' order, scheduler, RNG states)."""
    old = load_torch(path / LEGACY_STATE, map_location="cpu", mmap=True)
    names = list(old["model"])
    tensors = {f"model.{name}": value.reshape(-1) for name, value in old["model"].items()}
    moments = old["optimizer"]["state"]
    for index, saved in moments.items():
        for kind in KINDS[1:]:
            tensors[f"{kind}.{names[index]}"] = saved[kind].reshape(-1)
    groups = [{key: value for key, value in group.items() if key != "params"}
              for group in old["optimizer"]["param_groups"]]
    steps = {float(saved["step"]) for saved in moments.values()} or {0.0}
    state = {"step": old["step"], "optimizer": {"step": steps.pop(), "param_groups": groups},
             "scheduler": old["scheduler"], "rng": old["rng"], "drafter_config": old["drafter_config"],
             "tokens_seen": old.get("tokens_seen", 0),
             "shapes": {name: list(value.shape) for name, value in old["model"].items()}}
    return state, tensors
