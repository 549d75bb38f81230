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
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash_core.drafter.dflash2 import DFlash2Config
from dflash_core.serving.export import CONFIG_NAME, WEIGHTS_NAME, check_export
from launcher.config import ConfigError
from launcher.evaluate import check_fits_target
from launcher.run_io.progress import prompt_progress
from launcher.serving.acceptance import prompt_row, summarize, tie_tolerance
from launcher.serving.endpoint_check import check_serves_drafter, check_serves_target
from launcher.serving.openai_client import OpenAIClient, ServerError
from launcher.serving.vllm_server import ServerExited, VllmServer, parse_spec_counters

log = logging.getLogger("dflash")


def read_export(drafter: str):
    """A servable drafter is an export (config.json with dflash_config, model.safetensors): its
    DrafterConfig, both files read here, so a missing or broken one is named in seconds rather than
    in the log of a server that failed to start."""
    path = Path(drafter)
    if not (path / CONFIG_NAME).is_file():
        raise ConfigError(f"evaluate.drafter={drafter!r}: evaluate.engine=vllm serves an exported drafter "
                          f"(a directory with {CONFIG_NAME}), not a checkpoint; export it first (launcher.export)")
    if not (path / WEIGHTS_NAME).is_file():
        raise ConfigError(f"evaluate.drafter={drafter!r}: no {WEIGHTS_NAME} in it (an export holds {CONFIG_NAME} and "
                          f"{WEIGHTS_NAME}, as launcher.export writes them)")
    return check_export(path)


# Why a vLLM build refuses a DFlash 2 export, as its own code says (vllm/config/vllm.py, 0.32).
DFLASH2_REFUSAL_REASON = ("vLLM drafts DFlash 2 (the selector's walk through each slot's top-K) only in its V2 model "
                          "runner: its V1 runner would draft the checkpoint as plain DFlash, so it refuses it, and its "
                          "CPU build runs V2 only with a Triton that has a CPU backend, which PyPI's triton lacks")


def speculative_config(drafter: str, block_size: int) -> dict:
    """vLLM's --speculative-config for a DFlash export: one bonus query + Bs-1 mask queries."""
    return {"method": "dflash", "model": str(Path(drafter).resolve()), "num_speculative_tokens": block_size - 1}


def checked_endpoint(endpoint: str, setting: str, target: Path, tokenizer) -> OpenAIClient:
    """A client of the user's server at `endpoint`, which must serve target.path's model. It never
    retries: a completion sent again would count its drafts twice in the counters' difference."""
    client = OpenAIClient(endpoint, max_retries=0)
    try:
        client.connect()
    except ServerError as err:
        raise ConfigError(f"{setting}={endpoint!r}: no vLLM server answers there ({err})") from None
    check_serves_target(client, target, tokenizer, setting)
    return client


def ngram_config(ev: DictConfig, block_size: int) -> dict:
    """vLLM's --speculative-config for its n-gram prompt lookup: the last 2-4 tokens (by default) found
    earlier in the sequence propose the tokens that followed them there."""
    if ev.ngram_lookup_min > ev.ngram_lookup_max:
        raise ConfigError(f"evaluate.ngram_lookup_min={ev.ngram_lookup_min} exceeds "
                          f"evaluate.ngram_lookup_max={ev.ngram_lookup_max}")
    return {"method": "ngram", "num_speculative_tokens": ev.ngram_tokens or block_size - 1,
            "prompt_lookup_min": ev.ngram_lookup_min, "prompt_lookup_max": ev.ngram_lookup_max}


@contextlib.contextmanager
def _client(checked: OpenAIClient | None, target: Path, speculative: dict | None, ev, dtype: str, max_model_len: int):
    """The `checked` client of the user's server, else one of a server started here for the block."""
    if checked is not None:
        yield checked
        return
    log.info("starting vllm serve %s (%s)", target, "speculative" if speculative else "plain")
    with VllmServer(target.resolve(), speculative=speculative, dtype=dtype, max_model_len=max_model_len,
                    memory_fraction=ev.vllm_memory_fraction, extra_args=tuple(ev.vllm_args),
                    python=ev.vllm_python,
                    startup_timeout_s=ev.vllm_startup_timeout_s) as started:
        yield OpenAIClient(started.url, max_retries=0)


