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
disk, as soon as its last turn is answered; a server that stops answering is down: the prompts it
held go back to the queue for the others (whose workers wait while any prompt is still in flight),
and it is asked again now and then and takes prompts once it answers (each change logged once).
When every server is down the run stops saying which prompts are unanswered and that the same
command resumes (parts.py); when the servers answered none of the prompts (refused them all) it
stops with their reason, writing nothing. A started
server that died is named with its log. SIGTERM and SIGINT stop the servers and say how many answers are
kept; a run that kept none leaves no parts.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
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
    saying_what_is_kept,
    template_kwargs,
)
from launcher.run_io.progress import prompt_progress
from launcher.serving.endpoint_check import check_serves_target
from launcher.serving.openai_client import OpenAIClient, RequestRefused, ServerDown

log = logging.getLogger("dflash")
_LISTED = 10   # unanswered prompts named in the error


class RegenerationIncomplete(ConnectionError):
    """Every server stopped answering with prompts left; the message says which and how to resume."""


class NothingAnswered(ConnectionError):
    """The servers answered none of the prompts (refused them all, e.g. an HTTP 404 for every chat
    request): no output is written; the message gives the servers' reason."""


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
    down: dict = field(default_factory=dict)      # url -> why it counts as down, while it does
    failed: dict = field(default_factory=dict)    # url -> why, of every server that was down at some time
    tokens: int = 0
    seconds: float = 0.0   # answering, from the first request to the last answer
    unfinished_turns: int = 0
    crashed: list = field(default_factory=list)   # an unexpected exception of a worker thread


class _Pool:
    """The prompts still to answer and the state of each server, shared by the worker threads. A
    worker takes prompts while its server is up, and waits while none is queued but some are still
    being answered elsewhere (a failing server gives them back). A server that fails a request
    (ServerDown) is down: its prompts go back to the queue, one of its workers asks its /health every
    `probe_s` seconds, and it takes prompts again once that, or a request still in flight, answers.
    Each change of a server's state is logged once. The run ends when every prompt is handled, every
    server is down, or a worker crashed."""

    def __init__(self, prompts: list[Prompt], urls: list[str], outcome: Outcome, probe_s: float):
        self.todo, self.open = deque(prompts), len(prompts)
        self.urls, self.outcome, self.probe_s = urls, outcome, probe_s
        self.probing: set[str] = set()
        self.failures: dict[int, int] = {}   # prompt index -> requests of it that made a server count as down
        self.cond = threading.Condition()

    def _over(self) -> bool:
        return bool(self.outcome.crashed) or self.open == 0 or len(self.outcome.down) == len(self.urls)

    def take(self, client: OpenAIClient) -> Prompt | None:
        """The next prompt for `client`'s server, or None when the run is over."""
        url = client.url
        while True:
            with self.cond:
                while not self._over() and (url in self.probing if url in self.outcome.down else not self.todo):
                    self.cond.wait()
                if self._over():
                    return None
                if url not in self.outcome.down:
                    return self.todo.popleft()
                self.probing.add(url)   # this worker probes its server; the others of it wait
                self.cond.wait_for(self._over, timeout=self.probe_s)
            back = not self._over() and client.healthy()
            with self.cond:
                self.probing.discard(url)
                if back:
                    self.up(url)
                self.cond.notify_all()

    def up(self, url: str) -> None:
        """`url` answered (a request or /health): it takes prompts again if it was down."""
        with self.cond:
            if self.outcome.down.pop(url, None) is not None:
                log.info("server %s is back up: it takes prompts again", url)
                self.cond.notify_all()

    def give_back(self, prompt: Prompt, url: str, why: str) -> None:
        """`url` failed `prompt`: it goes back to the queue, and the server counts as down. A prompt
        that failed more times than there are servers (one that makes every server fail, which
        would else go round them for ever) is not asked again: it counts as refused."""
        with self.cond:
            self.failures[prompt.index] = failures = self.failures.get(prompt.index, 0) + 1
            if failures > len(self.urls):
                self.outcome.refused[prompt.index] = f"it failed {failures} times, on every server (the last: {why})"
                self.open -= 1
                log.warning("%s (id %r): not answered: %s", prompt.location, prompt.id,
                            self.outcome.refused[prompt.index])
            else:
                self.todo.appendleft(prompt)
            if url not in self.outcome.down:
                self.outcome.down[url] = self.outcome.failed[url] = why
                others = len(self.urls) - len(self.outcome.down)
                log.warning("server %s is down (%s); %s", url, why,
                            f"its prompts go to the {others} other server(s) until it answers again" if others
                            else "no server is left answering")
            self.cond.notify_all()

    def done(self, prompt: Prompt, *, refused: str | None = None, conversation=None, tokens: int = 0,
             unfinished: int = 0) -> int:
        """`prompt` is handled: answered (`conversation`, None when it came back empty) or `refused`
        (the server's words); returns how many prompts were refused so far."""
        with self.cond:
            outcome = self.outcome
            if refused is not None:
                outcome.refused[prompt.index] = refused
            else:
                (outcome.answered if conversation is not None else outcome.empty).add(prompt.index)
            outcome.tokens += tokens
            outcome.unfinished_turns += unfinished
            self.open -= 1
            self.cond.notify_all()
            return len(outcome.refused)

    def crash(self, err: BaseException) -> None:
        with self.cond:
            self.outcome.crashed.append(err)
            self.cond.notify_all()


