"""`python -m launcher.synthesize synthesize.output=FILE [key=value ...]`: user prompts written by the
target itself, by the Magpie method (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by
Prompting Aligned LLMs with Nothing").

Given only its chat template's opening of a user turn (whatever the template puts first, such as
SmolLM2's default system prompt, then `<|im_start|>user\\n`), an instruction-tuned model continues with
a plausible user request and ends it with its end-of-turn token; sampled (temperature 1.0, top-p 0.95)
it writes requests as varied as those it was tuned on, with no data set. Candidate k = 0, 1, ... is
sampled in rounds (engine=hf: one batch seeded with seed + its first k; a server: one
request seeded with seed + k) and appended to a part file as its round finishes
(launcher/regeneration/parts.py), so an interrupted run resumes where it stopped. Candidates are then
judged in order: junk (not ended by max_new_tokens, holding a template token, too short or long, not
text, repetitive) and near-duplicates of a kept prompt (the same normalised text, or sharing
`dedup_overlap` of word n-grams) are dropped and counted. The first num_prompts kept are written as
conversations of one user turn (the form launcher.regenerate answers), the last `heldout` of them to
a file of their own.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
import unicodedata
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash_core.files.durable import write_jsonl
from launcher.config import ConfigError, compose_config, require
from launcher.regeneration.parts import PartWriter, part_file, read_part, start_parts
from launcher.run_io.progress import prompt_progress

log = logging.getLogger("dflash")
USAGE = """\
Usage: python -m launcher.synthesize synthesize.output=FILE [key=value ...]
Examples:
  python -m launcher.synthesize target=smollm2_135m synthesize.output=.cache/smollm2/prompts.jsonl \\
      synthesize.num_prompts=2000 synthesize.heldout=16
  python -m launcher.synthesize synthesize.engine=vllm target=qwen3_8b target.path=/models/Qwen3-8B \\
      synthesize.output=/data/prompts.jsonl"""
SENTINEL = "\x00user-turn\x00"   # marks where the user's words go in the rendered template
# Settings that change what is sampled: parts written under other values are not reused.
_FINGERPRINT_KEYS = ("engine", "system_prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                     "chat_template_kwargs")
_HF_FINGERPRINT_KEYS = ("batch_size", "decode")   # one batch's seed covers a batch, drawn as its decode draws


@dataclass
class Candidate:
    ids: list[int]    # the sampled user turn's tokens, before its end-of-turn token
    finished: bool    # ended with an end-of-turn token (not cut at max_new_tokens)


def candidate(row: list[int], stops: set[int]) -> Candidate:
    stop = next((k for k, token in enumerate(row) if token in stops), None)
    return Candidate(list(row[:stop]), stop is not None)


def system_turn(s: DictConfig) -> list[dict]:
    return [] if s.system_prompt is None else [{"role": "system", "content": s.system_prompt}]


def user_turn_opening(tokenizer, s: DictConfig) -> str:
    """The rendered conversation up to where a user's words begin: what the model continues."""
    from dflash_core.data.render import ChatRenderer
    text = ChatRenderer(tokenizer, OmegaConf.to_container(s.chat_template_kwargs)).render(
        [*system_turn(s), {"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        raise ConfigError(f"the chat template of {tokenizer.name_or_path} does not render a user turn's content "
                          f"as it is: its opening of a user turn cannot be found")
    return text[:text.index(SENTINEL)]


# ----------------------------------------------------------------------------- judging
def normalised(text: str) -> str:
    """Lower case, every run of non-alphanumeric characters one space: what near-duplicates compare."""
    return " ".join(re.findall(r"\w+", text.lower()))


class NearDuplicates:
    """Kept texts, and whether a new one is a near-duplicate of one of them: the same normalised text,
    or at least `overlap` of the word n-grams of the smaller of the two shared (an inverted index of
    n-grams finds the kept texts sharing any)."""

    def __init__(self, n: int, overlap: float):
        self.n, self.overlap = n, overlap
        self.exact: set[str] = set()
        self.index: dict[tuple, list[int]] = defaultdict(list)
        self.sizes: list[int] = []

    def grams(self, words: list[str]) -> set[tuple]:
        return {tuple(words[i:i + self.n]) for i in range(max(len(words) - self.n + 1, 1))}

    def add_unless_duplicate(self, text: str) -> bool:
        """True (and the text kept) unless it is a near-duplicate of a kept text."""
        norm = normalised(text)
        if norm in self.exact:
            return False
        grams = self.grams(norm.split())
        shared = Counter(kept for gram in grams for kept in self.index.get(gram, ()))
        if any(count >= self.overlap * min(len(grams), self.sizes[kept]) for kept, count in shared.items()):
            return False
        self.exact.add(norm)
        for gram in grams:
            self.index[gram].append(len(self.sizes))
        self.sizes.append(len(grams))
        return True


class Judge:
    """Candidates in order -> the user turn's text, or None with the reason counted."""

    def __init__(self, tokenizer, s: DictConfig):
        self.tokenizer, self.s = tokenizer, s
        added = tokenizer.added_tokens_decoder   # id -> AddedToken: the template's tokens and their kin
        self.special_ids = set(added) | set(tokenizer.all_special_ids)
        self.special_texts = [token.content for token in added.values()]
        self.near = NearDuplicates(s.dedup_ngram, s.dedup_overlap)
        self.counts: Counter = Counter()

    def junk(self, c: Candidate, text: str) -> str | None:
        """Why the text is no user request, or None."""
        s = self.s
        if not c.finished:
            return "unfinished"
        if any(token in self.special_ids for token in c.ids) or any(t in text for t in self.special_texts):
            return "template_token"   # a user turn holding <|im_start|> etc. would render as another turn
        words = text.split()
        if len(words) < s.min_words:
            return "too_short"
        if len(text) > s.max_chars:
            return "too_long"
        visible = [ch for ch in text if not ch.isspace()]
        if "\ufffd" in text or any(unicodedata.category(ch) in ("Cc", "Cs", "Co", "Cn") for ch in visible) \
                or sum(ch.isalpha() for ch in visible) < s.min_letter_fraction * len(visible):
            return "not_text"
        if len(words) >= 8 and len(set(words)) < 0.3 * len(words):
            return "repetitive"
        return None

    def __call__(self, c: Candidate) -> str | None:
        text = self.tokenizer.decode(c.ids, skip_special_tokens=False).strip()
        why = self.junk(c, text) or (None if self.near.add_unless_duplicate(text) else "near_duplicate")
        self.counts[why or "kept"] += 1
        return None if why else text


# ----------------------------------------------------------------------------- samplers
class HFSampler:
    """engine=hf: rounds of batch_size candidates, each round one batch (synthesize.decode) seeded by its start."""

    def __init__(self, cfg: DictConfig, opening: list[int], stop_ids: list[int], pad_id: int):
        from transformers import AutoModelForCausalLM

        from dflash_core.target.capture import check_target_files
        from launcher.regeneration.hf import batch_decoder
        from launcher.resolve import compute_dtype, resolve_device, target_dir

        s = cfg.synthesize
        device = resolve_device(s.device, "synthesize.device")
        check_target_files(target_dir(cfg))
        dtype = compute_dtype(cfg.target.dtype, device)
        self.model = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=dtype).requires_grad_(False).eval()
        self.model.to(device)
        self.opening, self.stops, self.seed = opening, set(stop_ids), s.seed
        self.decode = batch_decoder(self.model, s, "synthesize", stop_ids, pad_id)
        self.round_size = s.batch_size

    def sample(self, start: int, wanted: list[int]) -> dict[int, Candidate]:
        import torch

        from dflash_core.data.prompts import Prompt
        torch.manual_seed(self.seed + start)
        prompt = Prompt(0, None, "", [], token_ids=self.opening)
        rows = self.decode([prompt] * self.round_size)
        return {start + k: candidate(row, self.stops) for k, row in enumerate(rows) if start + k in wanted}


class ServedSampler:
    """engine=vllm|openai: one completion request of the opening's token ids per candidate, seeded by
    its index, `concurrency` in flight per server."""

    def __init__(self, clients: list, s: DictConfig, opening: list[int], stop_ids: list[int]):
        self.clients, self.s, self.opening, self.stop_ids = clients, s, opening, stop_ids
        self.round_size = s.concurrency * len(clients)

    def _one(self, k: int) -> Candidate:
        s = self.s
        sampling = {"temperature": s.temperature, "top_p": s.top_p, "seed": s.seed + k,
                    **({"top_k": s.top_k} if s.top_k else {})}
        ids = self.clients[k % len(self.clients)].complete_ids(self.opening, max_tokens=s.max_new_tokens,
                                                               stop_token_ids=self.stop_ids, sampling=sampling)
        return candidate(ids, set(self.stop_ids))

    def sample(self, start: int, wanted: list[int]) -> dict[int, Candidate]:
        with ThreadPoolExecutor(max_workers=self.round_size) as pool:
            return dict(zip(wanted, pool.map(self._one, wanted)))


@contextlib.contextmanager
def opened_sampler(cfg: DictConfig, opening: list[int], stop_ids: list[int], pad_id: int):
    s = cfg.synthesize
    if s.engine == "hf":
        yield HFSampler(cfg, opening, stop_ids, pad_id)
        return
    from launcher.regeneration.served import checked_urls, connected, started_servers
    from launcher.resolve import target_dir
    with contextlib.ExitStack() as stack:
        if s.engine == "openai":
            servers, urls = [], checked_urls(cfg, "synthesize")
        else:
            servers = stack.enter_context(started_servers(cfg, target_dir(cfg), "synthesize"))
            urls = [server.url for server in servers]
        yield ServedSampler(connected(urls, cfg, "synthesize", started=servers), s, opening, stop_ids)


# ----------------------------------------------------------------------------- the job
def outputs(s: DictConfig) -> tuple[Path, Path | None]:
    output = Path(s.output)
    heldout = Path(s.heldout_output) if s.heldout_output else output.with_name(output.stem + ".heldout.jsonl")
    return output, heldout if s.heldout else None


def validate(cfg: DictConfig) -> None:
    s = cfg.synthesize
    require(cfg, Path(s.output).suffix == ".jsonl", "synthesize.output", "must be a .jsonl file")
    require(cfg, s.heldout < s.num_prompts, "synthesize.heldout",
            f"must be less than synthesize.num_prompts={s.num_prompts}: the rest are the training prompts")
    require(cfg, not s.endpoints or s.engine == "openai", "synthesize.endpoints",
            f"servers of the user are read with synthesize.engine=openai, not {s.engine}")
    require(cfg, s.max_candidates is None or s.max_candidates >= s.num_prompts, "synthesize.max_candidates",
            f"must be at least synthesize.num_prompts={s.num_prompts}")
    for path in filter(None, outputs(s)):
        if path.exists() and not s.overwrite:
            raise ConfigError(f"{path} already exists; set synthesize.overwrite=true to replace it, or choose "
                              f"another synthesize.output")


def fingerprint(cfg: DictConfig) -> str:
    s = OmegaConf.to_container(cfg.synthesize, resolve=True)
    keys = _FINGERPRINT_KEYS + (_HF_FINGERPRINT_KEYS if s["engine"] == "hf" else ())
    state = {"settings": {key: s[key] for key in keys}, "target": str(Path(cfg.target.path).resolve())}
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]


