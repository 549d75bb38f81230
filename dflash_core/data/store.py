"""Tokenised samples on disk: a flat token store every reader memory-maps, and views over stores.

One store holds one source's samples back to back, in a directory of flat files:
  ids.bin      int32 [tokens]     the token ids of every sample, concatenated
  mask.bin     uint8 [tokens]     their loss masks (0/1)
  offsets.bin  int64 [samples+1]  sample k is tokens [offsets[k], offsets[k+1])
  hashes.bin   uint64 [samples]   a hash of each sample's ids and mask (duplicate detection)
  meta.json    format, counts, the source's stats, the sha256 of offsets.bin and hashes.bin, and
               what the writer records of the source (tokenize.py: its path, size and mtime)
Readers map the files read-only, so a rank's resident memory holds only the pages it touches
(the kernel shares them between the ranks of a node), not the dataset.

A store is written whole under a temporary name, fsynced, then renamed into place: a reader sees
no store or a complete one. Opening checks the sizes against meta.json and the checksums of the
small index files; a store that fails (torn, truncated, foreign) is reported as unusable and the
caller rebuilds it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..files.durable import fsync_path
from .records import file_digest

STORE_FORMAT = "dflash-token-store-v1"
_FILES = {"ids": ("ids.bin", np.int32), "mask": ("mask.bin", np.uint8), "offsets": ("offsets.bin", np.int64),
          "hashes": ("hashes.bin", np.uint64)}
_CHECKSUMMED = ("offsets", "hashes")  # the index: small, read whole on open anyway


class StoreError(ValueError):
    """A store on disk that cannot be used (torn, truncated, another format); the message says why."""


@dataclass
class Chunk:
    """Tokenised samples of consecutive records, as flat arrays (what a tokenising worker returns)."""
    ids: np.ndarray       # int32 [tokens]
    mask: np.ndarray      # uint8 [tokens]
    lengths: np.ndarray   # int64 [samples]
    hashes: np.ndarray    # uint64 [samples]


def sample_hash(ids: np.ndarray, mask: np.ndarray) -> int:
    """64 bits of blake2b over a sample's ids and mask: equal samples, equal hashes."""
    digest = hashlib.blake2b(ids.tobytes(), digest_size=8)
    digest.update(mask.tobytes())
    return int.from_bytes(digest.digest(), "little")


class TokenStore:
    """One source's samples: flat ids and masks, an offsets index and per-sample hashes."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray, hashes: np.ndarray, stats: dict):
        self.ids, self.mask, self.offsets, self.hashes, self.stats = ids, mask, offsets, hashes, stats

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, k: int) -> dict:
        start, end = int(self.offsets[k]), int(self.offsets[k + 1])
        return {"input_ids": torch.from_numpy(self.ids[start:end].astype(np.int64)),
                "loss_mask": torch.from_numpy(self.mask[start:end].astype(np.int64))}

    @classmethod
    def from_chunks(cls, chunks: list[Chunk], stats: dict) -> TokenStore:
        """An in-memory store (no cache dir)."""
        def flat(name: str, dtype) -> np.ndarray:
            return np.concatenate([np.zeros(0, dtype)] + [getattr(c, name) for c in chunks])
        offsets = np.concatenate([[0], np.cumsum(flat("lengths", np.int64))]).astype(np.int64)
        return cls(flat("ids", np.int32), flat("mask", np.uint8), offsets, flat("hashes", np.uint64), stats)


def write_store(directory: Path, chunks: Iterable[Chunk], stats_of, source: dict | None = None) -> None:
    """Stream `chunks` into a store at `directory`, atomically; `stats_of()` gives the source's stats
    once the chunks are exhausted; `source`, what the caller records of where they came from. An
    existing store there is replaced."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        files = {name: open(tmp / file, "wb") for name, (file, _) in _FILES.items()}
        samples = tokens = 0
        try:
            files["offsets"].write(np.zeros(1, np.int64).tobytes())
            for chunk in chunks:
                files["ids"].write(np.ascontiguousarray(chunk.ids, np.int32).tobytes())
                files["mask"].write(np.ascontiguousarray(chunk.mask, np.uint8).tobytes())
                files["offsets"].write((tokens + np.cumsum(chunk.lengths, dtype=np.int64)).tobytes())
                files["hashes"].write(np.ascontiguousarray(chunk.hashes, np.uint64).tobytes())
                samples, tokens = samples + len(chunk.lengths), tokens + int(chunk.lengths.sum())
        finally:
            for f in files.values():
                f.close()
        meta = {"format": STORE_FORMAT, "samples": samples, "tokens": tokens, "stats": stats_of(),
                "sha256": {name: file_digest(tmp / _FILES[name][0]) for name in _CHECKSUMMED}, "source": source}
        (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))
        for file in tmp.iterdir():
            fsync_path(file)
        fsync_path(tmp)
        _replace_dir(tmp, directory)
        fsync_path(directory.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(tmp: Path, directory: Path) -> None:
    """Rename tmp to directory; an unusable store already there is moved aside first (a directory
    cannot be renamed over a non-empty one)."""
    if directory.exists():
        aside = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:8]}.old")
        try:
            os.rename(directory, aside)
        except FileNotFoundError:   # another writer moved it meanwhile
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, directory)
    except OSError:                  # another writer put a complete store there first: keep that one
        if not (directory / "meta.json").is_file():
            raise


