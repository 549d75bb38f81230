"""Conversations -> the tokenizer's chat template rendering and the exact character span of
every assistant turn in it.

Why not prefixes: rendering messages[:k] with the generation prompt and taking its length as the
start of assistant turn k only works when the template renders every turn the same whatever
follows it. Real templates rewrite history: Qwen3's drops the <think> block of assistant turns
before the last user query, so the prefix rendering of a tool-calling turn (which still has its
reasoning) is not a prefix of the full rendering (which no longer has it).

How spans are found here: the full conversation is rendered once; it is the training text.
It is rendered again with every assistant turn's own fields (content, reasoning, tool-call
arguments) replaced by a sentinel, a private-use character that occurs nowhere in the text, one
per turn. Apart from the fields, the two renderings are the same template text: the probe cut
at its sentinels gives the template text between one turn's fields and the next turn's, and
where those pieces lie in the full text delimits what each turn's fields produced there,
wherever the template put them and however it rewrote them (strip, `tojson`, a `<think>` block
split out of the content). A piece is looked up forwards (its first occurrence after the
previous one) and backwards (its last occurrence before the next one); the true place lies
between the two, so when they agree it is certain. When they do not (a turn's own text holds the
template text that follows it, as in gpt-oss-style turns of several channel segments), each
turn is probed alone: the conversation is rendered with only that turn's fields replaced, and
the two renderings' common prefix and suffix delimit the turn's fields (one rendering per turn,
where the fast path needs two in all).
Replacements keep what templates branch on: empty fields stay empty (an empty content of a
tool-calling turn is not replaced), a `<think>` block inside a content keeps its tags.

The span then starts right after the nearest generation header before the turn's fields (the
text add_generation_prompt=True appends, e.g. `<|im_start|>assistant\n`, rendered with and
without chat_template_kwargs: a Qwen3 header with enable_thinking=false includes an empty think
block that earlier turns do not have) and ends with the first special token after them, the end
of turn (`<|im_end|>`, `<|eot_id|>`; special tokens inside a turn, such as gpt-oss channel
markers, lie before its last field). So everything the template writes for the turn after its
header (think block, content, tool-call wrapper, end-of-turn token) is supervised and nothing of
another message. Tool-call names are not replaced: some templates repeat them in the tool output
that follows (gpt-oss), which would stretch the turn into that message.

An assistant turn that carries `token_ids` (the ids the target generated for it, written by
launcher.regenerate) is trained on those ids instead of its text's re-tokenisation, which can
differ (a word split otherwise than the target chose), where they agree with the template: the
turn's tokens begin exactly at the span's start, the span ends with one special token, and the
ids decode to exactly the text the template rendered before it (splice_generated_ids). Otherwise
(e.g. a template that drops an earlier turn's reasoning) the rendered text is tokenised as usual.

A template that cannot render the conversation, leaves a turn out, or gives no header before or
no special token after a turn raises ValueError naming the turn; the caller reports it as a bad
line. Reasoning is passed as `reasoning_content` and as `thinking` (gpt-oss templates read
that); a template with no place for reasoning (Llama 3) drops it: put it in the content then.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import islice

import numpy as np

from .records import DataError, Record

SENTINELS = range(0xE000, 0xF900)  # Unicode private-use characters: no template writes them
THINK_BLOCK = re.compile(r"(\s*<think>\s*)(.*?)(\s*</think>\s*)(.*)", re.DOTALL)
_PROBE = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"})


def tokenizer_name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__


def template_messages(messages) -> list[dict]:
    """Messages as chat templates read them: reasoning under both names templates use, no token ids."""
    bare = [{key: value for key, value in m.items() if key != "token_ids"} for m in messages]
    return [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in bare]


def generated_ids(record: Record, last_turn_only: bool = False) -> list[list[int] | None]:
    """The `token_ids` of each assistant turn (None where it has none), as conversation() gives spans."""
    turns = [m.get("token_ids") for m in record.messages if m["role"] == "assistant"]
    return turns[-1:] if last_turn_only else turns


def splice_generated_ids(text: str, spans: list[tuple[int, int]], generated: list[list[int] | None],
                         ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray,
                         decode: Callable[[list[int]], str]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The tokenised conversation with each assistant span's tokens before its end-of-turn token
    replaced by the turn's generated ids, where they agree with the template (module docstring).

    ids, mask: the rendering's tokens and loss mask; offsets: int64 [T, 2] their character spans;
    decode: ids -> text, special tokens kept. Returns (ids, mask, turns spliced, turns whose ids
    disagree and were left to the text)."""
    spliced = disagreeing = 0
    for (start, end), new in reversed(list(zip(spans, generated))):   # from the last: earlier indices hold
        if not new:
            continue
        inside = np.flatnonzero((offsets[:, 1] > start) & (offsets[:, 0] < end))
        first, last = (int(inside[0]), int(inside[-1])) if len(inside) else (0, -1)
        new = list(new[:-1] if last >= 0 and new[-1] == ids[last] else new)   # the stop token kept with the ids
        if last < 0 or offsets[first, 0] != start or offsets[last, 1] != end or \
                decode(new) != text[start:offsets[last, 0]]:
            disagreeing += 1
            continue
        ids = np.concatenate([ids[:first], np.asarray(new, ids.dtype), ids[last:]])
        mask = np.concatenate([mask[:first], np.ones(len(new), mask.dtype), mask[last:]])
        spliced += 1
    return ids, mask, spliced, disagreeing


