"""`regenerate.engine=vllm|openai`: regeneration through OpenAI-compatible chat servers.

`openai` uses the servers of regenerate.endpoints (vLLM, SGLang); `vllm` starts `vllm serve` of
the target here (launcher.serving.vllm_server): one per GPU (one per --tensor-parallel-size GPUs),
or one on CPU. One process keeps regenerate.concurrency conversations in flight per server, taken
from one queue, so a faster server answers more.

Every assistant turn of a conversation is regenerated in order, each request holding the turns
regenerated before it (the data's assistant turns are never sent). Of each answer the record keeps
the content, the reasoning (the server's reasoning field, else a leading <think> block split out
of the content) as `reasoning_content`, the tool calls, and the generated token ids where the
server returns them (vLLM's `return_token_ids`). A conversation is written to the part file, on
disk, as soon as its last turn is answered; a server that stops answering leaves the prompts it
held to the others, and when none is left the run stops saying which prompts are unanswered and
that the same command resumes (parts.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from dflash_core.data.prompts import Prompt, stop_token_ids
from dflash_core.data.render import THINK_BLOCK
from launcher.config import ConfigError
from launcher.regeneration.parts import (
    PartWriter,
    every_prompt_skipped,
    load_prompts,
    merge_parts,
    open_share,
    output_record,
    parts_dir,
    prepare_parts,
    template_kwargs,
)
from launcher.serving.openai_client import OpenAIClient, RequestRefused, ServerDown

log = logging.getLogger("dflash")
_LISTED = 10   # unanswered prompts named in the error


class RegenerationIncomplete(ConnectionError):
    """Every server stopped answering with prompts left; the message says which and how to resume."""


# ----------------------------------------------------------------------------- one conversation
def _openai_message(message: dict) -> dict:
    """A record's message as a chat request carries it: tool-call arguments as JSON text, no token ids."""
    sent = {key: value for key, value in message.items() if key != "token_ids"}
    if message.get("tool_calls"):
        sent["tool_calls"] = [{"id": call.get("id", f"call_{k}"), "type": "function",
                               "function": {"name": call["function"]["name"],
                                            "arguments": json.dumps(call["function"]["arguments"])}}
                              for k, call in enumerate(message["tool_calls"])]
    return sent


def _record_tool_call(call: dict) -> dict:
    arguments = call["function"].get("arguments") or "{}"
    with contextlib.suppress(ValueError):   # not JSON: kept as text, refused by name when it is trained on
        arguments = json.loads(arguments)
    return {"type": "function", "function": {"name": call["function"]["name"], "arguments": arguments},
            **({"id": call["id"]} if call.get("id") else {})}


def assistant_turn(choice: dict, stop_ids: set[int]) -> dict:
    """The record's assistant turn from a chat completion's choice."""
    message = choice.get("message") or {}
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content") or message.get("reasoning")   # SGLang | vLLM
    if reasoning is None and (block := THINK_BLOCK.fullmatch(content)):
        reasoning, content = block[2], block[4]
    turn = {"role": "assistant", "content": content.strip()}
    if reasoning:
        turn["reasoning_content"] = reasoning.strip()
    if message.get("tool_calls"):
        turn["tool_calls"] = [_record_tool_call(call) for call in message["tool_calls"]]
    ids = choice.get("token_ids")
    if ids:
        turn["token_ids"] = list(ids[:-1] if ids[-1] in stop_ids else ids)
    return turn


@dataclass
class Requests:
    """What every chat request of the run carries besides its messages."""
    cfg: DictConfig
    stop_ids: list[int]

    def payload(self, messages: list[dict], tools, index: int) -> dict:
        r = self.cfg.regenerate
        payload = {"messages": [_openai_message(m) for m in messages], "max_tokens": r.max_new_tokens,
                   "temperature": r.temperature, "stop_token_ids": self.stop_ids, "return_token_ids": True}
        if r.temperature > 0:
            payload.update(top_p=r.top_p, seed=r.seed + index, **({"top_k": r.top_k} if r.top_k else {}))
        if tools:
            payload["tools"] = list(tools)
        if r.chat_template_kwargs:
            payload["chat_template_kwargs"] = template_kwargs(self.cfg)
        return payload

    def converse(self, client: OpenAIClient, prompt: Prompt) -> tuple[list[dict] | None, int, int]:
        """(the conversation with every assistant turn regenerated, or None when one came back empty;
        tokens generated; turns cut at max_new_tokens)."""
        history, tokens, unfinished, stops = [], 0, 0, set(self.stop_ids)
        for message in [*prompt.messages, None]:   # None: the answer after the prompt's last turn
            if message is not None and message["role"] != "assistant":
                history.append(message)
                continue
            response = client.chat(self.payload(history, prompt.tools, prompt.index))
            choice = response["choices"][0]
            turn = assistant_turn(choice, stops)
            if not (turn["content"] or turn.get("tool_calls") or turn.get("reasoning_content")):
                return None, tokens, unfinished
            tokens += (response.get("usage") or {}).get("completion_tokens") or len(turn.get("token_ids", ()))
            unfinished += choice.get("finish_reason") == "length"
            history.append(turn)
        return history, tokens, unfinished


