"""The drafter's mask token: the id its masked block slots carry, read from the target's tokenizer and config.

Serving engines read it from the export's `dflash_config.mask_token_id` and embed it with the target's
own table, so any id below the target's vocab_size serves; for training it should be an id the data
never holds, else a masked slot looks like a real token. In order of preference:
  1. the first embedding row no token maps to (the table is padded past the tokenizer: Qwen3's 151669);
  2. on a full table (tokenizer size == vocab_size, e.g. SmolLM2), the lowest special token of the
     tokenizer that nothing uses: not bos/eos/pad/unk (the tokenizer's or the config's) and not named in
     the chat template (Llama 3's <|reserved_special_token_0|>, 128002, as the public DFlash drafter uses;
     SmolLM2's <repo_name>, whose code-corpus markers no chat holds);
  3. otherwise none: MaskTokenError names candidates for the user to choose from.
"""
from __future__ import annotations

import itertools

from .families import TargetError, text_config

# The candidates a MaskTokenError shows when no special token is free: the vocabulary's last ids, a
# BPE's last (rarest) merges.
_SHOWN = 5


class MaskTokenError(TargetError):
    """No id is free for the mask token; `candidates` are (id, token) pairs the user may choose from."""

    def __init__(self, message: str, candidates: list[tuple[int, str]]):
        super().__init__(message)
        self.candidates = candidates


def first_unused_token_id(tokenizer, config) -> int | None:
    """The first embedding row no token maps to, or None when the tokenizer fills the table."""
    token_id, vocab_size = len(tokenizer), text_config(config).vocab_size
    return token_id if token_id < vocab_size else None


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _in_use(tokenizer, config) -> set[int]:
    """Special token ids the data or decoding use: bos/eos/pad/unk of the tokenizer and the configs, and
    every special token the chat template names."""
    used = set()
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id"):
        used |= _ids(getattr(tokenizer, attribute, None))
    for part in (config, text_config(config)):
        for attribute in ("bos_token_id", "eos_token_id", "pad_token_id"):
            used |= _ids(getattr(part, attribute, None))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    used |= {token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.content in template}
    return used


def choose_mask_token(tokenizer, config) -> tuple[int, str]:
    """(mask token id, why that one), by the module's order of preference; MaskTokenError if none is free."""
    vocab_size = text_config(config).vocab_size
    unused = first_unused_token_id(tokenizer, config)
    if unused is not None:
        return unused, f"the first embedding row no token maps to (the tokenizer has {len(tokenizer)} tokens, " \
                       f"vocab_size is {vocab_size})"
    used = _in_use(tokenizer, config)
    free = sorted(token_id for token_id, token in tokenizer.added_tokens_decoder.items()
                  if token.special and token_id < vocab_size and token_id not in used)
    if free:
        token = tokenizer.added_tokens_decoder[free[0]].content
        return free[0], (f"{token!r}, the tokenizer's first special token that neither the chat template nor "
                         f"bos/eos/pad/unk uses (the tokenizer fills all {vocab_size} embedding rows)")
    added = tokenizer.added_tokens_decoder
    merges = itertools.islice((token_id for token_id in range(vocab_size - 1, -1, -1) if token_id not in added), _SHOWN)
    candidates = [(token_id, tokenizer.convert_ids_to_tokens(token_id)) for token_id in merges]
    specials = sum(token.special for token in added.values())
    raise MaskTokenError(
        f"the tokenizer fills all {vocab_size} embedding rows and each of its {specials} special tokens is "
        f"in use (bos/eos/pad/unk or the chat template): no id is free for the mask token; choose one whose token "
        f"your data never holds, e.g. one of the vocabulary's last merges: "
        + ", ".join(f"{token_id} {token!r}" for token_id, token in candidates), candidates)