def _sentinel_text(text: str, sentinel: str) -> str:
    """The sentinel in place of a content, keeping a leading <think> block's tags and emptiness."""
    block = THINK_BLOCK.fullmatch(text)
    if block is None:
        return sentinel
    return block[1] + (sentinel if block[2] else "") + block[3] + (sentinel if block[4] else "")


def _with_sentinel(message: dict, sentinel: str) -> dict:
    """The message with the fields the template prints for it replaced by the sentinel."""
    probe = dict(message)
    if message["content"] or not message.get("tool_calls"):  # a turn without tool calls needs its content as anchor
        probe["content"] = _sentinel_text(message["content"], sentinel)
    if message.get("reasoning_content"):
        probe["reasoning_content"] = sentinel
    if message.get("tool_calls"):
        probe["tool_calls"] = [
            {**call, "function": {**call["function"],
                                  "arguments": {key: sentinel for key in call["function"]["arguments"]}
                                  or {sentinel: sentinel}}}
            for call in message["tool_calls"]]
    return probe


def _regions_at_once(full: str, probe: str, sentinels: list[str]) -> list[tuple[int, int]] | None:
    """Each turn's [first, last) field characters in `full`, from one probe holding every turn's
    own sentinel; None when that is not certain.

    The probe cut at its sentinels gives the template text before the first turn, between turns
    and after the last. Each piece between turns is looked up in `full` twice: its first
    occurrence after the previous piece, and its last occurrence before the next one (going
    backwards from the end). The true position lies between the two, so when they agree for
    every piece, it is that one; when not, a turn's own text holds the piece that follows it.
    """
    marks = [(probe.find(s), probe.rfind(s) + 1) for s in sentinels]
    cuts = [0, *(at for mark in marks for at in mark), len(probe)]
    if any(first < 0 for first, _ in marks) or cuts != sorted(cuts):  # a turn not rendered, or turns interleaved
        return None
    pieces = [probe[cuts[i]:cuts[i + 1]] for i in range(0, len(cuts), 2)]
    head, between, tail = pieces[0], pieces[1:-1], pieces[-1]
    if not (full.startswith(head) and full.endswith(tail)) or len(head) + len(tail) > len(full):
        return None
    forward, at = [], len(head)
    for piece in between:
        at = full.find(piece, at)
        if at < 0:
            return None
        forward.append(at)
        at += len(piece)
    backward, at = [], len(full) - len(tail)
    for piece in reversed(between):
        at = full.rfind(piece, 0, at)
        backward.insert(0, at)
    if forward != backward:
        return None
    return list(zip([len(head)] + [at + len(piece) for at, piece in zip(forward, between)],
                    forward + [len(full) - len(tail)]))


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
        try:
            bare, prompted = (self.render(_PROBE[:1], add_generation_prompt=flag, kwargs=kwargs)
                              for flag in (False, True))
        except Exception as err:  # whatever the template raises here, it can render no conversation
            raise DataError(f"the chat template of tokenizer {tokenizer_name(self.tokenizer)} cannot render a "
                            f"one-message conversation with chat_template_kwargs={kwargs}: "
                            f"{type(err).__name__}: {err}") from err
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
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        turns = turns[-1:] if last_turn_only else turns
        if not turns:
            return full, []
        used = set(full)  # the first unused private-use characters, found without walking the whole range
        sentinels = list(islice((c for c in map(chr, SENTINELS) if c not in used), len(turns)))
        if len(sentinels) < len(turns):
            raise ValueError("the conversation uses nearly every Unicode private-use character; no sentinel is left")
        probes = list(messages)
        for k, sentinel in zip(turns, sentinels):
            probes[k] = _with_sentinel(messages[k], sentinel)
        regions = _regions_at_once(full, self.render(probes, record.tools), sentinels)
        if regions is None:
            regions = [self._region_alone(full, record, k, sentinel) for k, sentinel in zip(turns, sentinels)]
        spans, floor = [], 0
        for k, (first, last) in zip(turns, regions):
            spans.append((self._turn_start(full, floor, first, k), self._turn_end(full, last, k)))
            floor = spans[-1][1]
        return full, spans

    def _region_alone(self, full: str, record: Record, k: int, sentinel: str) -> tuple[int, int]:
        """Turn k's [first, last) field characters in `full`, from a probe of that turn alone."""
        messages = list(record.messages)
        probe = self.render(messages[:k] + [_with_sentinel(messages[k], sentinel)] + messages[k + 1:], record.tools)
        if probe == full:
            raise ValueError(f"the chat template does not render assistant turn {k}")
        first = _common_prefix(full, probe)
        return first, len(full) - _common_suffix(full, probe, min(len(full), len(probe)) - first)

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
