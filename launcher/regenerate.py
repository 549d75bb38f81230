"""Answer a dataset's prompts with the target itself: `torchrun ... -m launcher.regenerate key=value ...`
(`python -m launcher.regenerate ...` without torchrun: one process).

Drafters trained on the target's own answers accept more of its tokens, so the usual recipe is
to regenerate the assistant turns of a chat set with the target before training. Every rank is
a full target replica (HF `generate` on the untruncated model); rank r answers prompts r, r+W,
r+2W, ... and appends its answers to its own part file; after a barrier rank 0 merges the parts
in input order into the output JSONL (temp file, then rename). Part files survive a crash, so a
rerun with the same settings and world size answers only what is missing.

Output records: {"id", "conversations": [...the prompt's turns..., {"role": "assistant", "content"}]}, plus the
input's "tools" when it has them. Prompts render like training data (dflash_core.data.prompts).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from datetime import timedelta
from itertools import islice
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash_core.data import file_digest
from dflash_core.data.prompts import Prompt, encode_prompts, iter_prompts, stop_token_ids
from launcher.config import ConfigError, compose_config, require
from launcher.resolve import compute_dtype, dataset_paths, ensure_embedded_target, resolve_device, target_dir
from launcher.run_io.rundir import log, setup_logging

USAGE = """\
Usage: torchrun --standalone --nproc-per-node N -m launcher.regenerate regenerate.output=FILE [key=value ...]
       python -m launcher.regenerate regenerate.output=FILE [key=value ...]      # one process