# ----------------------------------------------------------------------------- the pool
@dataclass
class Outcome:
    answered: set = field(default_factory=set)
    empty: set = field(default_factory=set)
    refused: dict = field(default_factory=dict)   # index -> the server's words
    down: dict = field(default_factory=dict)      # url -> why it counts as down
    tokens: int = 0
    seconds: float = 0.0   # answering, from the first request to the last answer
    unfinished_turns: int = 0
    crashed: list = field(default_factory=list)   # an unexpected exception of a worker thread


def answer_all(clients: list[OpenAIClient], prompts: list[Prompt], requests: Requests, writer: PartWriter,
               concurrency: int) -> Outcome:
    """Every prompt answered by one of the clients, each record on disk as soon as it is complete."""
    from tqdm import tqdm

    pending: queue.SimpleQueue = queue.SimpleQueue()
    for prompt in prompts:
        pending.put(prompt)
    outcome, lock, started = Outcome(), threading.Lock(), time.perf_counter()
    bar = tqdm(total=len(prompts), unit=" prompts", desc="regenerating", file=sys.stderr, mininterval=1.0,
               dynamic_ncols=True)

    def work(client: OpenAIClient) -> None:
        while client.url not in outcome.down and not outcome.crashed:
            try:
                prompt = pending.get_nowait()
            except queue.Empty:
                return
            try:
                conversation, tokens, unfinished = requests.converse(client, prompt)
            except RequestRefused as err:
                with lock:
                    outcome.refused[prompt.index] = str(err)
                log.warning("%s (id %r): refused, not answered: %s", prompt.location, prompt.id, err)
                continue
            except ServerDown as err:
                pending.put(prompt)   # another server may answer it
                with lock:
                    outcome.down.setdefault(client.url, str(err))
                log.warning("server %s is down: %s", client.url, err)
                return
            except BaseException as err:  # noqa: BLE001 - raised again in the main thread
                outcome.crashed.append(err)
                return
            if conversation is not None:
                writer.write(prompt.index, output_record(prompt, conversation))
            with lock:
                (outcome.answered if conversation is not None else outcome.empty).add(prompt.index)
                outcome.tokens += tokens
                outcome.unfinished_turns += unfinished
                bar.set_postfix_str(f"{outcome.tokens / (time.perf_counter() - started):.1f} tokens/s", refresh=False)
                bar.update(1)

    threads = [threading.Thread(target=work, args=(client,), daemon=True, name=f"regenerate-{k}-{slot}")
               for k, client in enumerate(clients) for slot in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    outcome.seconds = time.perf_counter() - started
    if outcome.crashed:
        raise outcome.crashed[0]
    return outcome


def incomplete(outcome: Outcome, prompts: list[Prompt], resumed: int, parts: Path) -> RegenerationIncomplete:
    handled = outcome.answered | outcome.empty | set(outcome.refused)
    left = [p for p in prompts if p.index not in handled]
    named = ", ".join(repr(p.id) for p in left[:_LISTED]) + (", ..." if len(left) > _LISTED else "")
    why = "; ".join(f"{url}: {reason}" for url, reason in outcome.down.items())
    return RegenerationIncomplete(
        f"{len(left)} of {len(prompts) + resumed} prompts are left unanswered (ids {named}): every server stopped "
        f"answering ({why}); the {len(outcome.answered) + resumed} answers finished are kept in {parts}; "
        f"run the same command again (with regenerate.resume=true, the default) to answer only those left")


# ----------------------------------------------------------------------------- servers
def _checked_urls(cfg: DictConfig) -> list[str]:
    urls = list(cfg.regenerate.endpoints)
    if not urls:
        raise ConfigError("regenerate.endpoints=[]: regenerate.engine=openai needs the URLs of running servers, "
                          "e.g. regenerate.endpoints=[http://127.0.0.1:8000] (or regenerate.engine=vllm to start "
                          "them here)")
    for url in urls:
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"regenerate.endpoints: {url!r} is not an http:// or https:// URL")
    return [str(url) for url in urls]


