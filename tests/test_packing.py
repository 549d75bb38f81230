"""Packed rows train the drafter exactly as their documents alone would (CPU, sdpa backend):
same loss, gradients and counts, whatever a document's offset in its row."""

import pytest
import torch

from dflash_core.data import MicroBatchSource
from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.anchors import sample_anchors
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.objective import drafter_step, evaluate_tau
from tests.drafters import drafter_config, step_settings

VOCAB, HIDDEN, BS, MASK_ID = 40, 32, 4, 39
DOC_LENGTHS = (23, 9, 31)  # packed back to back, then 7 padding tokens: S = 70
S = sum(DOC_LENGTHS) + 7
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def drafter():
    """A full and a sliding layer (a window shorter than a document, so it matters)."""
    cfg = drafter_config(hidden_size=HIDDEN, vocab_size=VOCAB, block_size=BS, mask_token_id=MASK_ID,
                         layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    return DFlashDrafter(cfg, seed=0)


def documents(seed=0):
    """(input_ids, loss_mask, hidden) per document; every document's last token is supervised, so
    without document rules an anchor could reach into the next document."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in DOC_LENGTHS:
        loss_mask = (torch.arange(n) >= n // 3).long()
        docs.append((torch.randint(0, MASK_ID, (n,), generator=gen), loss_mask,
                     torch.randn(n, 2 * HIDDEN, generator=gen)))
    return docs


def packed_row(docs, seed=1):
    """One row [1, S]: the documents back to back, then padding with features that must not matter."""
    gen = torch.Generator().manual_seed(seed)
    pad = S - sum(DOC_LENGTHS)
    input_ids = torch.cat([d[0] for d in docs] + [torch.zeros(pad, dtype=torch.long)])
    loss_mask = torch.cat([d[1] for d in docs] + [torch.zeros(pad, dtype=torch.long)])
    hidden = torch.cat([d[2] for d in docs] + [torch.randn(pad, 2 * HIDDEN, generator=gen)])
    position_ids = torch.cat([torch.arange(n) for n in DOC_LENGTHS + (pad,)])
    return input_ids[None], loss_mask[None], hidden[None], position_ids[None]


def split_anchors(anchors, keep):
    """The packed row's valid anchors, per document, shifted to the document's own offsets."""
    valid = anchors[keep]
    per_doc, offset = [], 0
    for n in DOC_LENGTHS:
        mine = valid[(valid >= offset) & (valid < offset + n)] - offset
        per_doc.append((mine[None], torch.ones(1, len(mine), dtype=torch.bool)))
        offset += n
    assert sum(len(a[0][0]) for a in per_doc) == len(valid)
    return per_doc


def step(model, head, batch, anchors, loss, position_ids=None):
    model.zero_grad()
    out = drafter_step(model, head, *batch, step_settings(model, loss=loss, chunk_blocks=3),
                       position_ids=position_ids, fixed_anchors=anchors)
    out.loss_sum.backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", ["dflash", "dpace"])
def test_packed_row_loss_and_gradients_equal_its_documents_alone(loss):
    docs, model, head = documents(), drafter(), FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    *batch, position_ids = packed_row(docs)
    anchors, keep = sample_anchors(batch[1], 16, torch.Generator().manual_seed(0), position_ids)
    assert keep.all(), "the row has more candidates than anchor slots: every slot is a real block"
    packed, packed_grads = step(model, head, batch, (anchors, keep), loss, position_ids)

    alone_loss, alone_grads, alone_counts = 0.0, None, None
    for (ids, mask, hidden), doc_anchors in zip(docs, split_anchors(anchors, keep)):
        out, grads = step(model, head, (ids[None], mask[None], hidden[None]), doc_anchors, loss)
        alone_loss = alone_loss + out.loss_sum.detach()
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]
        alone_counts = out.counts if alone_counts is None else alone_counts + out.counts
    torch.testing.assert_close(packed.loss_sum.detach(), alone_loss, **TOLERANCE)
    for got, want in zip(packed_grads, alone_grads):
        torch.testing.assert_close(got, want, **TOLERANCE)
    for field in ("weight_sum", "tau_sum", "tau_count", "slot_correct", "slot_weight"):
        torch.testing.assert_close(getattr(packed.counts, field), getattr(alone_counts, field), **TOLERANCE)

    # The same row read as one document differs: the document rules did something.
    unaware, _ = step(model, head, batch, (anchors, keep), loss)
    assert not torch.allclose(unaware.loss_sum, packed.loss_sum, **TOLERANCE)


@torch.no_grad()
def test_a_document_at_offset_1000_is_drafted_as_if_alone():
    model, gen = drafter(), torch.Generator().manual_seed(4)
    alone = torch.randn(1, 40, 2 * HIDDEN, generator=gen)
    before = torch.randn(1, 1000, 2 * HIDDEN, generator=gen)  # another document
    position_ids = torch.cat([torch.arange(1000), torch.arange(40)]).unsqueeze(0)
    anchors, keep = torch.tensor([[0, 3, 17, 35]]), torch.ones(1, 4, dtype=torch.bool)
    embeds = torch.randn(1, 4 * BS, HIDDEN, generator=gen)
    want = model(alone, embeds, anchors, keep, backend="sdpa")
    got = model(torch.cat([before, alone], 1), embeds, anchors + 1000, keep, position_ids=position_ids,
                backend="sdpa")
    torch.testing.assert_close(got, want, **TOLERANCE)


@torch.no_grad()
def test_evaluate_tau_of_a_packed_row_is_the_sum_over_its_documents():
    docs, model, head = documents(seed=2), drafter(), FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    *batch, position_ids = packed_row(docs)
    settings = step_settings(model, num_anchors=8)
    packed = evaluate_tau(model, head, *batch, settings, position_ids=position_ids)
    alone = [evaluate_tau(model, head, ids[None], mask[None], hidden[None], settings) for ids, mask, hidden in docs]
    total = alone[0] + alone[1] + alone[2]
    for field in ("loss_sum", "weight_sum", "tau_sum", "tau_count", "slot_correct", "slot_weight"):
        torch.testing.assert_close(getattr(packed, field), getattr(total, field), **TOLERANCE)


@torch.no_grad()
def test_held_out_evaluation_of_unpacked_rows_is_unchanged():
    """Held-out rows stay unpacked: their position_ids (0..S-1) give bit for bit the counts of
    the position-free path (which equals the code before packing existed)."""
    docs = documents(seed=3)
    samples = [{"input_ids": ids, "loss_mask": mask} for ids, mask, _ in docs]
    source = MicroBatchSource(samples, micro_batch_size=3, seed=0, pad_token_id=0, length_multiple=8)
    batch = source.batch(0)
    assert torch.equal(batch.position_ids, torch.arange(batch.input_ids.shape[1]).expand(3, -1))
    hidden = torch.randn(*batch.input_ids.shape, 2 * HIDDEN, generator=torch.Generator().manual_seed(0))
    model, head = drafter(), FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    args = (model, head, batch.input_ids, batch.loss_mask, hidden)
    with_positions = evaluate_tau(*args, step_settings(model, num_anchors=8), position_ids=batch.position_ids)
    without = evaluate_tau(*args, step_settings(model, num_anchors=8))
    assert torch.equal(with_positions.pack(), without.pack())
