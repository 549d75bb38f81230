"""What every regeneration engine shares: the prompts of the input, the output's checks, and the
part files answers are appended to as they finish (a rerun with the same settings answers only
what is missing), merged in input order into the output at the end.

One run writes an output at a time: it holds `<output>.lock` (launcher/run_io/lock.py) from before
it looks at the output until after it published it, and a second run is refused naming the first.
The parts record what their answers depend on (the generating settings, the input's resolved path
and content digest, the target, the world size): a rerun with the same resumes them, one with other
settings is refused naming what differs (regenerate.resume=false discards them, saying how many).
They are removed only once the output is published, or when a run that ended early kept no answer in
them (saying_what_is_kept, which also says what a run stopped by a signal keeps and how to resume).

A part file holds one JSON line per finished prompt: {"index": position among the input's
prompts, "record": the output record}. Output records: {"id", "conversations": [...turns...,
{"role": "assistant", "content", "token_ids"?, "reasoning_content"?, "tool_calls"?}], "tools"?}:
the input's turns with the regenerated assistant turn(s); `token_ids` are the ids the target
generated for the turn (without its stop token), which training uses in place of the text's
re-tokenisation where they agree with the template (dflash_core.data.render).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from itertools import islice
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash_core.data import file_digest
from dflash_core.data.prompts import Prompt, encode_prompts, iter_prompts
from dflash_core.files.durable import write_atomic, write_jsonl
from launcher.config import ConfigError
from launcher.resolve import dataset_paths
from launcher.run_io.lock import RunLock

log = logging.getLogger("dflash")
# Settings that change what gets generated: parts written under other values are not reused.
# (regenerate.input and regenerate.tokenizer are recorded by what they are: see _generated_by.)
_FINGERPRINT_KEYS = ("engine", "drop_last_assistant", "limit", "max_prompt_length", "max_new_tokens", "temperature",
                     "top_p", "top_k", "seed", "chat_template_kwargs", "on_bad_line")
_HF_FINGERPRINT_KEYS = ("batch_size", "decode")   # a batch's padding and its decode's numerics move greedy near-ties


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


def claim_output(cfg: DictConfig) -> RunLock:
    """One writer per output: `<output>.lock` held until the run ends (a second run on the output is
    refused naming this one), then check_output under it, so no other run publishes the output
    between the check and the end of this one."""
    output = Path(cfg.regenerate.output).resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    lock = RunLock.take(output.with_name(output.name + ".lock"), f"regenerate.output={cfg.regenerate.output!r}",
                        "choose another regenerate.output")
    try:
        check_output(cfg)
    except BaseException:
        lock.release()
        raise
    return lock


def parts_dir(cfg: DictConfig) -> Path:
    output = Path(cfg.regenerate.output).resolve()
    return output.with_name(output.name + ".parts")


def part_file(parts: Path, rank: int) -> Path:
    return parts / f"rank{rank:05d}.jsonl"


# ----------------------------------------------------------------------------- part files
def _generated_by(cfg: DictConfig, world: int) -> dict:
    """What the answers depend on, by what each thing is rather than how it is spelt: the settings
    that change the answers, the input's resolved path and content digest, the tokenizer's and the
    target's resolved paths, and the number of ranks (each rank answers its own share)."""
    regenerate = OmegaConf.to_container(cfg.regenerate, resolve=True)
    keys = _FINGERPRINT_KEYS + (_HF_FINGERPRINT_KEYS if regenerate["engine"] == "hf" else ())
    source = input_path(cfg).resolve()
    state = {**{f"regenerate.{key}": regenerate[key] for key in keys}, "regenerate.input": str(source),
             "regenerate.input's content (sha256)": file_digest(source)[:16],
             "regenerate.tokenizer": str(Path(regenerate["tokenizer"]).resolve()) if regenerate["tokenizer"] else None,
             "target.path": str(Path(cfg.target.path).resolve()), "ranks (torchrun --nproc-per-node)": world}
    return json.loads(json.dumps(state, default=str))   # as meta.json gives it back


def _recorded(meta: Path) -> dict:
    try:
        return json.loads(meta.read_text()).get("generated_by") or {}
    except (OSError, ValueError, AttributeError):   # absent, torn, or written by an older version
        return {}


