"""Records -> tokenised chunks, in this process or spread over a pool of processes.

A source is cut into chunks of about CHUNK_RECORDS consecutive records; each chunk is read,
rendered and tokenised by one worker (ChunkTokenizer) and the chunks are taken back in order, so
the samples, their order and the statistics are the same whatever the number of processes. A
.jsonl file is dealt out as line-aligned byte ranges, which each worker reads and parses itself
(records.py: bad rows counted or refused there), so the main process only finds line ends; other
formats are read by the main process and dealt out as records. The pool
starts workers with `spawn` (a fork would copy the Rust tokenizer's thread pool and the caller's
threads); each worker reads the tokenizer once at start, unpickled from a file the pool's owner
wrote: handed over as an initializer argument, its megabytes would fill the pipe a spawned process
reads only after importing the caller's main module, so the workers would start one after another.
Small sources stay in-process: starting workers costs seconds.
"""
from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import pickle
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from .records import BAD_LINE_REASONS, Record, count_bad_line, jsonl_rows, read_records, records_from_rows
from .render import ChatRenderer, generated_ids, splice_generated_ids
from .store import Chunk, sample_hash

CHUNK_RECORDS = 256          # records per task: large enough to amortise pickling, small for an even spread
TOKENIZE_BATCH = 512         # texts per call into the Rust tokenizer (it batches in parallel)
PARALLEL_MIN_BYTES = 8 << 20  # smaller sources are tokenised in-process (a pool takes seconds to start)
IN_FLIGHT_PER_WORKER = 4     # chunks queued per worker: keeps workers busy, bounds memory


def new_stats() -> dict:
    return {"read": 0, "kept": 0, "dropped_no_pair": 0, "bad_lines_skipped": 0,
            **{f"skipped_{reason}": 0 for reason in BAD_LINE_REASONS}, "truncated": 0, "tokens": 0,
            "supervised_tokens": 0}


def loss_mask(offsets: np.ndarray, spans: list[tuple[int, int]] | None) -> np.ndarray:
    """uint8 1 on every token that overlaps a supervised character span; all ones when spans is None.

    offsets: int64 [T, 2] character spans of the tokens.
    """
    if spans is None:
        return np.ones(len(offsets), np.uint8)
    mask = np.zeros(len(offsets), bool)
    for start, end in spans:
        mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return mask.astype(np.uint8)


def _plain_encoder(tokenizer):
    """The fast tokenizer's Rust tokenizer, set as `tokenizer(texts, add_special_tokens=False)` sets
    it (no truncation, no padding, its special-token splitting), without the Python-side conversion
    of every encoding to lists."""
    from tokenizers import Tokenizer
    encoder = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    encoder.no_truncation()
    encoder.no_padding()
    encoder.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return encoder


