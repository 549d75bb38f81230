"""The prompts both evaluation engines decode and the acceptance report both give (HF decoding
here, vLLM served).

Per prompt an engine gives its verify steps (drafts) and, per draft position j (0..Bs-2), how many
steps accepted the token drafted there; with greedy verification a step that accepts position j
accepted every position before it, so these counts alone give tau and the histogram of
acceptance lengths, whichever engine counted them (vLLM exposes nothing finer).
"""
from __future__ import annotations

from launcher.config import ConfigError


def load_prompts(paths, tokenizer, num_prompts: int, *, max_prompt_tokens: int,
                 chat_template_kwargs: dict | None = None) -> tuple[list[list[int]], dict]:
    """Token ids of the first num_prompts prompts that fit max_prompt_tokens: each conversation
    without its last assistant turn (prompt-only records as they are), rendered like training
    data (dflash_core.data.prompts)."""
    from dflash_core.data.prompts import encode_prompts, iter_prompts

    skipped = {}
    prompts = encode_prompts(tokenizer, iter_prompts(paths, stats=skipped), max_tokens=max_prompt_tokens,
                             limit=num_prompts, chat_template_kwargs=chat_template_kwargs, stats=skipped)
    if not prompts:
        raise ConfigError(f"evaluate.data: no usable prompt in {[str(p) for p in paths]} ({skipped})")
    return [p.token_ids for p in prompts], skipped


def per_position_from_steps(accepted: list[int], block_size: int) -> list[int]:
    """Steps' accepted draft counts -> steps that accepted draft position j, j = 0..Bs-2."""
    return [sum(a > j for a in accepted) for j in range(block_size - 1)]


def histogram(per_position: list[int], drafts: int) -> dict[str, int]:
    """{acceptance length k: steps}: k = 1 accepted nothing, k = Bs every draft token."""
    reached = [drafts, *per_position, 0]  # reached[j]: steps that accepted at least j drafts
    return {str(j + 1): reached[j] - reached[j + 1] for j in range(len(per_position) + 1)}


def first_mismatch(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def prompt_row(prompt_ids, tokens, drafts: int, per_position: list[int], reference=None) -> dict:
    """One prompt's report: `reference` is plain greedy decoding's output (None: not checked)."""
    row = {"prompt_tokens": len(prompt_ids), "generated_tokens": len(tokens), "drafts": drafts,
           "per_position": list(per_position), "target_forwards": drafts + 1, "tokens": list(tokens),
           "tau": (sum(per_position) + drafts) / drafts if drafts else None}
    if reference is not None:
        row["lossless"] = list(reference) == list(tokens)
        if not row["lossless"]:
            row["first_mismatch"] = first_mismatch(list(reference), list(tokens))
    return row


def summarize(per_prompt: list[dict], block_size: int, *, speculative_s: float, greedy_s: float | None) -> dict:
    """The engine-independent fields of an evaluation report."""
    drafts = sum(row["drafts"] for row in per_prompt)
    per_position = [sum(row["per_position"][j] for row in per_prompt) for j in range(block_size - 1)]
    generated = sum(row["generated_tokens"] for row in per_prompt)
    forwards = sum(row["target_forwards"] for row in per_prompt)
    checked = all("lossless" in row for row in per_prompt)
    return {
        "prompts": len(per_prompt), "block_size": block_size,
        # Step-weighted over all prompts: every verify step counts once, as in serving benchmarks.
        "tau": (sum(per_position) + drafts) / drafts if drafts else None,
        "histogram": histogram(per_position, drafts), "verify_steps": drafts,
        "per_position": per_position,
        "per_position_rate": [n / drafts if drafts else None for n in per_position],
        "generated_tokens": generated, "target_forwards": forwards, "tokens_per_target_forward": generated / forwards,
        "lossless": all(row["lossless"] for row in per_prompt) if checked else None,
        "speculative_s": speculative_s, "greedy_s": greedy_s if checked else None,
        "speculative_tokens_per_s": generated / speculative_s if speculative_s else None,
        "greedy_tokens_per_s": generated / greedy_s if checked and greedy_s else None,
        "per_prompt": per_prompt,
    }
