"""DFlash 2's candidate selector and the walks that turn a block's candidates into a draft.

Per drafted slot s (block slots 1..Bs-1) the target's LM head gives the unary logits U_s; their
top-K are the slot's candidates. The selector scores a pair (a, b) of consecutive tokens:

    S_s(a, b) = U_s(b) + < A(a) * P(h_s), B(b) >

with A and B the predecessor and successor codebooks [vocab, rank], P the hidden projection
[hidden -> rank] and h_s the slot's final-normed state. The predecessors of slot 1 are the
block's anchor token (the last committed one); those of slot s > 1 are slot s-1's candidates.
Serving (vLLM 0.32, DFlash2Speculator) drafts the greedy walk through that lattice: at slot 1
the best candidate after the anchor, then at each slot the best successor of the previous pick.

Unary logits are the head's logits times `output_multiplier`, then soft-capped
(cap * tanh(x / cap)) by `final_logit_softcapping`: the order vLLM's candidate path applies them
(LogitsProcessor.get_top_k_tokens). Both are monotonic, so the top-K is the raw logits' top-K.
"""

import torch
from torch import nn


def unary_logits(logits, output_multiplier=1.0, softcap=None):
    """The head's logits [..., V] (or their top-K values) -> the unary logits, in fp32."""
    logits = logits.float() * output_multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def unary_candidates(logits, top_k, output_multiplier=1.0, softcap=None):
    """The head's logits [..., V] -> (candidate ids [..., K], their unary logits [..., K] fp32),
    best first."""
    values, ids = logits.topk(top_k, dim=-1)
    return ids, unary_logits(values, output_multiplier, softcap)


class CandidateSelector(nn.Module):
    """The selector's parameters, named as vLLM's `candidate_selector` reads them."""

    def __init__(self, hidden_size, vocab_size, rank, top_k):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def draw_codebooks(self, generator, std):
        """Predecessors ~ N(0, std); successors 0, so every pair term is 0 and the walk is the
        unary top-1 walk until training moves them."""
        self.predecessor_codebook.normal_(0.0, std, generator=generator)
        self.successor_codebook.zero_()

    def scores(self, predecessor_ids, candidate_ids, unary, hidden):
        """predecessor_ids [..., P], candidate_ids and their unary logits [..., C], hidden [..., H]
        (the slots' final-normed states) -> [..., P, C] fp32, [..., p, c] = S(predecessor p, candidate c).
        The codebooks' gradients are dense [vocab, rank] tensors of which only the rows read here are
        nonzero (what indexing's backward gives)."""
        query = self.predecessor_codebook[predecessor_ids] * self.hidden_projection(hidden).unsqueeze(-2)
        pair = query @ self.successor_codebook[candidate_ids].transpose(-1, -2)
        return unary.unsqueeze(-2).float() + pair.float()

    def pair_scores(self, candidate_ids, unary, hidden, anchor_ids):
        """candidate_ids, unary [R, S, K]: the candidates of the S drafted slots of R blocks and
        their unary logits; hidden [R, S, H]: those slots' final-normed states; anchor_ids [R]
        -> the lattice [R, S, K, K], [r, s, p, c] = S_s(predecessor p, candidate c)."""
        first = anchor_ids.view(-1, 1, 1).expand(-1, 1, candidate_ids.shape[-1])
        return self.scores(torch.cat([first, candidate_ids[:, :-1]], dim=1), candidate_ids, unary, hidden)


def greedy_walk(candidate_ids, scores):
    """What vLLM drafts at temperature 0: candidate_ids [R, S, K], the lattice [R, S, K, K] ->
    the drafted tokens [R, S]. Slot 1's predecessors are all the anchor (rows alike), so the walk
    starts from row 0; ties go to the lower candidate index (the better unary rank)."""
    rows = torch.arange(candidate_ids.shape[0], device=candidate_ids.device)
    previous = torch.zeros_like(rows)
    picks = []
    for slot in range(candidate_ids.shape[1]):
        previous = scores[rows, slot, previous].argmax(-1)
        picks.append(candidate_ids[rows, slot, previous])
    return torch.stack(picks, dim=1)


def unary_walk(candidate_ids):
    """The draft without the selector: each slot's unary top-1 ([R, S, K] -> [R, S])."""
    return candidate_ids[..., 0]
