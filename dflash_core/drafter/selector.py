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

Two pieces exist for speed at full vocabularies (issue 43; figures in docs/perf_notes.md): `top_candidates`
takes the top-K on CUDA without a radix select over every entry, and `CodebookRows` gathers codebook
rows with a backward that adds into the gradient by atomics instead of sorting the ids.
"""

import torch
from torch import nn


def unary_logits(logits, output_multiplier=1.0, softcap=None):
    """The head's logits [..., V] (or their top-K values) -> the unary logits, in fp32."""
    logits = logits.float() * output_multiplier
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


# Entries per segment of `segmented_topk`: a power of two divides the common vocabularies (Qwen3's 151,936,
# Llama 3's 128,256, gpt-oss's 201,088, Qwen3.5's 248,320 are multiples of 128). scripts/selector_bench.py
# times it against other widths and torch.topk.
CANDIDATE_SEGMENT_WIDTH = 128


def segmented_topk(logits, k, width):
    """logits [..., V], V a multiple of `width` with at least k segments -> (values, ids) [..., k]: the
    values of logits.topk(k, dim=-1) exactly, best first, and ids holding them.

    The row is cut into V / width segments of `width` entries. Every top-k entry lies in one of the k
    segments with the largest maxima: a segment outside those has k segments above it, each holding an entry
    at least as large. So one max per segment (a bandwidth-bound read), a top-k over those maxima, and a
    top-k over the k chosen segments' k x width entries give the row's top-k, where torch's radix select
    passes over all V entries several times.

    The ids are topk's wherever the k-th value is not tied with an entry left out (each is then the one entry
    holding its value's rank). At such a tie both keep some of the tied entries, each by its top-k's rule; the
    chosen segments are laid out in index order, so where the inner top-ks keep the lowest indices among ties
    (CUDA's radix select does), this keeps the lowest too, as torch.topk on CUDA does. Equal values come in
    no promised order, as in torch.topk."""
    segments = logits.unflatten(-1, (logits.shape[-1] // width, width))
    chosen = segments.amax(-1).topk(k, dim=-1).indices.sort(dim=-1).values
    entries = segments.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, width)).flatten(-2)
    values, positions = entries.topk(k, dim=-1)
    return values, chosen.gather(-1, positions // width) * width + positions % width


def top_candidates(logits, k):
    """(values, ids) of logits.topk(k, dim=-1): on CUDA by `segmented_topk` (its contract) where the vocabulary
    splits into at least k segments of CANDIDATE_SEGMENT_WIDTH entries, else by torch.topk. Another vocabulary
    keeps torch.topk rather than padding: a padded copy of the logits would cost much of what the segments
    save. The CPU keeps torch.topk: there the segments were faster on one thread but slower on two busy ones
    (docs/perf_notes.md), and its ties stay what the CPU tests read."""
    vocab = logits.shape[-1]
    if logits.is_cuda and vocab % CANDIDATE_SEGMENT_WIDTH == 0 and vocab // CANDIDATE_SEGMENT_WIDTH >= k:
        return segmented_topk(logits, k, CANDIDATE_SEGMENT_WIDTH)
    return tuple(logits.topk(k, dim=-1))


def unary_candidates(logits, top_k, output_multiplier=1.0, softcap=None):
    """The head's logits [..., V] -> (candidate ids [..., K], their unary logits [..., K] fp32),
    best first."""
    values, ids = top_candidates(logits, top_k)
    return ids, unary_logits(values, output_multiplier, softcap)


class CodebookRows(torch.autograd.Function):
    """codebook [vocab, rank], ids [...] -> codebook[ids] [..., rank], with a backward that adds the rows'
    gradients into a zero [vocab, rank] one by `index_add_`.

    Indexing's own backward (index_put_ with accumulate) on CUDA sorts the ids, then sums each row's
    duplicates in order, one warp per distinct row; the selector's ids repeat a lot (frequent tokens are the
    candidates of many slots), so a few long runs are summed one row after another. `index_add_` adds by
    atomics instead, so the order of a duplicated row's sum varies from run to run on CUDA; on the CPU it is
    fixed (the ids' order). Under torch.use_deterministic_algorithms (which this project never turns
    on) torch itself runs `index_add_` on CUDA as index_put_ with accumulate, the deterministic sort again.
    The sums are taken in fp32 at least, as indexing's CUDA backward takes them, and cast once: the trainer's
    codebooks compute in bf16 on a GPU.

    The gradient stays a dense [vocab, rank] tensor (zero but for the rows read), and the optimiser
    (launcher/distributed/sharded_adamw.py) updates every row: that AdamW pass over 2 x vocab x rank values
    is one bandwidth-bound read and write, far cheaper than the sort it replaces, so a sparse update would
    save little."""

    @staticmethod
    def forward(ctx, codebook, ids):
        ctx.save_for_backward(ids)
        ctx.codebook_shape = codebook.shape
        return codebook.index_select(0, ids.reshape(-1)).view(*ids.shape, codebook.shape[1])

    @staticmethod
    def backward(ctx, grad_rows):
        ids, = ctx.saved_tensors
        sum_dtype = torch.promote_types(grad_rows.dtype, torch.float32)
        grad = grad_rows.new_zeros(ctx.codebook_shape, dtype=sum_dtype)
        grad.index_add_(0, ids.reshape(-1), grad_rows.reshape(-1, grad.shape[1]).to(sum_dtype))
        return grad.to(grad_rows.dtype), None


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
        nonzero (CodebookRows)."""
        predecessors = CodebookRows.apply(self.predecessor_codebook, predecessor_ids)
        successors = CodebookRows.apply(self.successor_codebook, candidate_ids)
        pair = (predecessors * self.hidden_projection(hidden).unsqueeze(-2)) @ successors.transpose(-1, -2)
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
