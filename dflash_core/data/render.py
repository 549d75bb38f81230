"""Conversations -> the tokenizer's chat template rendering and the exact character span of
every assistant turn in it.

Why not prefixes: rendering messages[:k] with the generation prompt and taking its length as the
start of assistant turn k only works when the template renders every turn the same whatever
follows it. Real templates rewrite history: Qwen3's drops the <think> block of assistant turns
before the last user query, so the prefix rendering of a tool-calling turn (which still has its
reasoning) is not a prefix of the full rendering (which no longer has it).

How spans are found here: the full conversation is rendered once; it is the training text.
For each assistant turn the conversation is rendered again with that turn's own fields
(content, reasoning, tool-call arguments) replaced by a sentinel character that occurs nowhere
in the text. The two renderings share a prefix and a suffix; what lies between them in the full
text is what the turn's fields produced, wherever the template put them and however it
rewrote them (strip, `tojson`, a `<think>` block split out of the content). The span then
starts right after the nearest generation header before that region (the text
add_generation_prompt=True appends, e.g. `<|im_start|>assistant\\n`, rendered with and without
chat_template_kwargs: a Qwen3 header with enable_thinking=false includes an empty think block
that earlier turns do not have) and ends with the first special token after it, the end of turn
(`<|im_end|>`, `<|eot_id|>`; special tokens inside a turn, such as gpt-oss channel markers, lie
before the last field). So everything the template writes for the turn after its header (think
block, content, tool-call wrapper, end-of-turn token) is supervised and nothing of another
message. Tool-call names are not replaced: some templates repeat them in the tool output that
follows (gpt-oss), which would stretch the region into that message.

A template that cannot render the conversation, leaves a turn out, or gives no header before or
no special token after a turn raises ValueError naming the turn; the caller reports it as a bad
line. Reasoning is passed as `reasoning_content` and as `thinking` (gpt-oss templates read
that); a template with no place for reasoning (Llama 3) drops it: put it in the content then.
"""

from __future__ import annotations

import re

from .records import DataError, Record

SENTINELS = "\ue000\ue001\ue002\ue003"  # Unicode private-use characters: no template writes them
_PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


def tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def template_messages(messages) -> list[dict]:
    """Messages as chat templates read them: reasoning under both names templates use."""
    return [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else dict(m) for m in messages]


def _with_sentinel(message: dict, sentinel: str) -> dict:
    """The message with every field the template prints for it replaced by the sentinel."""
    probe = {**message, "content": sentinel}
    if message.get("reasoning_content"):
        probe["reasoning_content"] = sentinel
    if message.get("tool_calls"):
        probe["tool_calls"] = [
            {**call, "function": {**call["function"],
                                  "arguments": {key: sentinel for key in call["function"]["arguments"]}
                                  or {sentinel: sentinel}}}
            for call in message["tool_calls"]]
    return probe


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix(a: str, b: str, limit: int) -> int:
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        if a[len(a) - middle:] == b[len(b) - middle:]:
            low = middle
        else:
            high = middle - 1
    return low


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template and chat_template_kwargs."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"tokenizer {tokenizer_name(tokenizer)} has no chat template; conversations cannot be "
                            f"rendered (set tokenizer.chat_template or use preformatted {{\"text\"}} records)")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r}")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len,
                          reverse=True)
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.headers = tuple(dict.fromkeys(self._generation_header(kwargs) for kwargs in (self.kwargs, {})))

    def render(self, messages, tools=None, *, add_generation_prompt: bool = False, kwargs: dict | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            template_messages(messages), tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=add_generation_prompt, **(self.kwargs if kwargs is None else kwargs))

    def _generation_header(self, kwargs: dict) -> str:
        bare, prompted = (self.render(_PROBE[:1], add_generation_prompt=flag, kwargs=kwargs) for flag in (False, True))
        if not prompted.startswith(bare) or prompted == bare:
            raise DataError(f"the chat template of tokenizer {tokenizer_name(self.tokenizer)} appends no generation "
                            f"prompt for add_generation_prompt=True; assistant turns cannot be located")
        return prompted[len(bare):]

    def end_of_turn(self) -> str:
        """The special token that ends a plain assistant turn (e.g. `<|im_end|>`)."""
        text, spans = self.conversation(Record(messages=_PROBE))
        return next(m.group() for m in self._special.finditer(text) if m.end() == spans[-1][1])

    def conversation(self, record: Record, last_turn_only: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the [start, end) character span of each assistant turn
        (only the last one with last_turn_only). ValueError when a turn cannot be located."""
        messages = list(record.messages)
        full = self.render(messages, record.tools)
        sentinel = next((c for c in SENTINELS if c not in full), None)
        if sentinel is None:
            raise ValueError(f"the conversation contains all of the sentinel characters {SENTINELS!r}")
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        spans, floor = [], 0
        for k in turns[-1:] if last_turn_only else turns:
            probe = self.render(messages[:k] + [_with_sentinel(messages[k], sentinel)] + messages[k + 1:], record.tools)
            if probe == full:
                raise ValueError(f"the chat template does not render assistant turn {k}")
            first = _common_prefix(full, probe)
            last = len(full) - _common_suffix(full, probe, min(len(full), len(probe)) - first)
            spans.append((self._turn_start(full, floor, first, k), self._turn_end(full, last, k)))
            floor = spans[-1][1]
        return full, spans

    def _turn_start(self, full: str, floor: int, first: int, k: int) -> int:
        ends = [at + len(header) for header in self.headers if (at := full.rfind(header, floor, first)) >= 0]
        if not ends:
            raise ValueError(f"no assistant header {' or '.join(map(repr, self.headers))} before the text of "
                             f"assistant turn {k} (at character {first})")
        return max(ends)

    def _turn_end(self, full: str, last: int, k: int) -> int:
        match = self._special.search(full, last) if self._special is not None else None
        if match is None:
            raise ValueError(f"no special token (end of turn) follows assistant turn {k}")
        return match.end()