def decode_speculative(client: OpenAIClient, prompts, *, max_tokens: int, stop: list[int], what: str):
    """-> [(tokens, drafts, per_position, seconds decoding)] per prompt; `what` names the speculation in the
    progress bar."""
    results = []
    before = parse_spec_counters(client.metrics())
    for ids in prompt_progress(what, prompts, leave=False):
        started = time.perf_counter()
        tokens = client.complete_ids(ids, max_tokens=max_tokens, stop_token_ids=stop)
        seconds = time.perf_counter() - started
        after = parse_spec_counters(client.metrics())
        per_position = [int(after["per_position"].get(j, 0) - before["per_position"].get(j, 0))
                        for j in range(len(after["per_position"]))]
        results.append((tokens, int(after["num_drafts"] - before["num_drafts"]), per_position, seconds))
        before = after
    return results


def ngram_row(ids, tokens, proposed: int, per_position: list[int], reference, measure=None) -> dict:
    """One prompt's report under n-gram speculation. vLLM counts a draft only at steps whose n-gram
    was found, so its `drafts` are not the target's verify steps; those are every decode step: the
    prefill gives the first token, each later forward one token plus the drafts it accepted."""
    steps = max(len(tokens) - 1 - sum(per_position), proposed)
    return {**prompt_row(ids, tokens, steps, per_position, reference, measure), "proposed_drafts": proposed}


# vLLM returns log-probabilities: their difference is the logits' margin (the log-sum-exp cancels), but
# not the logits' magnitude, which sets their rounding. The tolerance is read at a top logit of 32: a
# larger one rounds coarser, so a near-tie there may read as not a tie (its margin is in the report).
SERVED_LOGIT_MAGNITUDE = 32.0
TOP_LOGPROBS = 20   # vLLM's default --max-logprobs


def served_margin(client: OpenAIClient, dtype: str):
    """The served engine's reading of a divergence (acceptance.divergence's `measure`): the plain
    server's top log-probabilities after the common prefix, in the served dtype."""
    tolerance = tie_tolerance(dtype, SERVED_LOGIT_MAGNITUDE)

    def measure(ids, plain, speculative) -> dict:
        logprobs = client.next_token_logprobs(ids, TOP_LOGPROBS)
        if plain not in logprobs or speculative not in logprobs:
            return {"margin": None, "tolerance": tolerance,
                    "why": f"the two tokens are not both among the plain server's top {TOP_LOGPROBS}"}
        return {"margin": logprobs[plain] - logprobs[speculative], "tolerance": tolerance}
    return measure


def decode_plain(client: OpenAIClient, prompts, *, max_tokens: int, stop: list[int]):
    """-> [(tokens, seconds decoding)] per prompt."""
    outputs = []
    for ids in prompt_progress("plain decoding", prompts, leave=False):
        started = time.perf_counter()
        outputs.append((client.complete_ids(ids, max_tokens=max_tokens, stop_token_ids=stop),
                        time.perf_counter() - started))
    return outputs


def evaluate_served(cfg: DictConfig) -> dict:
    """The served report of evaluate.data, one set (see evaluate_served_sets)."""
    (summary,) = evaluate_served_sets(cfg).values()
    return summary


