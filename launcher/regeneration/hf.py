"""`regenerate.engine=hf`: HF `generate` in this process, one full target replica per rank.

Rank r answers prompts r, r+W, r+2W, ... in left-padded batches and appends its answers to its
own part file; after a barrier rank 0 merges the parts in input order into the output. Prompts
render like training data (dflash_core.data.prompts). As with the serving engines, every
assistant turn of a conversation is regenerated in order, each conditioned on the turns
regenerated before it: a batch is answered in rounds, round k answering the k-th assistant turn
of the batch's conversations that have one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

from omegaconf import DictConfig

from dflash_core.data.prompts import Prompt, stop_token_ids
from launcher.regeneration import parts as part_files
from launcher.resolve import compute_dtype, ensure_embedded_target, resolve_device, target_dir

log = logging.getLogger("dflash")


def generation_config(r: DictConfig, stop_ids: list[int], pad_id: int):
    """Greedy or sampling as the section `r` (regenerate.*, synthesize.*) says."""
    from transformers import GenerationConfig
    common = {"max_new_tokens": r.max_new_tokens, "eos_token_id": stop_ids, "pad_token_id": pad_id}
    if r.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    # Every sampling knob is set, so the checkpoint's own defaults (Qwen3: top_k 20) do not leak in.
    return GenerationConfig(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, **common)


def left_padded(prompts: list[Prompt], pad_id: int):
    """(input_ids, attention_mask) of a batch, padded on the left: every row's last prompt token sits at
    the same position, where generation starts."""
    import torch
    width = max(len(p.token_ids) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt.token_ids):] = torch.tensor(prompt.token_ids)
        attention_mask[row, width - len(prompt.token_ids):] = 1
    return input_ids, attention_mask


def generate(model, prompts: list[Prompt], gen_config, pad_id: int) -> list[list[int]]:
    """The new tokens of each prompt: one left-padded HF generate() call for the whole batch."""
    import torch
    input_ids, attention_mask = left_padded(prompts, pad_id)
    device = model.device
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                generation_config=gen_config)
    return output[:, input_ids.shape[1]:].tolist()


def batch_decoder(model, section: DictConfig, key: str, stop_ids: list[int], pad_id: int):
    """`<key>.decode`: a function from a batch of prompts to each one's new tokens, through the static
    decode loop (dflash_core.target.decode) or HF generate; `auto` takes the loop wherever it runs the
    target (faster on CPU and GPU alike: docs/perf_notes.md, "A decode loop the GPU paces")."""
    from dflash_core.target.decode import Sampling, StaticDecoder, unsupported
    from launcher.config import ConfigError
    why = unsupported(model)
    if section.decode == "static" and why:
        raise ConfigError(f"{key}.decode=static: the static decode loop cannot run this target ({why}); "
                          f"{key}.decode=generate or auto decodes it with HF generate")
    if section.decode == "generate" or why:
        if why:
            log.info("%s.decode=auto: HF generate (the static decode loop cannot run this target: %s)", key, why)
        gen_config = generation_config(section, stop_ids, pad_id)
        return lambda prompts: generate(model, prompts, gen_config, pad_id)
    loop = StaticDecoder(model, section.max_new_tokens, stop_ids, pad_id,
                         Sampling(section.temperature, section.top_p, section.top_k))
    return lambda prompts: loop(*left_padded(prompts, pad_id)).tolist()


def answer(decode, tokenizer, prompts: list[Prompt], stop_ids: list[int]) -> list[tuple[str, list[int], bool]]:
    """(text, generated ids before the stop token, finished) per prompt."""
    results, stops = [], set(stop_ids)
    specials = [t for t in tokenizer.all_special_tokens if t]
    for row in decode(prompts):
        stop = next((k for k, token in enumerate(row) if token in stops), None)
        ids = row[:stop]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for special in specials:  # re-tokenised, such a string would end the turn early in training
            text = text.replace(special, "")
        results.append((text.strip(), ids, stop is not None))
    return results


def regenerate_batch(decode, tokenizer, batch: list[Prompt], stop_ids: list[int],
                     chat_template_kwargs: dict) -> list[tuple[list[dict] | None, int, int]]:
    """Per prompt: (its conversation with every assistant turn regenerated, or None when one came
    back empty; tokens generated; turns cut at max_new_tokens)."""
    from dflash_core.data.prompts import encode_prompts
    remaining = [[*prompt.messages, None] for prompt in batch]   # None: the answer after the last turn
    histories: list[list[dict]] = [[] for _ in batch]
    results: list = [None] * len(batch)
    tokens, unfinished = [0] * len(batch), [0] * len(batch)
    asking = list(range(len(batch)))
    while asking:
        for k in asking:   # the turns up to the next assistant turn join the history; that turn is asked
            while remaining[k][0] is not None and remaining[k][0]["role"] != "assistant":
                histories[k].append(remaining[k].pop(0))
            remaining[k].pop(0)
        prompts = encode_prompts(tokenizer, [Prompt(batch[k].index, batch[k].id, batch[k].location, histories[k],
                                                    batch[k].tools) for k in asking],
                                 max_tokens=1 << 62, chat_template_kwargs=chat_template_kwargs)
        for k, (text, ids, finished) in zip(asking, answer(decode, tokenizer, prompts, stop_ids)):
            tokens[k] += len(ids) + finished   # the stop token too, as a server's completion_tokens count it
            unfinished[k] += not finished
            histories[k].append({"role": "assistant", "content": text, "token_ids": ids})
            if not text:
                remaining[k] = []
            elif not remaining[k]:
                results[k] = histories[k]
        asking = [k for k in asking if remaining[k]]
    return list(zip(results, tokens, unfinished))


def run_hf(cfg: DictConfig, rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    r = cfg.regenerate
    device = resolve_device(r.device, "regenerate.device", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gloo for everything: the ranks exchange only a barrier and a few small objects. Started
    # without torchrun (no RANK), the job is one process: a group of one, over an in-memory store.
    single = {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group("gloo", timeout=timedelta(seconds=r.timeout_s), **single)
    with contextlib.ExitStack() as claimed:
        failure = None
        if rank == 0:   # one writer per output (held until the output is published)
            try:
                claimed.enter_context(part_files.claim_output(cfg))
                ensure_embedded_target(cfg, seed=0)
                part_files.prepare_parts(cfg, part_files.parts_dir(cfg), world)
            except Exception as exc:  # noqa: BLE001 - raised below, once every rank heard of it
                failure = exc
        refusal = [None if failure is None else str(failure)]
        dist.broadcast_object_list(refusal, src=0)
        if failure is not None:
            raise failure
        if refusal[0] is not None:
            raise OSError(f"rank 0 cannot start: {refusal[0]}")
        return _answer(cfg, rank, world, device)


def _answer(cfg: DictConfig, rank: int, world: int, device) -> int:
    """This rank's share answered into its part file; rank 0 merges the parts into the output."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from dflash_core.data import load_tokenizer
    from dflash_core.target.capture import check_target_files

    r = cfg.regenerate
    output, parts = Path(r.output).resolve(), part_files.parts_dir(cfg)
    tokenizer = load_tokenizer(Path(r.tokenizer) if r.tokenizer else target_dir(cfg))
    prompts, stats = part_files.load_prompts(cfg)
    part, done, mine, dropped = part_files.open_share(cfg, tokenizer, prompts[rank::world], parts, rank)
    shares = [None] * world
    dist.all_gather_object(shares, {"left": len(mine) + len(done), **dropped})
    if not sum(share["left"] for share in shares):   # on every rank alike, before the model loads
        if rank == 0:
            shutil.rmtree(parts, ignore_errors=True)
        raise part_files.every_prompt_skipped(cfg, stats, shares)

    with part_files.saying_what_is_kept(part, len(done) + len(mine), world):   # a signal says what is kept
        check_target_files(target_dir(cfg))
        dtype = compute_dtype(cfg.target.dtype, device, cpu=torch.bfloat16)
        if rank == 0:
            log.info("answering with %s in %s on %s (target.dtype=%s)", target_dir(cfg), dtype, device,
                     cfg.target.dtype)
        model = AutoModelForCausalLM.from_pretrained(target_dir(cfg), dtype=dtype)
        model.requires_grad_(False).eval().to(device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        stop_ids = stop_token_ids(tokenizer, model.generation_config, part_files.template_kwargs(cfg))
        decode = batch_decoder(model, r, "regenerate", stop_ids, pad_id)
        torch.manual_seed(r.seed + rank)
        # Longest first: batches of similar lengths pad little, and running out of memory shows up
        # in the first batch rather than hours in.
        mine.sort(key=lambda p: -len(p.token_ids))
        counts = {"answered": 0, "unfinished_turns": 0, "empty": 0, **dropped, "resumed": len(done), "new_tokens": 0}
        started = time.perf_counter()
        with part_files.PartWriter(part) as writer:
            for batch_no, start in enumerate(range(0, len(mine), r.batch_size)):
                batch = mine[start:start + r.batch_size]
                answers = regenerate_batch(decode, tokenizer, batch, stop_ids, part_files.template_kwargs(cfg))
                for prompt, (conversation, tokens, unfinished) in zip(batch, answers):
                    counts["unfinished_turns"] += unfinished
                    counts["new_tokens"] += tokens
                    if conversation is None:
                        counts["empty"] += 1
                        continue
                    counts["answered"] += 1
                    writer.write(prompt.index, part_files.output_record(prompt, conversation), sync=False)
                writer.sync()  # a crash loses at most the batch in flight
                if rank == 0 and (batch_no + 1) % r.log_every == 0:
                    log.info("rank 0: %d/%d prompts answered, %.1f tokens/s", start + len(batch), len(mine),
                             counts["new_tokens"] / (time.perf_counter() - started))

    counts["wall_s"] = time.perf_counter() - started
    gathered = [None] * world
    dist.all_gather_object(gathered, counts)  # also the barrier: every part file is complete
    if rank == 0:
        written = part_files.merge_parts(parts, world, len(prompts), output)
        shutil.rmtree(parts)
        totals = {key: sum(c[key] for c in gathered) for key in counts if key != "wall_s"}
        wall = max(c["wall_s"] for c in gathered)
        log.info("wrote %d records to %s (input %s; this run %s; slowest rank %.1fs, %.1f new tokens/s)", written,
                 output, stats, totals, wall, totals["new_tokens"] / max(wall, 1e-9))
    dist.barrier()
    dist.destroy_process_group()
    return 0
