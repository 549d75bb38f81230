"""The prompts both evaluation engines decode and the acceptance report both give (HF decoding
here, vLLM served).

Per prompt an engine gives its verify steps (drafts) and, per draft position j (0..Bs-2), how many
steps accepted the token drafted there; with greedy verification a step that accepts position j
accepted every position before it, so these counts alone give tau and the histogram of
acceptance lengths, whichever engine counted them (vLLM exposes nothing finer).
"""
from __future__ import annotations

import math

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


NEAR_TIE, NOT_A_TIE = "near-tie", "not a tie"
# Greedy verification and plain decoding compute the same logits with other GEMM shapes (a block of Bs
# tokens, one token), so they sum in other orders and round differently: two logits a few units in the
# last place (ULPs) of the compute dtype apart at their magnitude may be ordered either way. In bf16 and
# fp16 the hidden states' rounding to the dtype dominates and a margin moves by about one ULP; in fp32
# the summation order itself moves it by ten or so, more as the hidden size grows (docs/perf_notes.md,
# Near-ties). Each count keeps room above what was measured; a wider margin is a preference rounding
# cannot flip, so speculation changed it: a bug.
NEAR_TIE_ULPS = {"bfloat16": 4, "float16": 4, "float32": 64}


def tie_tolerance(dtype: str, magnitude: float) -> float:
    """The widest margin between two logits of about `magnitude` that is still a near-tie in `dtype`
    (torch's name: bfloat16, float16, float32): NEAR_TIE_ULPS units in the last place there."""
    import torch
    finfo = torch.finfo(getattr(torch, dtype))
    return NEAR_TIE_ULPS[dtype] * finfo.eps * 2.0 ** math.floor(math.log2(max(abs(magnitude), finfo.tiny)))


def divergence(prompt_ids, reference: list[int], tokens: list[int], measure) -> dict:
    """Where speculative `tokens` first leave plain greedy decoding's `reference`, and why: the plain
    run's token and the speculative run's there, and `measure(ids, plain_token, speculative_token)`,
    the engine's reading of the plain target after `ids` (the prompt and the common prefix), a dict
    with `margin` (plain logit of the plain token minus that of the speculative token; None, saying
    `why`, when it cannot be read) and `tolerance` (tie_tolerance at their magnitude), and maybe more.
    The verdict is a near-tie when the margin is within the tolerance."""
    position = first_mismatch(reference, tokens)
    plain, speculative = (seq[position] if position < len(seq) else None for seq in (reference, tokens))
    record = {"position": position, "plain_token": plain, "speculative_token": speculative}
    if plain is None or speculative is None:   # no two candidates to weigh
        return {**record, "margin": None, "why": "one output ends here", "verdict": NOT_A_TIE}
    record.update(measure([*prompt_ids, *reference[:position]], plain, speculative))
    tie = record["margin"] is not None and abs(record["margin"]) <= record["tolerance"]
    return {**record, "verdict": NEAR_TIE if tie else NOT_A_TIE}


def prompt_row(prompt_ids, tokens, drafts: int, per_position: list[int], reference=None, measure=None) -> dict:
    """One prompt's report: `reference` is plain greedy decoding's output (None: not checked); an
    output that differs from it gets its `divergence`, read by `measure` (see divergence)."""
    row = {"prompt_tokens": len(prompt_ids), "generated_tokens": len(tokens), "drafts": drafts,
           "per_position": list(per_position), "target_forwards": drafts + 1, "tokens": list(tokens),
           "tau": (sum(per_position) + drafts) / drafts if drafts else None}
    if reference is not None:
        row["lossless"] = list(reference) == list(tokens)
        if not row["lossless"]:
            row["divergence"] = divergence(prompt_ids, list(reference), list(tokens), measure)
    return row


def divergence_counts(per_prompt: list[dict]) -> dict[str, int]:
    """Prompts decoded identically to plain greedy decoding, diverged at a near-tie, diverged otherwise."""
    verdicts = [row["divergence"]["verdict"] for row in per_prompt if "divergence" in row]
    return {"identical": len(per_prompt) - len(verdicts), "near_ties": verdicts.count(NEAR_TIE),
            "not_ties": verdicts.count(NOT_A_TIE)}


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
        **({"lossless_counts": divergence_counts(per_prompt)} if checked else {}),
        "speculative_s": speculative_s, "greedy_s": greedy_s if checked else None,
        "speculative_tokens_per_s": generated / speculative_s if speculative_s else None,
        "greedy_tokens_per_s": generated / greedy_s if checked and greedy_s else None,
        "per_prompt": per_prompt,
    }