def evaluate_served_sets(cfg: DictConfig) -> dict:
    """{set name (None: evaluate.data is one set): report}: each server (the drafter's, n-gram's, plain) started
    once and every set's prompts decoded on it, one prompt at a time."""
    from transformers import AutoConfig, GenerationConfig

    from dflash_core.data import load_tokenizer
    from dflash_core.data.prompts import stop_token_ids
    from dflash_core.target.families import text_config
    from launcher.evaluate import prompt_sets
    from launcher.resolve import compute_dtype, ensure_embedded_target, resolve_device, target_dir
    from launcher.serving.acceptance import load_prompts

    ev = cfg.evaluate
    # The HF engine's compute dtype (target.dtype on evaluate.device), so both engines compare alike.
    dtype = str(compute_dtype(cfg.target.dtype, resolve_device(ev.device, "evaluate.device"))).removeprefix("torch.")
    drafter_config = read_export(str(ev.drafter))
    block_size, dflash2 = drafter_config.block_size, isinstance(drafter_config, DFlash2Config)
    if ev.endpoint is None:
        ensure_embedded_target(cfg, ev.seed)
    path = target_dir(cfg)
    check_fits_target(ev, drafter_config, path)   # as the HF engine does, before any server starts
    if ev.check_lossless and ev.endpoint and not ev.plain_endpoint:
        raise ConfigError(f"evaluate.endpoint={ev.endpoint!r} with evaluate.check_lossless=true needs "
                          f"evaluate.plain_endpoint (a server of the same target without speculation), "
                          f"or set evaluate.check_lossless=false")
    template_kwargs = OmegaConf.to_container(ev.chat_template_kwargs)
    tokenizer = load_tokenizer(path)
    # The user's servers, checked before any prompt is sent and any server is started here.
    speculating = checked_endpoint(ev.endpoint, "evaluate.endpoint", path, tokenizer) if ev.endpoint else None
    drafter_checked = check_serves_drafter(speculating, Path(ev.drafter), block_size, "evaluate.endpoint") \
        if speculating else True   # a server started here serves evaluate.drafter
    plain = checked_endpoint(ev.plain_endpoint, "evaluate.plain_endpoint", path, tokenizer) \
        if ev.check_lossless and ev.plain_endpoint else None
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    max_model_len = text_config(AutoConfig.from_pretrained(path)).max_position_embeddings
    max_prompt = max_model_len - ev.max_new_tokens - block_size
    sets = {name: load_prompts(paths, tokenizer, ev.num_prompts, max_prompt_tokens=max_prompt,
                               chat_template_kwargs=template_kwargs) for name, paths in prompt_sets(ev).items()}
    prompts = [ids for set_prompts, _ in sets.values() for ids in set_prompts]   # every set's, in order
    stop = stop_token_ids(tokenizer, generation_config, template_kwargs)

    try:
        with _client(speculating, path, speculative_config(str(ev.drafter), block_size), ev, dtype,
                     max_model_len) as client:
            speculative = decode_speculative(client, prompts, max_tokens=ev.max_new_tokens, stop=stop,
                                             what="the drafter's speculative decoding")
    except ServerExited as exc:
        if not (dflash2 and exc.refusal):
            raise
        raise ConfigError(f"evaluate.engine=vllm: this vLLM build refuses to serve the DFlash 2 export "
                          f"{ev.drafter}: \"{exc.refusal}\" ({DFLASH2_REFUSAL_REASON}); measure it with "
                          f"evaluate.engine=hf, which decodes with the walk vLLM drafts, or serve it with a vLLM "
                          f"build whose V2 model runner runs (on a GPU)") from None
    ngram = ngram_config(ev, block_size) if "ngram" in ev.baselines else None
    if ngram:
        with _client(None, path, ngram, ev, dtype, max_model_len) as client:
            ngram_outputs = decode_speculative(client, prompts, max_tokens=ev.max_new_tokens, stop=stop,
                                               what="n-gram speculative decoding")
    # Plain decoding last: every divergence from it is read on its server.
    references, measure = [(None, 0.0)] * len(prompts), None
    summaries, start = {}, 0
    with contextlib.ExitStack() as stack:
        if ev.check_lossless:
            client = stack.enter_context(_client(plain, path, None, ev, dtype, max_model_len))
            references = decode_plain(client, prompts, max_tokens=ev.max_new_tokens, stop=stop)
            measure = served_margin(client, dtype)
        for name, (set_prompts, skipped) in sets.items():
            part = slice(start, start + len(set_prompts))
            start = part.stop
            greedy_s = sum(seconds for _, seconds in references[part]) if ev.check_lossless else None
            per_prompt = [prompt_row(ids, tokens, drafts, per_position, reference, measure)
                          for ids, (tokens, drafts, per_position, _), (reference, _) in
                          zip(set_prompts, speculative[part], references[part])]
            baselines = {}
            if ngram:
                rows = [ngram_row(ids, tokens, proposed, per_position, reference, measure)
                        for ids, (tokens, proposed, per_position, _), (reference, _) in
                        zip(set_prompts, ngram_outputs[part], references[part])]
                baselines["ngram"] = {"speculative_config": ngram,
                                      "proposed_drafts": sum(r["proposed_drafts"] for r in rows),
                                      **summarize(rows, ngram["num_speculative_tokens"] + 1,
                                                  speculative_s=_seconds(ngram_outputs[part]), greedy_s=greedy_s)}
            summaries[name] = {
                "engine": "vllm", "endpoint": ev.endpoint or "started here", "drafter": str(ev.drafter),
                "drafter_checked": drafter_checked, "target": str(path), "device": "vllm", "dtype": dtype,
                "logits_dtype": dtype,   # vLLM's head computes in the served dtype; its sampler upcasts after
                "skipped": skipped, "max_new_tokens": ev.max_new_tokens,
                "walk": "selector" if dflash2 else "unary",   # how vLLM 0.32 drafts each kind
                **summarize(per_prompt, block_size, speculative_s=_seconds(speculative[part]), greedy_s=greedy_s),
                **({"baselines": baselines} if baselines else {})}
    return summaries


def _seconds(outputs) -> float:
    return sum(output[-1] for output in outputs)