class ChunkTokenizer:
    """Renders and tokenises chunks of records with one tokenizer and the loader's settings."""

    def __init__(self, tokenizer, settings: dict):
        self.tokenizer, self.settings, self._renderer = tokenizer, settings, None
        self._encoder = _plain_encoder(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self._encoder.decode(ids, skip_special_tokens=False)

    def _render(self, record: Record) -> tuple[str, list[tuple[int, int]] | None, list | None]:
        """(text, supervised spans or None for preformatted text, the spans' generated ids)."""
        if record.text is not None:
            return record.text, None, None
        if self._renderer is None:  # the template is checked only when a conversation needs it
            self._renderer = ChatRenderer(self.tokenizer, self.settings["chat_template_kwargs"])
        last_turn_only = self.settings["last_turn_only"]
        return (*self._renderer.conversation(record, last_turn_only), generated_ids(record, last_turn_only))

    def read_lines(self, path: str, start: int, end: int, first_line: int) -> tuple[Chunk, dict, tuple | None]:
        """`__call__` on the records of bytes [start, end) of a .jsonl file, which start at line
        first_line. Ordinals count from first_line, so they keep file order across ranges."""
        stats = {}
        with open(path, "rb") as f:
            f.seek(start)
            lines = f.read(end - start).split(b"\n")
        records = records_from_rows(path, jsonl_rows(lines[:-1] if lines[-1] == b"" else lines, first_line),
                                    on_bad_line=self.settings["on_bad_line"], stats=stats)
        items, read_bad = take_records(records, stats, first_line, limit=None)
        chunk, chunk_stats, render_bad = self(path, first_line, items)
        for key, value in chunk_stats.items():
            stats[key] = stats.get(key, 0) + value
        return chunk, stats, min(filter(None, (read_bad, render_bad)), default=None)

    def __call__(self, path: str, first: int, items: list[tuple[str, Record]]) -> tuple[Chunk, dict, tuple | None]:
        """(the chunk's samples, its stats, (ordinal, message) of its first skipped record or None);
        `first` is the ordinal of the chunk's first record in its source."""
        stats, rendered, first_bad = {}, [], None
        for ordinal, (location, record) in enumerate(items, start=first):
            try:
                rendered.append(self._render(record))
            except Exception as err:  # noqa: BLE001 - a template may fail in any way on one conversation: a bad line
                count_bad_line(f"{path} {location}", "unrenderable", err, on_bad_line=self.settings["on_bad_line"],
                               stats=stats)
                message = stats.pop("first_bad_line")  # the source's first is chosen when the chunks merge
                first_bad = first_bad or (ordinal, message)
        max_length = self.settings["max_length"]
        ids_out, mask_out, lengths, hashes = [], [], [], []
        for start in range(0, len(rendered), TOKENIZE_BATCH):
            batch = rendered[start:start + TOKENIZE_BATCH]
            for (text, spans, generated), encoding in zip(batch, self._encoder.encode_batch(
                    [text for text, _, _ in batch], add_special_tokens=False)):
                ids, offsets = np.asarray(encoding.ids, np.int32), encoding.offsets
                offsets = np.fromiter(itertools.chain.from_iterable(offsets), np.int64, 2 * len(offsets)).reshape(-1, 2)
                mask = loss_mask(offsets, spans)
                if generated and any(generated):
                    ids, mask, spliced, disagreeing = splice_generated_ids(text, spans, generated, ids, mask, offsets,
                                                                           self._decode)
                    stats["generated_id_turns"] = stats.get("generated_id_turns", 0) + spliced
                    stats["generated_ids_unused"] = stats.get("generated_ids_unused", 0) + disagreeing
                if len(ids) > max_length:
                    ids, mask = ids[:max_length], mask[:max_length]
                    stats["truncated"] = stats.get("truncated", 0) + 1
                if not bool((mask[:-1] & mask[1:]).any()):  # no anchor with a following label
                    stats["dropped_no_pair"] = stats.get("dropped_no_pair", 0) + 1
                    continue
                ids_out.append(ids)
                mask_out.append(mask)
                lengths.append(len(ids))
                hashes.append(sample_hash(ids, mask))
                stats["supervised_tokens"] = stats.get("supervised_tokens", 0) + int(mask.sum())
        stats["kept"], stats["tokens"] = len(lengths), int(sum(lengths))
        chunk = Chunk(np.concatenate([np.zeros(0, np.int32), *ids_out]), np.concatenate([np.zeros(0, np.uint8),
                                                                                         *mask_out]),
                      np.asarray(lengths, np.int64), np.asarray(hashes, np.uint64))
        return chunk, stats, first_bad


# ------------------------------------------------------------------------- the pool
_WORKER: ChunkTokenizer | None = None


def _start_worker(state_path: str) -> None:
    """Builds this worker's ChunkTokenizer from the (tokenizer, settings) pickled at state_path by the
    pool's owner, this process's parent."""
    global _WORKER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process, one core: the pool is the parallelism
    with open(state_path, "rb") as f:
        _WORKER = ChunkTokenizer(*pickle.load(f))


def _write_worker_state(directory: str, tokenizer, settings: dict) -> str:
    """The path of (tokenizer, settings) pickled into directory, for _start_worker."""
    path = os.path.join(directory, "worker_state.pkl")
    with open(path, "wb") as f:
        pickle.dump((tokenizer, settings), f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _run_in_worker(path: str, first: int, items: list) -> tuple[Chunk, dict, tuple | None]:
    return _WORKER(path, first, items)


def _read_lines_in_worker(path: str, start: int, end: int, first_line: int) -> tuple[Chunk, dict, tuple | None]:
    return _WORKER.read_lines(path, start, end, first_line)


def take_records(records, stats: dict, ordinal: int, limit: int | None) -> tuple[list, tuple | None]:
    """(up to `limit` (location, record) items, (ordinal key, message) of the first bad row read
    among them or None); a bad row just before the item at ordinal k gets the key k - 0.5, so it
    sorts between the records around it. Pops stats' first_bad_line."""
    items, first_bad = [], None
    for location, record in itertools.islice(records, limit):
        if "first_bad_line" in stats and first_bad is None:
            first_bad = (ordinal + len(items) - 0.5, stats["first_bad_line"])
        items.append((location, record))
    if "first_bad_line" in stats and first_bad is None:
        first_bad = (ordinal + len(items) - 0.5, stats["first_bad_line"])
    stats.pop("first_bad_line", None)
    return items, first_bad


def line_ranges(path: Path, lines_per_range: int) -> Iterator[tuple[int, int, int, int]]:
    """(start byte, end byte, first line number, lines) of consecutive stretches of a file, each
    lines_per_range lines (the last may be shorter), cut at line ends."""
    if not path.stat().st_size:   # mmap refuses an empty file
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start, line, size = 0, 1, len(data)
        while start < size:
            end, count = start, 0
            while count < lines_per_range and end < size:
                newline = data.find(b"\n", end)
                end = size if newline < 0 else newline + 1
                count += 1
            yield start, end, line, count
            start, line = end, line + count


def default_num_proc() -> int:
    """This node's cores available to this process."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _source_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _count_records(path: Path) -> int | None:
    """How many rows a .jsonl file has (non-empty lines), for the progress bar; None for other formats."""
    if path.suffix.lower() != ".jsonl":
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class _Progress:
    """A progress bar on stderr (conversations/s, ETA) for a large source, and the caller's callback.

    The bar starts with the first chunk, counting it as done before its clock starts: the seconds the
    pool takes to start and the first chunks take to come back are not tokenising speed, and a rate taken
    over them gave an ETA tens of times too long (issue 44). Its rate is the mean since then (tqdm's
    smoothing 0), steady while chunks come back in bursts of one per worker."""

    def __init__(self, path: Path, total: int | None, callback: Callable | None, show: bool):
        self.path, self.total, self.callback, self.done, self.show = path, total, callback, 0, show
        self.bar = None

    def advance(self, records: int) -> None:
        self.done += records
        if self.bar is not None:
            self.bar.update(records)
        elif self.show:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, initial=self.done, unit=" conversations",
                            desc=f"tokenising {self.path.name}", file=sys.stderr, mininterval=2.0, smoothing=0,
                            dynamic_ncols=True)
        if self.callback is not None:
            self.callback(self.done, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tokenize_source(path: Path, tokenizer, settings: dict, *, num_proc: int = 1,
                    progress: Callable[[int, int | None], None] | None = None
                    ) -> tuple[Iterator[Chunk], Callable[[], dict]]:
    """(the source's chunks of samples in record order, a function giving its stats once the chunks
    are exhausted). num_proc > 1 spreads a large source over that many processes."""
    stats = new_stats()
    large = _source_size(path) >= PARALLEL_MIN_BYTES
    workers = max(1, num_proc) if large else 1
    by_lines = workers > 1 and path.suffix.lower() == ".jsonl"
    ranges = list(line_ranges(path, CHUNK_RECORDS)) if by_lines else None
    total = sum(count for *_, count in ranges) if by_lines else (_count_records(path) if large else None)
    bar = _Progress(path, total, progress, show=large)
    first_bads: list[tuple[float, str]] = []

    def read_chunks() -> Iterator[tuple[int, list]]:
        records = read_records(path, on_bad_line=settings["on_bad_line"], stats=stats)
        ordinal = 0
        while True:
            items, read_bad = take_records(records, stats, ordinal, CHUNK_RECORDS)
            if read_bad is not None:
                first_bads.append(read_bad)
            if not items:
                return
            yield ordinal, items
            ordinal += len(items)

    def merge(chunk: Chunk, chunk_stats: dict, first_bad: tuple | None, records: int) -> Chunk:
        for key, value in chunk_stats.items():
            stats[key] = stats.get(key, 0) + value
        if first_bad is not None:
            first_bads.append(first_bad)
        bar.advance(records)
        return chunk

    def in_order(pool, tasks) -> Iterator[tuple]:
        """The results of fn(*args) for each (fn, args, records) task, in task order, with at most
        IN_FLIGHT_PER_WORKER tasks queued per worker."""
        pending: deque = deque()
        for fn, args, records in tasks:
            pending.append((pool.submit(fn, *args), records))
            while len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                future, count = pending.popleft()
                yield future.result(), count
        while pending:
            future, count = pending.popleft()
            yield future.result(), count

    def chunks() -> Iterator[Chunk]:
        try:
            if workers == 1:
                work = ChunkTokenizer(tokenizer, settings)
                for first, items in read_chunks():
                    yield merge(*work(str(path), first, items), len(items))
                return
            context = multiprocessing.get_context("spawn")
            with tempfile.TemporaryDirectory(prefix="dflash-tokenize-") as scratch, \
                    ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                        initargs=(_write_worker_state(scratch, tokenizer, settings),)) as pool:
                if by_lines:
                    tasks = ((_read_lines_in_worker, (str(path), start, end, line), lines)
                             for start, end, line, lines in ranges)
                    for (chunk, chunk_stats, first_bad), lines in in_order(pool, tasks):
                        yield merge(chunk, chunk_stats, first_bad, lines)  # the bar counts lines here
                else:
                    tasks = ((_run_in_worker, (str(path), first, items), len(items))
                             for first, items in read_chunks())
                    for result, records in in_order(pool, tasks):
                        yield merge(*result, records)
        finally:
            bar.close()

    def final_stats() -> dict:
        if first_bads:
            stats["first_bad_line"] = min(first_bads)[1]
        return dict(stats)

    return chunks(), final_stats
