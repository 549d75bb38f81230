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
import logging
import time
import warnings
from pathlib import Path

from .parallel import tokenize_source
from .records import BAD_LINE_REASONS, DataError, check_on_bad_line, dataset_sources, file_digest
from .render import tokenizer_name
from .store import Samples, StoreError, TokenStore, open_store, write_store

log = logging.getLogger("dflash")
# Bump when the tokenisation rules change, so stale caches are never reused.
CACHE_FORMAT = "dflash-data-v4"   # v4: assistant turns train on their generated token_ids
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


# ------------------------------------------------------------------------- caching
def _tokenizer_fingerprint(tokenizer) -> str:
    state = tokenizer.backend_tokenizer.to_str() + "\0" + str(tokenizer.chat_template)
    return hashlib.sha256(state.encode()).hexdigest()


def _cache_key(path: Path, tokenizer, settings: dict) -> str:
    parts = [CACHE_FORMAT, file_digest(path), _tokenizer_fingerprint(tokenizer), json.dumps(settings, sort_keys=True)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _source_record(path: Path, tokenizer, settings: dict) -> dict:
    """What a store's meta.json records of its source, to tell later that the file changed: its
    resolved path, size and modification time, and a digest of everything else the key holds."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stats = [f.stat() for f in files]
    rest = [CACHE_FORMAT, _tokenizer_fingerprint(tokenizer), json.dumps(settings, sort_keys=True)]
    return {"path": str(path.resolve()), "bytes": sum(st.st_size for st in stats),
            "modified": max((st.st_mtime for st in stats), default=0.0),
            "tokenizer_and_settings": hashlib.sha256("\n".join(rest).encode()).hexdigest()[:32]}


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _report_stale(source: dict, cache_dir: Path) -> None:
    """Say so when a store of the same file with the same tokenizer and settings is under cache_dir:
    the file changed since that store was prepared, so it is tokenised again."""
    prepared = []
    for meta in cache_dir.glob("*/meta.json"):
        try:
            earlier = json.loads(meta.read_text()).get("source") or {}
        except (OSError, ValueError, AttributeError):
            continue   # a foreign or torn store: _open_cached speaks of those it meets
        if all(earlier.get(key) == source[key] for key in ("path", "tokenizer_and_settings")):
            prepared.append(earlier)
    if prepared:
        last = max(prepared, key=lambda earlier: earlier.get("modified", 0.0))
        log.info("the prepared token store of %s is stale: the file changed since it was prepared (%s bytes, "
                 "modified %s; now %s bytes, modified %s); tokenising it again", source["path"], last.get("bytes"),
                 _when(last.get("modified", 0.0)), source["bytes"], _when(source["modified"]))


def _open_cached(directory: Path) -> TokenStore | None:
    """The cached store, or None (with a warning when one is there but unusable: it is rebuilt)."""
    if not directory.exists():
        return None
    try:
        return open_store(directory)
    except (StoreError, OSError, KeyError, TypeError) as err:  # torn, truncated or foreign: rebuilt, never used
        warnings.warn(f"tokenised store {directory} is unusable ({err}); rebuilding it", stacklevel=3)
        return None


def _source_store(path: Path, tokenizer, settings: dict, cache_dir, num_proc: int, progress) -> TokenStore:
    """One source's samples: from its cached store, or tokenised (and cached when cache_dir is set)."""
    directory = Path(cache_dir) / _cache_key(path, tokenizer, settings) if cache_dir else None
    store = _open_cached(directory) if directory is not None else None
    if store is not None:
        log.info("reusing the prepared token store of %s (%s)", path, directory)
        return store
    if directory is not None:
        source = _source_record(path, tokenizer, settings)
        _report_stale(source, directory.parent)
    chunks, stats = tokenize_source(path, tokenizer, settings, num_proc=num_proc, progress=progress)
    if directory is None:
        return TokenStore.from_chunks(list(chunks), stats())
    write_store(directory, chunks, stats, source=source)
    return open_store(directory)


def _add_stats(totals: dict, stats: dict) -> None:
    for key, value in stats.items():
        totals[key] = totals.get(key, 0) + value if isinstance(value, int) else totals.get(key, value)


# ------------------------------------------------------------------------- public loader
def load_samples(paths, tokenizer, *, max_length: int, last_turn_only: bool = False, on_bad_line: str = "fail",
                 cache_dir=None, chat_template_kwargs: dict | None = None, drop_duplicates: bool = False,
                 num_proc: int = 1, progress=None) -> tuple[Samples, dict]:
    """Tokenise local chat datasets into training samples.

    paths: a path or a list of them, each a file, a datasets directory or a directory of files
    (records.dataset_sources). chat_template_kwargs go to every apply_chat_template call (e.g.
    {"enable_thinking": False}). num_proc: processes that render and tokenise a large source
    (parallel.py); progress(done, total) is called as records are tokenised (total None when unknown).
    Returns (samples, stats): samples is a sequence (store.Samples) whose items are dicts of
    `input_ids` and `loss_mask` LongTensors [S_i], with `lengths` an array of their lengths;
    stats counts read, kept, dropped_no_pair, bad_lines_skipped (and per reason skipped_<reason>),
    truncated, tokens and supervised_tokens over all sources, plus first_bad_line (where and why)
    when a line was skipped; read == kept + dropped_no_pair + dropped_duplicate + bad_lines_skipped.
    drop_duplicates keeps only the first of samples with equal ids and masks (in any sources),
    counted in dropped_duplicate. Each source's result is a token store (store.py) cached under
    cache_dir, keyed by its bytes, the tokenizer and the settings; readers memory-map it.
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
    stores, totals = [], {}
    for path in sources:
        stores.append(_source_store(path, tokenizer, settings, cache_dir, num_proc, progress))
        _add_stats(totals, stores[-1].stats)
    samples = Samples(stores)
    if drop_duplicates:   # the counts of the copies left out are taken off (they are few: no pass over the rest)
        kept, dropped = samples.without_duplicates()
        totals["dropped_duplicate"] = len(dropped)
        totals["kept"] -= len(dropped)
        totals["tokens"] -= int(samples.lengths[dropped].sum())
        totals["supervised_tokens"] -= sum(int(samples[int(k)]["loss_mask"].sum()) for k in dropped)
        samples = kept
    if not len(samples):
        raise DataError(f"no usable samples in {[str(p) for p in sources]} after filtering: {totals}")
    return samples, totals


# ------------------------------------------------------------------------- reporting
def describe_drops(stats: dict, truncated_to: str = "max_length") -> str:
    """One line: how many records were kept, how many dropped and why, how many were truncated (to
    `truncated_to`: the caller may name its setting)."""
    dropped = stats.get("read", 0) - stats.get("kept", 0)
    reasons = [f"{stats[f'skipped_{reason}']} {text}" for reason, text in BAD_LINE_REASONS.items()
               if stats.get(f"skipped_{reason}")]
    if stats.get("dropped_no_pair"):
        reasons.append(f"{stats['dropped_no_pair']} with fewer than two supervised tokens")
    if stats.get("dropped_duplicate"):
        reasons.append(f"{stats['dropped_duplicate']} duplicates of an earlier record")
    line = f"kept {stats.get('kept', 0)} of {stats.get('read', 0)} records, dropped {dropped}"
    line += f" ({', '.join(reasons)})" if reasons else ""
    if stats.get("truncated"):
        line += f"; {stats['truncated']} truncated to {truncated_to}"
    if stats.get("first_bad_line"):
        line += f"; first skipped line: {stats['first_bad_line']}"
    return line


def drop_warning(stats: dict, *, threshold: float = 0.5, truncated_to: str = "max_length") -> str | None:
    """A loud warning when more than `threshold` of the records read were dropped, else None."""
    read = stats.get("read", 0)
    if not read or (read - stats.get("kept", 0)) / read <= threshold:
        return None
    return f"WARNING: most of the dataset was dropped: {describe_drops(stats, truncated_to)}"