def _map(file: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(count,))


def open_store(directory: Path) -> TokenStore:
    """The store at `directory`, memory-mapped read-only; StoreError saying why when it is unusable."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise StoreError(f"meta.json unreadable ({type(err).__name__}: {err})") from None
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        raise StoreError(f"not a {STORE_FORMAT} store")
    counts = {"ids": meta["tokens"], "mask": meta["tokens"], "offsets": meta["samples"] + 1,
              "hashes": meta["samples"]}
    for name, (file, dtype) in _FILES.items():
        expected = counts[name] * np.dtype(dtype).itemsize
        size = (directory / file).stat().st_size if (directory / file).is_file() else -1
        if size != expected:
            raise StoreError(f"{file} holds {size} bytes where meta.json says {expected}")
    for name in _CHECKSUMMED:
        if file_digest(directory / _FILES[name][0]) != meta["sha256"][name]:
            raise StoreError(f"{_FILES[name][0]} does not match its checksum")
    offsets = np.fromfile(directory / _FILES["offsets"][0], dtype=np.int64)
    if offsets[0] != 0 or offsets[-1] != meta["tokens"] or bool((np.diff(offsets) < 0).any()):
        raise StoreError("offsets.bin is not an index of ids.bin")
    mapped = {name: _map(directory / file, dtype, counts[name]) for name, (file, dtype) in _FILES.items()
              if name != "offsets"}
    return TokenStore(mapped["ids"], mapped["mask"], offsets, np.asarray(mapped["hashes"]), meta["stats"])


class Samples(Sequence):
    """Samples of several stores as one sequence, optionally a subset (in a given order) of them.
    Item k is a dict of `input_ids` and `loss_mask` LongTensors, read from the stores on demand."""

    def __init__(self, stores: list[TokenStore], index: np.ndarray | None = None):
        self.stores = stores
        self._starts = np.cumsum([0] + [len(s) for s in stores]).astype(np.int64)
        self.index = np.arange(self._starts[-1], dtype=np.int64) if index is None else np.asarray(index, np.int64)
        all_lengths = np.concatenate([np.zeros(0, np.int64)] + [s.lengths for s in stores])
        self.lengths = all_lengths[self.index]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        position = int(self.index[k])
        which = int(np.searchsorted(self._starts, position, side="right")) - 1
        return self.stores[which].sample(position - int(self._starts[which]))

    def subset(self, ks) -> Samples:
        """The samples at positions `ks` of this sequence, in that order."""
        return Samples(self.stores, self.index[np.asarray(ks, dtype=np.int64)])

    def hashes(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.uint64)] + [np.asarray(s.hashes) for s in self.stores])[self.index]

    def without_duplicates(self) -> tuple[Samples, np.ndarray]:
        """The first occurrence of each distinct sample (same ids and mask), in order; and the
        positions of the later copies left out."""
        _, first = np.unique(self.hashes(), return_index=True)
        keep = np.zeros(len(self), bool)
        keep[first] = True
        return self.subset(np.flatnonzero(keep)), np.flatnonzero(~keep)
