"""DFlash 2's selector term: a K-way cross-entropy over each drafted slot's unary top-K, scored with the
teacher-forced predecessor, and the walks held-out evaluation measures with the selector.

At drafted slot s of a block whose true tokens are y_0 (the anchor) .. y_{Bs-1}, the selector scores
each candidate c among the unary top-K with the true previous token as predecessor:

    S_s(y_{s-1}, c) = U_s(c) + < A(y_{s-1}) * P(h_s), B(c) >      (selector.py)

and the term is -log softmax over the candidates of S_s(y_{s-1}, y_s). Where y_s is not among the K
it joins this softmax as a (K+1)-th candidate, so the loss still pulls it up; it never joins the
drafted set (what the walks and the selector's accuracy read), which is the top-K alone. The term
carries the unary term's position weights (DFlash's exponential decay, or D-PACE's), so both sums
share one normaliser, and `drafter.selector_weight` scales it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..drafter.selector import greedy_walk, unary_logits


class SelectorTerms(NamedTuple):
    ce: torch.Tensor        # [B, N, S] fp32: the teacher-forced K-way cross-entropy (with its graph)
    recalled: torch.Tensor  # [B, N, S] bool: the label is among the unary top-K
    picked: torch.Tensor    # [B, N, S] bool: the selector's best candidate after the true predecessor is the label


def selector_terms(drafter, hidden, candidate_logits, candidate_ids, predecessor_ids, *, detach=False):
    """hidden [B, N, S, H] (the drafted slots' final-normed states); candidate_logits, candidate_ids
    [B, N, S, K + 1] (head_loss's: the head's top-K then the label); predecessor_ids [B, N, S] (the
    true previous tokens, the anchor's for the first drafted slot) -> SelectorTerms. detach: the
    term's gradient stops at the backbone (hidden and the unary logits), so it trains the selector
    alone."""
    cfg = drafter.config
    k = cfg.selector_top_k
    if detach:
        hidden, candidate_logits = hidden.detach(), candidate_logits.detach()
    unary = unary_logits(candidate_logits, cfg.output_multiplier, cfg.final_logit_softcapping)
    scores = drafter.teacher_forced_scores(predecessor_ids, candidate_ids, unary, hidden)
    found = candidate_ids[..., :k] == candidate_ids[..., k:]
    recalled = found.any(-1)
    target = torch.where(recalled, found.int().argmax(-1), k)
    # The label's own column duplicates one of the K where it is among them: out of the softmax there.
    scores = scores.masked_fill(torch.cat([torch.zeros_like(found), recalled.unsqueeze(-1)], dim=-1), float("-inf"))
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    picked = recalled & (scores[..., :k].argmax(-1) == target)
    return SelectorTerms(ce, recalled, picked.detach())


def leading(hits, supervised):
    """[..., S] hits at the drafted slots -> [...] accepted slots: the leading hits (greedy verification)."""
    return torch.cumprod((hits & supervised).long(), dim=-1).sum(dim=-1)


@torch.no_grad()
def selector_walk_hits(drafter, hidden, candidate_logits, candidate_ids, anchor_ids, labels):
    """What serving drafts (vLLM 0.32's greedy walk through the pair-score lattice of the unary top-K,
    from the anchor token) checked against the labels: hidden [B, N, S, H], candidate_* [B, N, S, K + 1]
    (the label's column is not a candidate here), anchor_ids [B, N], labels [B, N, S] -> bool [B, N, S]."""
    cfg = drafter.config
    k, (batch, blocks, slots) = cfg.selector_top_k, labels.shape
    ids = candidate_ids[..., :k].flatten(0, 1)
    unary = unary_logits(candidate_logits[..., :k], cfg.output_multiplier, cfg.final_logit_softcapping).flatten(0, 1)
    scores = drafter.lattice(ids, unary, hidden.flatten(0, 1), anchor_ids.flatten())
    return greedy_walk(ids, scores).view(batch, blocks, slots) == labels
