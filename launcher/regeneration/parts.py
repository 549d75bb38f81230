"""What every regeneration engine shares: the prompts of the input, the output's checks, and the
part files answers are appended to as they finish (a rerun with the same settings answers only
what is missing), merged in input order into the output at the end.

A part file holds one JSON line per finished prompt: {"index": position among the input's
prompts, "record": the output record}. Output records: {"id", "conversations": [...turns...,
{"role": "assistant", "content", "token_ids"?, "reasoning_content"?, "tool_calls"?}], "tools"?}:
the input's turns with the regenerated assistant turn(s); `token_ids` are the ids the target
generated for the turn (without its stop token), which training uses in place of the text's
re-tokenisation where they agree with the template (dflash_core.data.render).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from itertools import islice
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash_core.data import file_digest
from dflash_core.data.prompts import Prompt, encode_prompts, iter_prompts
from dflash_core.files.durable import write_jsonl
from launcher.config import ConfigError
from launcher.resolve import dataset_paths

# Settings that change what gets generated: parts written under other values are not reused.
_FINGERPRINT_KEYS = ("engine", "input", "tokenizer", "drop_last_assistant", "limit", "max_prompt_length",
                     "max_new_tokens", "temperature", "top_p", "top_k", "seed", "chat_template_kwargs", "on_bad_line")
_HF_FINGERPRINT_KEYS = ("batch_size",)   # left padding of a batch moves greedy near-ties


# ----------------------------------------------------------------------------- prompts
def input_path(cfg: DictConfig) -> Path:
    paths = dataset_paths(cfg.regenerate.input, "regenerate.input")
    if len(paths) != 1:
        raise ConfigError(f"regenerate.input={cfg.regenerate.input!r}: names {len(paths)} files; "
                          f"regenerate one at a time")
    return paths[0]


def template_kwargs(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg.regenerate.chat_template_kwargs)


def load_prompts(cfg: DictConfig) -> tuple[list[Prompt], dict]:
    """Every answerable record of the input, in input order (identical on every rank, no tokenizing)."""
    r, stats = cfg.regenerate, {}
    prompts = list(islice(iter_prompts(input_path(cfg), drop_last_assistant=r.drop_last_assistant,
                                       on_bad_line=r.on_bad_line, stats=stats), r.limit))
    stats["prompts"] = len(prompts)
    return prompts, stats


def tokenize_prompts(cfg: DictConfig, tokenizer, prompts: list[Prompt]) -> tuple[list[Prompt], dict]:
    """Render and tokenise (only this rank's share); drops and counts prompts over max_prompt_length
    and, under on_bad_line=skip, conversations the template cannot render."""
    r, stats = cfg.regenerate, {}
    kept = encode_prompts(tokenizer, prompts, max_tokens=r.max_prompt_length,
                          chat_template_kwargs=template_kwargs(cfg), on_bad_line=r.on_bad_line, stats=stats)
    return kept, {"too_long": stats["too_long"], "unrenderable": stats.get("skipped_unrenderable", 0)}


_INPUT_SKIPS = {"bad_lines_skipped": "malformed", "no_conversation": "with no turns (preformatted text)",
                "no_prompt": "with nothing to answer"}   # dflash_core.data.prompts.iter_prompts' counts


def every_prompt_skipped(cfg: DictConfig, stats: dict, shares: list[dict]) -> ConfigError:
    """The error when no prompt is left to answer: how many were read, and why each was skipped."""
    r = cfg.regenerate
    too_long, unrenderable = (sum(share[key] for share in shares) for key in ("too_long", "unrenderable"))
    skipped = [f"{count} {why}" for count, why in (
        (too_long, f"longer than regenerate.max_prompt_length={r.max_prompt_length} tokens"),
        (unrenderable, "the chat template cannot render")) if count]
    without = [f"{stats[key]} {why}" for key, why in _INPUT_SKIPS.items() if stats.get(key)]
    read = f"{stats['prompts']} prompts read" + (f": {', '.join(skipped)}" if skipped else "")
    read += f"; records skipped: {', '.join(without)}" if without else ""
    remedy = "; raise regenerate.max_prompt_length" if too_long else ""
    return ConfigError(f"regenerate.input={r.input!r}: every prompt was skipped, none is left to answer ({read}); "
                       f"no output was written{remedy}")


def output_record(prompt: Prompt, conversation: list[dict]) -> dict:
    """The output record of a prompt whose conversation (its turns and the regenerated ones) is complete."""
    return {"id": prompt.id, "conversations": conversation, **({"tools": prompt.tools} if prompt.tools else {})}


# ----------------------------------------------------------------------------- output
def check_output(cfg: DictConfig) -> None:
    """Before any work: the output never replaces the input, and replaces an existing file only when
    regenerate.overwrite asks for it."""
    r = cfg.regenerate
    output, source = Path(r.output).resolve(), input_path(cfg).resolve()
    if output == source or (output.exists() and os.path.samefile(output, source)):
        raise ConfigError(f"regenerate.output={r.output!r} is the input file {str(source)!r}: the answers would "
                          f"replace the dataset they are read from; choose another output")
    if output.is_dir():
        raise ConfigError(f"regenerate.output={r.output!r} is a directory; give a .jsonl file path")
    if output.exists() and not r.overwrite:
        raise ConfigError(f"regenerate.output={r.output!r} already exists; set regenerate.overwrite=true to "
                          f"replace it, or choose another output")


def parts_dir(cfg: DictConfig) -> Path:
    output = Path(cfg.regenerate.output).resolve()
    return output.with_name(output.name + ".parts")


def part_file(parts: Path, rank: int) -> Path:
    return parts / f"rank{rank:05d}.jsonl"


# ----------------------------------------------------------------------------- part files
def _fingerprint(cfg: DictConfig, world: int) -> str:
    regenerate = OmegaConf.to_container(cfg.regenerate, resolve=True)
    keys = _FINGERPRINT_KEYS + (_HF_FINGERPRINT_KEYS if regenerate["engine"] == "hf" else ())
    state = json.dumps({"settings": {key: regenerate[key] for key in keys}, "input": file_digest(input_path(cfg)),
                        "target": str(Path(cfg.target.path).resolve()), "world": world}, sort_keys=True, default=str)
    return hashlib.sha256(state.encode()).hexdigest()[:16]


def prepare_parts(cfg: DictConfig, parts: Path, world: int) -> None:
    """Rank 0, before any rank writes: keep parts of an interrupted identical run, else start afresh."""
    start_parts(parts, _fingerprint(cfg, world), resume=cfg.regenerate.resume)


def start_parts(parts: Path, fingerprint: str, *, resume: bool) -> None:
    """The parts directory: kept when `resume` and it was written under the same `fingerprint` (the
    settings that change what gets generated), else emptied."""
    meta = parts / "meta.json"
    if parts.exists() and not (resume and meta.is_file()
                               and json.loads(meta.read_text()).get("fingerprint") == fingerprint):
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")


def open_share(cfg: DictConfig, tokenizer, share: list[Prompt], parts: Path, rank: int
               ) -> tuple[Path, dict[int, dict], list[Prompt], dict]:
    """A rank's share of the prompts: (its part file, the answers it already holds, the prompts still
    to answer, tokenised, and the drop counts of tokenize_prompts)."""
    part = part_file(parts, rank)
    done = read_part(part)
    todo, dropped = tokenize_prompts(cfg, tokenizer, [p for p in share if p.index not in done])
    return part, done, todo, dropped


def read_part(file: Path) -> dict[int, dict]:
    """index -> output record; a torn last line (a crash mid-write) is dropped and the file rewritten."""
    if not file.is_file():
        return {}
    done, lines = {}, file.read_text(encoding="utf-8").splitlines(keepends=True)
    for line in lines:
        try:
            entry = json.loads(line)
            done[entry["index"]] = entry["record"]
        except (ValueError, KeyError, TypeError):
            break
    if len(done) != len(lines):
        file.write_text("".join(lines[:len(done)]), encoding="utf-8")
    return done


class PartWriter:
    """Appends finished records to a part file, each on disk (fsync) before `write` returns, from
    any thread: whatever stops the run afterwards, a finished answer is not lost."""

    def __init__(self, file: Path):
        self._file = open(file, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, index: int, record: dict, *, sync: bool = True) -> None:
        line = json.dumps({"index": index, "record": record}, ensure_ascii=False) + "\n"
        with self._lock:
            self._file.write(line)
            if sync:
                self.sync()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def merge_parts(parts: Path, world: int, num_prompts: int, output: Path) -> int:
    """Rank 0: every answered prompt in input order, written atomically; returns the record count."""
    records: dict[int, dict] = {}
    for rank in range(world):
        records.update(read_part(part_file(parts, rank)))
    # an index absent: the answer came back empty
    return write_jsonl(output, (records[index] for index in range(num_prompts) if index in records))