Example:
  torchrun --standalone --nproc-per-node 8 -m launcher.regenerate target=qwen3_8b target.path=/models/Qwen3-8B \\
      regenerate.input=/data/prompts.jsonl regenerate.output=/data/qwen3-8b-regen.jsonl"""

# Settings that change what gets generated: parts written under other values are not reused.
_FINGERPRINT_KEYS = ("input", "tokenizer", "drop_last_assistant", "limit", "max_prompt_length", "max_new_tokens",
                     "temperature", "top_p", "top_k", "seed", "chat_template_kwargs", "on_bad_line", "batch_size")


def validate(cfg: DictConfig) -> None:
    require(cfg, Path(cfg.regenerate.output).suffix == ".jsonl", "regenerate.output", "must be a .jsonl file")


# ----------------------------------------------------------------------------- prompts
def input_path(cfg: DictConfig) -> Path:
    paths = dataset_paths(cfg.regenerate.input, "regenerate.input")
    if len(paths) != 1:
        raise ConfigError(f"regenerate.input={cfg.regenerate.input!r}: names {len(paths)} files; "
                          f"regenerate one at a time")
    return paths[0]


def _template_kwargs(cfg: DictConfig) -> dict:
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
                          chat_template_kwargs=_template_kwargs(cfg), on_bad_line=r.on_bad_line, stats=stats)
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


# ----------------------------------------------------------------------------- generation
def generation_config(cfg: DictConfig, stop_ids: list[int], pad_id: int):
    from transformers import GenerationConfig
    r = cfg.regenerate
    common = {"max_new_tokens": r.max_new_tokens, "eos_token_id": stop_ids, "pad_token_id": pad_id}
    if r.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    # Every sampling knob is set, so the checkpoint's own defaults (Qwen3: top_k 20) do not leak in.
    return GenerationConfig(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, **common)


def generate(model, prompts: list[Prompt], gen_config, pad_id: int) -> list[list[int]]:
    """The new tokens of each prompt: one left-padded generate() call for the whole batch."""
    import torch
    width = max(len(p.token_ids) for p in prompts)
    # Left padding: every row's last prompt token sits at the same position, where generation starts.
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt.token_ids):] = torch.tensor(prompt.token_ids)
        attention_mask[row, width - len(prompt.token_ids):] = 1
    device = model.device
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=gen_config)
    return output[:, width:].tolist()


def answer(model, tokenizer, prompts: list[Prompt], gen_config, stop_ids: list[int],
           pad_id: int) -> list[tuple[str, bool]]:
    """(text, finished) per prompt, cut at the first stop token."""
    results, stops = [], set(stop_ids)
    specials = [t for t in tokenizer.all_special_tokens if t]
    for row in generate(model, prompts, gen_config, pad_id):
        stop = next((k for k, token in enumerate(row) if token in stops), None)
        text = tokenizer.decode(row[:stop], skip_special_tokens=True)
        for special in specials:  # re-tokenised, such a string would end the turn early in training
            text = text.replace(special, "")
        results.append((text.strip(), stop is not None))
    return results


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


# ----------------------------------------------------------------------------- part files
def _fingerprint(cfg: DictConfig, world: int) -> str:
    settings = {key: OmegaConf.to_container(cfg.regenerate, resolve=True)[key] for key in _FINGERPRINT_KEYS}
    state = json.dumps({"settings": settings, "input": file_digest(input_path(cfg)),
                        "target": str(Path(cfg.target.path).resolve()), "world": world}, sort_keys=True, default=str)
    return hashlib.sha256(state.encode()).hexdigest()[:16]


def prepare_parts(cfg: DictConfig, parts: Path, world: int) -> None:
    """Rank 0, before any rank writes: keep parts of an interrupted identical run, else start afresh."""
    meta, fingerprint = parts / "meta.json", _fingerprint(cfg, world)
    if parts.exists() and not (cfg.regenerate.resume and meta.is_file()
                               and json.loads(meta.read_text()).get("fingerprint") == fingerprint):
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")


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


def merge_parts(parts: Path, world: int, num_prompts: int, output: Path) -> int:
    """Rank 0: every answered prompt in input order, written atomically; returns the record count."""
    records: dict[int, dict] = {}
    for rank in range(world):
        records.update(read_part(parts / f"rank{rank:05d}.jsonl"))
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")  # same directory: the rename is atomic
    with open(tmp, "w", encoding="utf-8") as f:
        for index in range(num_prompts):
            if index in records:  # absent: the answer came back empty
                f.write(json.dumps(records[index], ensure_ascii=False) + "\n")
    os.replace(tmp, output)
    return sum(index in records for index in range(num_prompts))


# ----------------------------------------------------------------------------- the job
def run(overrides: list[str]) -> int:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    tag = f"regen{rank}"
    setup_logging(tag, logging.INFO if rank == 0 else logging.WARNING)
    cfg = compose_config(overrides, config_name="regenerate")
    validate(cfg)
    check_output(cfg)
    r = cfg.regenerate

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dflash_core.data import load_tokenizer
    from dflash_core.target.capture import check_target_files

    device = resolve_device(r.device, "regenerate.device", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gloo for everything: the ranks exchange only a barrier and a few small objects. Started
    # without torchrun (no RANK), the job is one process: a group of one, over an in-memory store.
    single = {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group("gloo", timeout=timedelta(seconds=r.timeout_s), **single)
    output = Path(r.output).resolve()
    parts = output.with_name(output.name + ".parts")
    if rank == 0:
        ensure_embedded_target(cfg, seed=0)
        prepare_parts(cfg, parts, world)
    dist.barrier()

    tokenizer = load_tokenizer(Path(r.tokenizer) if r.tokenizer else target_dir(cfg))
    prompts, stats = load_prompts(cfg)
    part = parts / f"rank{rank:05d}.jsonl"
    done = read_part(part)
    mine, dropped = tokenize_prompts(cfg, tokenizer, [p for p in prompts[rank::world] if p.index not in done])
    shares = [None] * world
    dist.all_gather_object(shares, {"left": len(mine) + len(done), **dropped})
    if not sum(share["left"] for share in shares):   # on every rank alike, before the model loads
        if rank == 0:
            shutil.rmtree(parts, ignore_errors=True)
        raise every_prompt_skipped(cfg, stats, shares)

    check_target_files(target_dir(cfg))
    model = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=compute_dtype(cfg.target.dtype, device))
    model.requires_grad_(False).eval().to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_token_ids(tokenizer, model.generation_config, _template_kwargs(cfg))
    gen_config = generation_config(cfg, stop_ids, pad_id)
    torch.manual_seed(r.seed + rank)
    # Longest first: batches of similar lengths pad little, and running out of memory shows up
    # in the first batch rather than hours in.
    mine.sort(key=lambda p: -len(p.token_ids))
    counts = {"answered": 0, "unfinished": 0, "empty": 0, **dropped, "resumed": len(done),
              "new_tokens": 0}
    started = time.perf_counter()
    with open(part, "a", encoding="utf-8") as f:
        for batch_no, start in enumerate(range(0, len(mine), r.batch_size)):
            batch = mine[start:start + r.batch_size]
            for prompt, (text, finished) in zip(batch, answer(model, tokenizer, batch, gen_config, stop_ids, pad_id)):
                counts["unfinished"] += not finished
                if not text:
                    counts["empty"] += 1
                    continue
                counts["answered"] += 1
                counts["new_tokens"] += len(tokenizer(text, add_special_tokens=False)["input_ids"])
                record = {"id": prompt.id, "conversations": prompt.messages + [{"role": "assistant", "content": text}],
                          **({"tools": prompt.tools} if prompt.tools else {})}
                f.write(json.dumps({"index": prompt.index, "record": record}, ensure_ascii=False) + "\n")
            f.flush()  # a crash loses at most the batch in flight
            if rank == 0 and (batch_no + 1) % r.log_every == 0:
                log.info("rank 0: %d/%d prompts answered, %.1f tokens/s", start + len(batch), len(mine),
                         counts["new_tokens"] / (time.perf_counter() - started))

    counts["wall_s"] = time.perf_counter() - started
    gathered = [None] * world
    dist.all_gather_object(gathered, counts)  # also the barrier: every part file is complete
    if rank == 0:
        written = merge_parts(parts, world, len(prompts), output)
        shutil.rmtree(parts)
        totals = {key: sum(c[key] for c in gathered) for key in counts if key != "wall_s"}
        log.info("wrote %d records to %s (input %s; this run %s; slowest rank %.1fs)", written, output, stats,
                 totals, max(c["wall_s"] for c in gathered))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "regenerate", USAGE)


if __name__ == "__main__":
    main()