def _tensor_parallel_size(args: list[str]) -> int:
    for k, arg in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and k + 1 < len(args):
                return int(args[k + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


@contextlib.contextmanager
def started_servers(cfg: DictConfig, target: Path):
    """The URLs of `vllm serve` of the target, one per GPU group (one on CPU), stopped on leaving."""
    import torch
    from transformers import AutoConfig

    from dflash_core.target.families import text_config
    from launcher.resolve import compute_dtype, resolve_device
    from launcher.serving.vllm_server import VllmServer

    r = cfg.regenerate
    device = resolve_device(r.device, "regenerate.device")
    dtype = str(compute_dtype(cfg.target.dtype, device, cpu=torch.bfloat16)).removeprefix("torch.")
    width = _tensor_parallel_size([str(a) for a in r.vllm_args])
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    groups = [",".join(map(str, range(first, first + width))) for first in range(0, gpus - width + 1, width)]
    servers = [VllmServer(target.resolve(), dtype=dtype,
                          max_model_len=text_config(AutoConfig.from_pretrained(target)).max_position_embeddings,
                          memory_fraction=r.vllm_memory_fraction, extra_args=tuple(r.vllm_args), python=r.vllm_python,
                          startup_timeout_s=r.vllm_startup_timeout_s,
                          env={"CUDA_VISIBLE_DEVICES": group} if group else None) for group in groups or [None]]
    try:
        for server in servers:   # they load side by side
            server.launch()
        log.info("started %d vllm serve of %s (logs %s)", len(servers), target,
                 ", ".join(str(s.log_path) for s in servers))
        yield [server.wait_ready().url for server in servers]
    finally:
        for server in servers:
            server.stop()


def connected(urls: list[str], cfg: DictConfig) -> list[OpenAIClient]:
    r = cfg.regenerate
    clients = [OpenAIClient(url, max_retries=r.max_retries, backoff_s=r.retry_backoff_s, timeout_s=r.request_timeout_s)
               for url in urls]
    for client in clients:
        try:
            client.connect()
        except ServerDown as err:
            raise ConfigError(f"regenerate.endpoints: {client.url!r} does not answer ({err}); start the server "
                              f"there or correct the URL") from None
    return clients


# ----------------------------------------------------------------------------- the job
def run_served(cfg: DictConfig) -> int:
    from transformers import GenerationConfig

    from dflash_core.data import load_tokenizer
    from launcher.resolve import ensure_embedded_target, target_dir

    r = cfg.regenerate
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"regenerate.engine={r.engine!r}: one process spreads the prompts over the servers; "
                          f"start it with python -m launcher.regenerate, not torchrun")
    urls = _checked_urls(cfg) if r.engine == "openai" else None
    if urls is not None:
        connected(urls, cfg)   # before any work: an unreachable server is named at once
    if r.engine == "vllm" or not r.tokenizer:
        ensure_embedded_target(cfg, seed=0)
    target = target_dir(cfg)
    tokenizer = load_tokenizer(Path(r.tokenizer) if r.tokenizer else target)
    try:
        generation = GenerationConfig.from_pretrained(target)
    except OSError:   # a tokenizer directory alone: the tokenizer's and the template's stops
        generation = None
    requests = Requests(cfg, stop_token_ids(tokenizer, generation, template_kwargs(cfg)))

    output, parts = Path(r.output).resolve(), parts_dir(cfg)
    prepare_parts(cfg, parts, 1)
    prompts, stats = load_prompts(cfg)
    part, done, todo, dropped = open_share(cfg, tokenizer, prompts, parts, 0)
    if not todo and not done:
        shutil.rmtree(parts, ignore_errors=True)
        raise every_prompt_skipped(cfg, stats, [dropped])
    if done:
        log.info("resuming: %d prompts answered before, %d left", len(done), len(todo))
    outcome = Outcome()
    with contextlib.ExitStack() as stack:
        if urls is None and todo:
            urls = stack.enter_context(started_servers(cfg, target))
        if todo:
            writer = stack.enter_context(PartWriter(part))
            outcome = answer_all(connected(urls, cfg), todo, requests, writer, r.concurrency)
    if outcome.down and len(outcome.answered | outcome.empty | set(outcome.refused)) < len(todo):
        raise incomplete(outcome, todo, len(done), parts)
    written = merge_parts(parts, 1, len(prompts), output)
    shutil.rmtree(parts)
    counts = {"answered": len(outcome.answered), "empty": len(outcome.empty), "refused": len(outcome.refused),
              "unfinished_turns": outcome.unfinished_turns, **dropped, "resumed": len(done),
              "new_tokens": outcome.tokens}
    log.info("wrote %d records to %s (input %s; this run %s; answered in %.1fs, %.1f new tokens/s over %d servers)",
             written, output, stats, counts, outcome.seconds, outcome.tokens / max(outcome.seconds, 1e-9),
             len(urls or ()))
    return 0