def record(k: int, s: DictConfig, text: str) -> dict:
    return {"id": f"synthesized-{k:07d}", "conversations": [*system_turn(s), {"role": "user", "content": text}]}


def synthesize(cfg: DictConfig) -> dict:
    from transformers import GenerationConfig

    from dflash_core.data import load_tokenizer
    from dflash_core.data.prompts import stop_token_ids
    from launcher.resolve import ensure_embedded_target, target_dir

    s = cfg.synthesize
    if s.engine != "openai":
        ensure_embedded_target(cfg, seed=0)
    target = target_dir(cfg)
    tokenizer = load_tokenizer(target)
    try:
        generation = GenerationConfig.from_pretrained(target)
    except OSError:
        generation = None
    stop_ids = stop_token_ids(tokenizer, generation, OmegaConf.to_container(s.chat_template_kwargs))
    opening = tokenizer(user_turn_opening(tokenizer, s), add_special_tokens=False)["input_ids"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    limit = s.max_candidates or 4 * s.num_prompts

    output, heldout = outputs(s)
    parts = output.resolve().with_name(output.name + ".parts")
    start_parts(parts, fingerprint(cfg), resume=s.resume)
    part = part_file(parts, 0)
    done = {k: Candidate(**c) for k, c in read_part(part).items()}
    if done:
        log.info("resuming: %d user turns sampled before", len(done))
    judge, kept, k = Judge(tokenizer, s), [], 0
    bar = prompt_progress("synthesizing", total=s.num_prompts)
    sampled, started = 0, time.perf_counter()

    def judge_ready() -> None:
        nonlocal k
        while k in done and k < limit and len(kept) < s.num_prompts:
            text = judge(done[k])
            if text is not None:
                kept.append((k, text))
                bar.update(1)
            k += 1
        bar.set_postfix_str(f"{k} sampled, {k - len(kept)} dropped", refresh=False)

    judge_ready()
    with contextlib.ExitStack() as stack:
        sampler, writer = None, None
        while len(kept) < s.num_prompts and k < limit:
            if sampler is None:   # only when something is left to sample: a complete resume loads nothing
                sampler = stack.enter_context(opened_sampler(cfg, opening, stop_ids, pad_id))
                writer = stack.enter_context(PartWriter(part))
            start = k - k % sampler.round_size   # rounds are aligned, so each is seeded as in an uninterrupted run
            wanted = [i for i in range(start, start + sampler.round_size) if i not in done]
            for i, c in sorted(sampler.sample(start, wanted).items()):
                writer.write(i, {"ids": c.ids, "finished": c.finished}, sync=False)
                done[i] = c
                sampled += 1
            writer.sync()
            judge_ready()
    bar.close()
    counts = dict(judge.counts)
    if len(kept) < s.num_prompts:
        raise ConfigError(f"synthesize.max_candidates={limit}: {k} user turns sampled kept only {len(kept)} of the "
                          f"synthesize.num_prompts={s.num_prompts} prompts asked for ({counts}); raise "
                          f"synthesize.max_candidates (the same command resumes, keeping what was sampled) or relax "
                          f"the filters")
    records = [record(i, s, text) for i, text in kept]
    train = records[:len(records) - s.heldout]
    write_jsonl(output, train)
    if heldout:
        write_jsonl(heldout, records[len(train):])
    shutil.rmtree(parts)
    seconds = time.perf_counter() - started
    log.info("wrote %d prompts to %s%s; judged %d user turns (%d sampled by this run in %.1fs): %s", len(train),
             output, f" and {s.heldout} held out to {heldout}" if heldout else "", k, sampled, seconds, counts)
    return {"train": str(output), "heldout": str(heldout) if heldout else None, "judged": k, "counts": counts}


def run(overrides: list[str]) -> int:
    cfg = compose_config(overrides, config_name="synthesize")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("launcher.synthesize runs as one process (its candidates are numbered in one sequence); "
                          "start it with python -m launcher.synthesize, not torchrun")
    validate(cfg)
    synthesize(cfg)
    return 0


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "synthesize", USAGE)


if __name__ == "__main__":
    main()