def answer_all(clients: list[OpenAIClient], prompts: list[Prompt], requests: Requests, writer: PartWriter,
               concurrency: int) -> Outcome:
    """Every prompt answered by one of the clients, each record on disk as soon as it is complete."""
    outcome, started = Outcome(), time.perf_counter()
    # A down server is asked again at the longest wait between two retries of a request.
    pool = _Pool(prompts, [client.url for client in clients], outcome,
                 probe_s=clients[0].backoff_s * 2 ** clients[0].max_retries)
    bar = prompt_progress("regenerating", total=len(prompts))

    leaving = threading.Event()   # the main thread left (a signal, an error): take no more prompts

    def work(client: OpenAIClient) -> None:
        while not leaving.is_set() and (prompt := pool.take(client)) is not None:
            try:
                conversation, tokens, unfinished = requests.converse(client, prompt)
                if conversation is not None:
                    writer.write(prompt.index, output_record(prompt, conversation))
            except RequestRefused as err:
                refusals = pool.done(prompt, refused=str(err))
                if refusals <= _LISTED:   # the rest are counted (every request may be refused alike)
                    log.warning("%s (id %r): refused, not answered: %s%s", prompt.location, prompt.id, err,
                                "; further refusals are counted, not logged" if refusals == _LISTED else "")
                continue
            except ServerDown as err:
                pool.give_back(prompt, client.url, str(err))   # another server, or this one once back, answers it
                if leaving.is_set():   # stopped by this run, not down
                    return
                continue
            except BaseException as err:  # noqa: BLE001 - raised again in the main thread
                if not leaving.is_set():   # else the run is stopping: its servers going, its writer closed
                    pool.crash(err)
                return
            pool.up(client.url)
            pool.done(prompt, conversation=conversation, tokens=tokens, unfinished=unfinished)
            with pool.cond:
                bar.set_postfix_str(f"{outcome.tokens / (time.perf_counter() - started):.1f} tokens/s", refresh=False)
                bar.update(1)

    threads = [threading.Thread(target=work, args=(client,), daemon=True, name=f"regenerate-{k}-{slot}")
               for k, client in enumerate(clients) for slot in range(concurrency)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        leaving.set()
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
    kept = len(outcome.answered) + resumed
    resume = (f"the {kept} answers finished are kept in {parts}; run the same command again (with "
              f"regenerate.resume=true, the default) to answer only those left" if kept else
              "no answer finished, so nothing is kept and there is nothing to resume: run the same command again "
              "to answer them all")
    return RegenerationIncomplete(f"{len(left)} of {len(prompts) + resumed} prompts are left unanswered (ids {named}): "
                                  f"every server stopped answering ({why}); {resume}")


def nothing_answered(outcome: Outcome, prompts: list[Prompt]) -> NothingAnswered:
    """The error when no prompt got an answer to write: how many were refused and why, how many came back empty."""
    refused = [f"{len(outcome.refused)} refused" + (f" (the first: {next(iter(outcome.refused.values()))[:300]})"
                                                    if outcome.refused else "")] if outcome.refused else []
    empty = [f"{len(outcome.empty)} answered with nothing"] if outcome.empty else []
    return NothingAnswered(f"none of the {len(prompts)} prompts got an answer: {', '.join(refused + empty)}; no "
                           f"output was written")


# ----------------------------------------------------------------------------- servers
def checked_urls(cfg: DictConfig, section: str = "regenerate") -> list[str]:
    """The URLs of <section>.endpoints (regenerate, synthesize), each an http(s) URL."""
    urls = list(cfg[section].endpoints)
    if not urls:
        raise ConfigError(f"{section}.endpoints=[]: {section}.engine=openai needs the URLs of running servers, "
                          f"e.g. {section}.endpoints=[http://127.0.0.1:8000] (or {section}.engine=vllm to start "
                          f"them here)")
    for url in urls:
        if not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"{section}.endpoints: {url!r} is not an http:// or https:// URL")
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
def started_servers(cfg: DictConfig, target: Path, section: str = "regenerate"):
    """`vllm serve` of the target (VllmServer) as <section>.* says, one per GPU group (one on CPU), ready;
    stopped on leaving."""
    import torch
    from transformers import AutoConfig

    from dflash_core.target.families import text_config
    from launcher.resolve import compute_dtype, resolve_device
    from launcher.serving.vllm_server import VllmServer

    r = cfg[section]
    device = resolve_device(r.device, f"{section}.device")
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
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def connected(urls: list[str], cfg: DictConfig, section: str = "regenerate", started=()) -> list[OpenAIClient]:
    """Clients of the servers at `urls`, each answering; one of a server in `started` (VllmServer, started
    here) stops retrying once its server is gone (its supervisor said so)."""
    r = cfg[section]
    gone = {server.url: server.gone for server in started}
    clients = [OpenAIClient(url, max_retries=r.max_retries, backoff_s=r.retry_backoff_s, timeout_s=r.request_timeout_s,
                            dead=gone.get(url)) for url in urls]
    for client in clients:
        try:
            client.connect()
        except ServerDown as err:
            raise ConfigError(f"{section}.endpoints: {client.url!r} does not answer ({err}); start the server "
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
    urls = checked_urls(cfg) if r.engine == "openai" else None
    clients = connected(urls, cfg) if urls is not None else []   # before any work: an unreachable server is named
    if r.engine == "vllm" or not r.tokenizer:
        ensure_embedded_target(cfg, seed=0)
    target = target_dir(cfg)
    tokenizer = load_tokenizer(Path(r.tokenizer) if r.tokenizer else target)
    for client in clients:   # before any prompt is sent (the servers started here serve `target`)
        check_serves_target(client, target, tokenizer, "regenerate.endpoints")
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
    outcome, deaths = Outcome(), []
    with saying_what_is_kept(part, len(done) + len(todo)):   # ended early: parts with no answer go too
        with contextlib.ExitStack() as stack:
            servers = stack.enter_context(started_servers(cfg, target)) if urls is None and todo else []
            urls = urls or [server.url for server in servers]
            if todo:
                writer = stack.enter_context(PartWriter(part))
                outcome = answer_all(connected(urls, cfg, started=servers), todo, requests, writer, r.concurrency)
            for server in servers:   # one that died on its own: its exit and its log say why, not the requests
                if server.url in outcome.down and (died := server.died()):
                    outcome.down[server.url] = "it died (below)"
                    deaths.append(died)
        if len(outcome.answered | outcome.empty | set(outcome.refused)) < len(todo):
            raise RegenerationIncomplete("\n".join([str(incomplete(outcome, todo, len(done), parts)), *deaths]))
        if not outcome.answered and not done:   # nothing to publish: no output, and no answer in the parts to keep
            raise nothing_answered(outcome, todo)
    written = merge_parts(parts, 1, len(prompts), output)
    shutil.rmtree(parts)
    counts = {"answered": len(outcome.answered), "empty": len(outcome.empty), "refused": len(outcome.refused),
              "unfinished_turns": outcome.unfinished_turns, **dropped, "resumed": len(done),
              "new_tokens": outcome.tokens}
    failed = "".join(f"; server {url} was down for a while ({why}): its prompts went to the others"
                     for url, why in outcome.failed.items())
    log.info("wrote %d records to %s (input %s; this run %s; answered in %.1fs, %.1f new tokens/s over %d servers%s)",
             written, output, stats, counts, outcome.seconds, outcome.tokens / max(outcome.seconds, 1e-9),
             len(urls or ()), failed)
    return 0
