"""Prompts from chat datasets, shared by evaluation and regeneration: which turns form a prompt,
how it is rendered (the chat template with its generation prompt, the record's tools and the
chat_template_kwargs, exactly as training renders conversations) and which tokens stop
generation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from .records import (
    DataError,
    check_on_bad_line,
    count_bad_line,
    dataset_sources,
    read_records,
)
from .render import ChatRenderer, tokenizer_name

ANSWERED_ROLES = ("user", "tool")  # a prompt ends with a turn the assistant answers
ENCODE_CHUNK = 256  # prompts per call into the Rust tokenizer


@dataclass
class Prompt:
    index: int               # position among the answerable records, in input order
    id: object               # the record's "id", else "<file stem>-<ordinal>"
    location: str            # "<file> line 7": where an error about it points
    messages: list[dict]     # the turns the answer follows (ends with a user or tool turn)
    tools: list[dict] | None = None
    token_ids: list[int] | None = None  # the rendered prompt with the generation header


def prompt_messages(messages, drop_last_assistant: bool = True) -> list[dict] | None:
    """The turns to answer, or None when the conversation does not end with a turn to answer.

    A conversation ending with an assistant turn loses that turn (drop_last_assistant); one that
    already ends with a user or tool turn (a prompt-only record) is the prompt as it stands.
    """
    messages = list(messages)
    if drop_last_assistant and messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return messages if messages and messages[-1]["role"] in ANSWERED_ROLES else None


def iter_prompts(paths, *, drop_last_assistant: bool = True, on_bad_line: str = "fail",
                 stats: dict | None = None) -> Iterator[Prompt]:
    """Every answerable record of the datasets (see records.dataset_sources), in input order, not
    tokenised. stats counts read, bad_lines_skipped, no_conversation (preformatted text: no turns
    to tell the prompt from the answer) and no_prompt (nothing to answer)."""
    check_on_bad_line(on_bad_line)
    stats = stats if stats is not None else {}
    for key in ("read", "bad_lines_skipped", "no_conversation", "no_prompt"):
        stats.setdefault(key, 0)
    index = 0
    for path in dataset_sources(paths):
        for ordinal, (location, record) in enumerate(read_records(path, on_bad_line=on_bad_line, stats=stats)):
            messages = prompt_messages(record.messages, drop_last_assistant) if record.messages else None
            if messages is None:
                stats["no_conversation" if record.messages is None else "no_prompt"] += 1
                continue
            record_id = record.id if record.id is not None else f"{path.stem}-{ordinal}"
            yield Prompt(index, record_id, f"{path} {location}", messages, list(record.tools) if record.tools else None)
            index += 1


def encode_prompts(tokenizer, prompts: Iterable[Prompt], *, max_tokens: int, limit: int | None = None,
                   chat_template_kwargs: dict | None = None, on_bad_line: str = "fail",
                   stats: dict | None = None) -> list[Prompt]:
    """The prompts, in order, with token_ids set (rendered with the generation prompt), until
    `limit` are kept. Prompts over max_tokens are counted in stats["too_long"]; a conversation the
    template cannot render raises DataError naming its file and line, or under on_bad_line="skip"
    is counted (stats["skipped_unrenderable"])."""
    check_on_bad_line(on_bad_line)
    renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    stats = stats if stats is not None else {}
    stats.setdefault("too_long", 0)
    pending, kept = iter(prompts), []
    while limit is None or len(kept) < limit:
        chunk = list(islice(pending, ENCODE_CHUNK if limit is None else min(ENCODE_CHUNK, limit - len(kept))))
        if not chunk:
            break
        rendered = []
        for prompt in chunk:
            try:
                rendered.append((prompt, renderer.render(prompt.messages, prompt.tools, add_generation_prompt=True)))
            except Exception as err:  # noqa: BLE001 - a template may fail in any way on one conversation
                count_bad_line(prompt.location, "unrenderable", err, on_bad_line=on_bad_line, stats=stats)
        encoded = tokenizer([text for _, text in rendered], add_special_tokens=False)["input_ids"] if rendered else []
        for (prompt, _), token_ids in zip(rendered, encoded):
            if len(token_ids) > max_tokens:
                stats["too_long"] += 1
                continue
            prompt.token_ids = token_ids
            kept.append(prompt)
    return kept


def stop_token_ids(tokenizer, generation_config=None, chat_template_kwargs: dict | None = None) -> list[int]:
    """The tokens that end an answer: the tokenizer's eos, the token the chat template ends an
    assistant turn with (`<|im_end|>`, `<|eot_id|>`) and the generation config's eos ids."""
    configured = getattr(generation_config, "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])}
    if getattr(tokenizer, "chat_template", None):
        ids.add(tokenizer.convert_tokens_to_ids(ChatRenderer(tokenizer, chat_template_kwargs).end_of_turn()))
    ids -= {None, tokenizer.unk_token_id}
    if not ids:
        raise DataError(f"the tokenizer {tokenizer_name(tokenizer)} defines no eos token and no chat template: "
                        f"generation could not stop")
    return sorted(ids)
