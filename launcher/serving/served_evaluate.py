"""`launcher.evaluate evaluate.engine=vllm`: real acceptance as vLLM serves the export.

The same prompts as the HF engine (rendered and tokenised here, sent as token ids), decoded
greedily one at a time, so that the difference of vLLM's own `vllm:spec_decode_*` counters
before and after a request is that prompt's drafts and per-position acceptances. Plain decoding
runs on a second server without speculation; losslessness is the two outputs being equal.
Servers are started here (VllmServer) or are the user's (evaluate.endpoint / plain_endpoint).
`evaluate.baselines=[ngram]` adds what a user would run instead of training a drafter, vLLM's n-gram
prompt lookup, on a third server started here, decoding the same prompts with the same counters.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError
from launcher.serving.acceptance import prompt_row, summarize
from launcher.serving.openai_client import OpenAIClient
from launcher.serving.vllm_server import VllmServer, parse_spec_counters

log = logging.getLogger("dflash")


def export_block_size(drafter: str) -> int:
    """A servable drafter is an export (config.json with dflash_config); its block size."""
    config = Path(drafter) / "config.json"
    if not config.is_file():
        raise ConfigError(f"evaluate.drafter={drafter!r}: evaluate.engine=vllm serves an exported drafter "
                          f"(a directory with config.json), not a checkpoint; export it first (launcher.export)")
    return int(json.loads(config.read_text())["dflash_config"]["block_size"])


def speculative_config(drafter: str, block_size: int) -> dict:
    """vLLM's --speculative-config for a DFlash export: one bonus query + Bs-1 mask queries."""
    return {"method": "dflash", "model": str(Path(drafter).resolve()), "num_speculative_tokens": block_size - 1}


def ngram_config(ev: DictConfig, block_size: int) -> dict:
    """vLLM's --speculative-config for its n-gram prompt lookup: the last 2-4 tokens (by default) found
    earlier in the sequence propose the tokens that followed them there."""
    if ev.ngram_lookup_min > ev.ngram_lookup_max:
        raise ConfigError(f"evaluate.ngram_lookup_min={ev.ngram_lookup_min} exceeds "
                          f"evaluate.ngram_lookup_max={ev.ngram_lookup_max}")
    return {"method": "ngram", "num_speculative_tokens": ev.ngram_tokens or block_size - 1,
            "prompt_lookup_min": ev.ngram_lookup_min, "prompt_lookup_max": ev.ngram_lookup_max}


@contextlib.contextmanager
def _client(endpoint, target: Path, speculative: dict | None, ev, dtype: str, max_model_len: int):
    """A client of the server at `endpoint`, else of one started here for the block. It never retries:
    a completion sent again would count its drafts twice in the counters' difference."""
    if endpoint:
        client = OpenAIClient(endpoint, max_retries=0)
        if not client.healthy():
            key = "evaluate.endpoint" if speculative else "evaluate.plain_endpoint"
            raise ConfigError(f"{key}={endpoint!r}: no vLLM server answers /health there")
        yield client
        return
    log.info("starting vllm serve %s (%s)", target, "speculative" if speculative else "plain")
    with VllmServer(target.resolve(), speculative=speculative, dtype=dtype, max_model_len=max_model_len,
                    memory_fraction=ev.vllm_memory_fraction, extra_args=tuple(ev.vllm_args),
                    python=ev.vllm_python,
                    startup_timeout_s=ev.vllm_startup_timeout_s) as started:
        yield OpenAIClient(started.url, max_retries=0)


def decode_speculative(client: OpenAIClient, prompts, *, max_tokens: int, stop: list[int]):
    """-> [(tokens, drafts, per_position)] per prompt, and the seconds spent decoding."""
    results, seconds = [], 0.0
    before = parse_spec_counters(client.metrics())
    if not before["speculating"]:
        raise ConfigError(f"the server at {client.url} exposes no vllm:spec_decode_* counters: it does not "
                          f"speculate (start it with --speculative-config, or leave evaluate.endpoint unset)")
    for ids in prompts:
        started = time.perf_counter()
        tokens = client.complete_ids(ids, max_tokens=max_tokens, stop_token_ids=stop)
        seconds += time.perf_counter() - started
        after = parse_spec_counters(client.metrics())
        per_position = [int(after["per_position"].get(j, 0) - before["per_position"].get(j, 0))
                        for j in range(len(after["per_position"]))]
        results.append((tokens, int(after["num_drafts"] - before["num_drafts"]), per_position))
        before = after
    return results, seconds