def prepare_parts(cfg: DictConfig, parts: Path, world: int) -> None:
    """Rank 0, before any rank writes: keep the parts of an interrupted run with the same settings;
    refuse (ConfigError naming what differs) when the parts hold answers of a run with others, unless
    regenerate.resume=false discards them."""
    meta, now = parts / "meta.json", _generated_by(cfg, world)
    if parts.exists():
        kept = sum(len(read_part(file)) for file in parts.glob("rank*.jsonl"))
        before = _recorded(meta)
        if kept and not cfg.regenerate.resume:
            log.warning("regenerate.resume=false: discarding the %d answers in %s of an earlier run", kept, parts)
        elif kept and before != now:
            differs = "; ".join(f"{key}: {before.get(key, 'not recorded')!r} then, {value!r} now"
                                for key, value in now.items() if before.get(key) != value)
            raise ConfigError(f"{parts} holds {kept} finished answers of an earlier run with other settings "
                              f"({differs}): run with the earlier settings to resume it, or set "
                              f"regenerate.resume=false to discard those answers and answer every prompt again")
        if not kept or not cfg.regenerate.resume:
            shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    write_atomic(meta, json.dumps({"generated_by": now}, indent=1) + "\n")


def start_parts(parts: Path, fingerprint: str, *, resume: bool) -> None:
    """The parts directory: kept when `resume` and it was written under the same `fingerprint` (the
    settings that change what gets generated), else emptied."""
    meta = parts / "meta.json"
    if parts.exists() and not (resume and meta.is_file()
                               and json.loads(meta.read_text()).get("fingerprint") == fingerprint):
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    write_atomic(meta, json.dumps({"fingerprint": fingerprint}) + "\n")


def open_share(cfg: DictConfig, tokenizer, share: list[Prompt], parts: Path, rank: int
               ) -> tuple[Path, dict[int, dict], list[Prompt], dict]:
    """A rank's share of the prompts: (its part file, the answers it already holds, the prompts still
    to answer, tokenised, and the drop counts of tokenize_prompts)."""
    part = part_file(parts, rank)
    done = read_part(part)
    todo, dropped = tokenize_prompts(cfg, tokenizer, [p for p in share if p.index not in done])
    return part, done, todo, dropped


@contextlib.contextmanager
def saying_what_is_kept(part: Path, prompts: int, world: int = 1):
    """Around a rank's answering of its `prompts` into its `part` file, for every engine: when the run
    ends early (a signal, an error, every server down), parts holding no answer are removed where one
    process writes them all (nothing to resume: a failed server start leaves no empty directory; a rank
    of several cannot know that the others' stay empty), and a signal's Stopped
    (launcher.cli.stop_on_signals) says what the rank keeps and how to resume."""
    try:
        yield
    except BaseException as exc:
        kept = len(read_part(part))
        if not kept and world == 1:
            shutil.rmtree(part.parent, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt):
            whose = " of this rank" if world > 1 else ""
            exc.left = (f"{kept} of {prompts} prompts{whose} answered and kept in {part.parent}; run the same command "
                        f"again to answer the other {prompts - kept}" if kept else
                        f"none of the {prompts} prompts{whose} was answered; run the same command again")
        raise


def read_part(file: Path) -> dict[int, dict]:
    """index -> output record; a torn last line (a crash mid-write) is dropped and the file rewritten."""
    if not file.is_file():
        return {}
    # Records end at "\n" only: json.dumps leaves U+2028, U+0085 and their kind unescaped in a model's
    # text, where str.splitlines would cut a record (and everything after it would be dropped).
    done, text = {}, file.read_text(encoding="utf-8")
    lines = text.split("\n")[:-1]   # a last line without its "\n" is torn
    for line in lines:
        try:
            entry = json.loads(line)
            done[entry["index"]] = entry["record"]
        except (ValueError, KeyError, TypeError):
            break
    if len(done) != len(lines) or not text.endswith("\n") and text:
        file.write_text("".join(line + "\n" for line in lines[:len(done)]), encoding="utf-8")
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
        with self._lock:   # a record being written is finished first; one written after fails, not torn
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