def ngram_row(ids, tokens, proposed: int, per_position: list[int], reference) -> dict:
    """One prompt's report under n-gram speculation. vLLM counts a draft only at steps whose n-gram
    was found, so its `drafts` are not the target's verify steps; those are every decode step: the
    prefill gives the first token, each later forward one token plus the drafts it accepted."""
    steps = max(len(tokens) - 1 - sum(per_position), proposed)
    return {**prompt_row(ids, tokens, steps, per_position, reference), "proposed_drafts": proposed}


def decode_plain(client: OpenAIClient, prompts, *, max_tokens: int, stop: list[int]):
    started = time.perf_counter()
    outputs = [client.complete_ids(ids, max_tokens=max_tokens, stop_token_ids=stop) for ids in prompts]
    return outputs, time.perf_counter() - started


def evaluate_served(cfg: DictConfig) -> dict:
    from transformers import AutoConfig, GenerationConfig

    from dflash_core.data import load_tokenizer
    from dflash_core.data.prompts import stop_token_ids
    from dflash_core.target.families import text_config
    from launcher.resolve import compute_dtype, dataset_paths, ensure_embedded_target, resolve_device, target_dir
    from launcher.serving.acceptance import load_prompts

    ev = cfg.evaluate
    # The HF engine's compute dtype (target.dtype on evaluate.device), so both engines compare alike.
    dtype = str(compute_dtype(cfg.target.dtype, resolve_device(ev.device, "evaluate.device"))).removeprefix("torch.")
    block_size = export_block_size(str(ev.drafter))
    if ev.endpoint is None:
        ensure_embedded_target(cfg, ev.seed)
    path = target_dir(cfg)
    template_kwargs = OmegaConf.to_container(ev.chat_template_kwargs)
    tokenizer = load_tokenizer(path)
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    max_model_len = text_config(AutoConfig.from_pretrained(path)).max_position_embeddings
    max_prompt = max_model_len - ev.max_new_tokens - block_size
    prompts, skipped = load_prompts(dataset_paths(ev.data, "evaluate.data"), tokenizer, ev.num_prompts,
                                    max_prompt_tokens=max_prompt, chat_template_kwargs=template_kwargs)
    stop = stop_token_ids(tokenizer, generation_config, template_kwargs)
    if ev.check_lossless and ev.endpoint and not ev.plain_endpoint:
        raise ConfigError(f"evaluate.endpoint={ev.endpoint!r} with evaluate.check_lossless=true needs "
                          f"evaluate.plain_endpoint (a server of the same target without speculation), "
                          f"or set evaluate.check_lossless=false")

    with _client(ev.endpoint, path, speculative_config(str(ev.drafter), block_size), ev, dtype,
                 max_model_len) as client:
        speculative, spec_s = decode_speculative(client, prompts, max_tokens=ev.max_new_tokens, stop=stop)
    references, greedy_s = [None] * len(prompts), None
    if ev.check_lossless:
        with _client(ev.plain_endpoint, path, None, ev, dtype, max_model_len) as client:
            references, greedy_s = decode_plain(client, prompts, max_tokens=ev.max_new_tokens, stop=stop)
    per_prompt = [prompt_row(ids, tokens, drafts, per_position, reference)
                  for ids, (tokens, drafts, per_position), reference in zip(prompts, speculative, references)]
    baselines = {}
    if "ngram" in ev.baselines:
        config = ngram_config(ev, block_size)
        with _client(None, path, config, ev, dtype, max_model_len) as client:
            decoded, ngram_s = decode_speculative(client, prompts, max_tokens=ev.max_new_tokens, stop=stop)
        rows = [ngram_row(ids, tokens, proposed, per_position, reference)
                for ids, (tokens, proposed, per_position), reference in zip(prompts, decoded, references)]
        baselines["ngram"] = {"speculative_config": config, "proposed_drafts": sum(r["proposed_drafts"] for r in rows),
                              **summarize(rows, config["num_speculative_tokens"] + 1, speculative_s=ngram_s,
                                          greedy_s=greedy_s)}
    return {"engine": "vllm", "endpoint": ev.endpoint or "started here", "drafter": str(ev.drafter),
            "target": str(path), "device": "vllm", "dtype": dtype, "skipped": skipped,
            "max_new_tokens": ev.max_new_tokens,
            **summarize(per_prompt, block_size, speculative_s=spec_s, greedy_s=greedy_s),
            **({"baselines": baselines} if baselines else {})}
