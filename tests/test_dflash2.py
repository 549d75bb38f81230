"""DFlash 2: its config, the block convolution against a slot-by-slot reference, the selector's
lattice and walks, its segmented top-K and codebook gradient, and identity with the DFlash drafter it is built
on."""

import pytest
import torch

from dflash_core.drafter.dflash2 import DFlash2Config, DFlash2Drafter, block_convolution, build_drafter
from dflash_core.drafter.model import DFlashDrafter
from dflash_core.drafter.selector import (
    CandidateSelector,
    CodebookRows,
    greedy_walk,
    segmented_topk,
    unary_candidates,
    unary_logits,
    unary_walk,
)
from dflash_core.loss.frozen_head import FrozenTargetHead
from tests.drafters import SMALL, drafter_config

DFLASH2 = dict(conv_group_size=8, conv_kernel_size=3, selector_rank=6, selector_top_k=5)


def dflash2_config(**overrides) -> DFlash2Config:
    return DFlash2Config(**{**SMALL, "target_layer_ids": [0, 2], "num_target_layers": 3, **DFLASH2, **overrides})


def inputs(seed=0):
    """Target features, block embeddings of 3 blocks of 4, anchors and keep for 2 rows."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 20, 64, generator=gen), torch.randn(2, 12, 32, generator=gen),
            torch.tensor([[0, 7, 15], [2, 12, 0]]), torch.tensor([[True, True, True], [True, True, False]]))


@pytest.mark.parametrize("overrides, message", [
    (dict(conv_group_size=5), "conv_group_size 5 must divide hidden_size 32"),
    (dict(conv_kernel_size=5), r"conv_kernel_size 5 must lie in \[1, block_size 4\]"),
    (dict(selector_rank=0), "selector_rank"),
    (dict(selector_top_k=51), r"selector_top_k 51 must lie in \[1, vocab_size 50\]"),
    (dict(output_multiplier=0.0), "output_multiplier must be > 0"),
    (dict(final_logit_softcapping=0.0), "final_logit_softcapping must be > 0 or None"),
])
def test_config_validation_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        dflash2_config(**overrides)


def test_block_convolution_matches_the_slot_by_slot_formula():
    gen = torch.Generator().manual_seed(1)
    batch, blocks, block_size, hidden, group_size, taps = 2, 3, 4, 16, 4, 3
    x = torch.randn(batch, blocks * block_size, hidden, generator=gen)
    coefficients = torch.randn(batch, blocks * block_size, taps, hidden // group_size, generator=gen)
    base = torch.randn(taps, hidden, generator=gen)
    want = torch.zeros_like(x)
    for b in range(batch):
        for row in range(blocks * block_size):
            for tap in range(min(taps, row % block_size + 1)):  # never before the block's first slot
                weight = base[tap] + coefficients[b, row, tap].repeat_interleave(group_size)
                want[b, row] += weight * x[b, row - tap]
    got = block_convolution(x, coefficients, base, block_size, group_size)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_convolution_never_reaches_another_block():
    drafter = DFlash2Drafter(dflash2_config(), seed=0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name:
                p.normal_(0.0, 0.3)
    features, embeds, anchors, keep = inputs()
    changed = embeds.clone()
    changed[:, 4] += 1.0  # slot 0 of block 1
    with torch.no_grad():
        before = drafter(features, embeds, anchors, keep, backend="sdpa")
        after = drafter(features, changed, anchors, keep, backend="sdpa")
    moved = (before - after).abs().amax(-1) > 0
    assert moved[:, 4:8].all() and not moved[:, :4].any() and not moved[:, 8:].any()


def test_a_dflash2_on_dflash_weights_computes_what_dflash_does():
    """Identity: the backbone copied, the new parts as initialised -> the same hidden states and
    unary logits bit for bit (tap 0 multiplies by exactly 1, the rest add exact zeros), and the
    selector's greedy walk is the unary top-1 walk although the predecessor codebook and hidden
    projection are random (the successor codebook is 0)."""
    cfg = dflash2_config(layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    dflash = DFlashDrafter(cfg.backbone(), seed=3)
    dflash2 = DFlash2Drafter(cfg, seed=4)
    outcome = dflash2.load_state_dict(dflash.state_dict(), strict=False)
    assert not outcome.unexpected_keys
    assert all("conv" in key or "candidate_selector" in key for key in outcome.missing_keys)
    assert dflash2.candidate_selector.predecessor_codebook.abs().sum() > 0
    features, embeds, anchors, keep = inputs()
    head = FrozenTargetHead.random(50, 32, seed=5)
    with torch.no_grad():
        hidden = dflash(features, embeds, anchors, keep, backend="sdpa")
        hidden2 = dflash2(features, embeds, anchors, keep, backend="sdpa")
        assert torch.equal(hidden2, hidden)
        assert torch.equal(unary_logits(head.logits(hidden2)), head.logits(hidden))
        anchor_ids = torch.arange(6)
        ids, scores = dflash2.candidates(head, hidden2.view(6, 4, 32), anchor_ids)
    assert torch.equal(ids, head.logits(hidden).view(6, 4, 50)[:, 1:].topk(5).indices)
    assert torch.equal(greedy_walk(ids, scores), unary_walk(ids))


def test_unary_logits_scale_then_cap_and_keep_the_top_k():
    logits = torch.tensor([[3.0, -1.0, 30.0, 0.5]])
    ids, values = unary_candidates(logits, 2, output_multiplier=2.0, softcap=20.0)
    assert ids.tolist() == [[2, 0]]
    torch.testing.assert_close(values, 20.0 * torch.tanh(torch.tensor([[60.0, 6.0]]) / 20.0))
    assert torch.equal(unary_logits(logits), logits)


def test_the_segmented_top_k_is_torch_topk():
    """Distinct values (fp32 draws): the values and ids of torch.topk, leading dimensions kept, whether the top
    entries share a segment or not."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 1024, generator=gen)
    logits[0, 0, 200:216] += 10.0   # one segment of 16 holds the whole top-16
    for width in (16, 64):
        values, ids = segmented_topk(logits, 16, width)
        want = logits.topk(16, dim=-1)
        assert torch.equal(values, want.values) and torch.equal(ids, want.indices), width


def test_the_segmented_top_k_at_ties_keeps_topks_values_and_distinct_ids_that_hold_them():
    """At a tie across the k-th place the ids may differ from torch.topk's (neither promises which tied entries
    stay); the values are its, the ids distinct and holding them, and every entry above the tie is kept."""
    gen = torch.Generator().manual_seed(4)
    rows = torch.randint(-3, 4, (6, 512), generator=gen).float()   # a few values, each many times
    rows[1] = 0.0                                                   # all tied
    rows[2, 300] = rows[2, 17] = 9.0                                # a tie above the k-th place
    values, ids = segmented_topk(rows, 8, 32)
    want = rows.topk(8, dim=-1).values
    assert torch.equal(values, want)
    assert torch.equal(rows.gather(1, ids), values)
    assert all(len(set(row)) == 8 for row in ids.tolist())
    for row, kept, kth in zip(rows, ids, want[:, -1]):
        assert set((row > kth).nonzero().flatten().tolist()) <= set(kept.tolist())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_codebook_rows_gather_as_indexing_does_and_sum_repeated_ids_into_the_gradient(dtype):
    """CodebookRows against advanced indexing: the rows, and the gradient with ids repeated many times. bf16
    gradients are summed in fp32 and rounded once: indexing's in fp32, rounded (not its bf16 sums)."""
    gen = torch.Generator().manual_seed(6)
    codebook = torch.randn(30, 6, generator=gen).to(dtype).requires_grad_()
    ids = torch.randint(0, 8, (4, 5, 3), generator=gen)   # 60 ids over 8 of the 30 rows
    upstream = torch.randn(4, 5, 3, 6, generator=gen).to(dtype)
    rows = CodebookRows.apply(codebook, ids)
    assert torch.equal(rows, codebook[ids])
    grad, = torch.autograd.grad(rows, codebook, upstream)
    sums = torch.promote_types(dtype, torch.float32)
    reference = codebook.detach().to(sums).requires_grad_()
    want, = torch.autograd.grad(reference[ids], reference, upstream.to(sums))
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, want.to(dtype), **(dict(rtol=0, atol=0) if dtype == torch.bfloat16 else {}))
    assert grad[8:].abs().sum() == 0


def test_pair_scores_are_the_unary_plus_the_low_rank_pair_term():
    gen = torch.Generator().manual_seed(2)
    selector = CandidateSelector(hidden_size=8, vocab_size=30, rank=3, top_k=4)
    with torch.no_grad():
        for p in selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    ids = torch.randint(0, 30, (2, 3, 4), generator=gen)
    unary, hidden = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 3, 8, generator=gen)
    anchors = torch.tensor([7, 9])
    with torch.no_grad():
        scores = selector.pair_scores(ids, unary, hidden, anchors)
        projected = selector.hidden_projection(hidden)
    A, B = selector.predecessor_codebook.detach(), selector.successor_codebook.detach()
    for r in range(2):
        for s in range(3):
            for p in range(4):
                previous = anchors[r] if s == 0 else ids[r, s - 1, p]
                for c in range(4):
                    want = unary[r, s, c] + (A[previous] * projected[r, s] * B[ids[r, s, c]]).sum()
                    torch.testing.assert_close(scores[r, s, p, c], want, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"block {r}, slot {s + 1}, pair ({p}, {c}): {m}")


def test_the_greedy_walk_follows_its_own_picks():
    ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    scores = torch.zeros(1, 3, 2, 2)
    scores[0, 0, 0] = torch.tensor([0.0, 1.0])    # after the anchor: candidate 1 (11)
    scores[0, 0, 1] = torch.tensor([5.0, 0.0])    # row 1 at slot 1 is never read (all rows are the anchor)
    scores[0, 1, 1] = torch.tensor([2.0, 1.0])    # after 11: 20
    scores[0, 1, 0] = torch.tensor([0.0, 9.0])    # after 10 (not taken)
    scores[0, 2, 0] = torch.tensor([1.0, 1.0])    # after 20: a tie goes to the better unary rank, 30
    assert greedy_walk(ids, scores).tolist() == [[11, 20, 30]]
    assert unary_walk(ids).tolist() == [[10, 20, 30]]


def test_build_drafter_follows_the_config_kind():
    assert type(build_drafter(dflash2_config())) is DFlash2Drafter
    assert type(build_drafter(drafter_config())) is DFlashDrafter


def test_the_dflash2_settings_reach_the_drafter_config():
    from transformers import Qwen3Config

    from launcher.config import compose_config
    from launcher.resolve import drafter_config
    target = Qwen3Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=50, max_position_embeddings=4096)
    common = ["drafter=tiny", "drafter.mask_token_id=49"]
    cfg = compose_config([*common, "drafter.kind=dflash2", "drafter.conv_group_size=8", "drafter.selector_top_k=4",
                          "drafter.final_logit_softcapping=20"])
    dcfg = drafter_config(cfg, target)
    assert isinstance(dcfg, DFlash2Config) and dcfg.block_size == 8 and dcfg.backbone() == drafter_config(
        compose_config(common), target)
    assert (dcfg.conv_group_size, dcfg.conv_kernel_size, dcfg.selector_rank, dcfg.selector_top_k,
            dcfg.output_multiplier, dcfg.final_logit_softcapping) == (8, 2, 256, 4, 1.0, 20.0)
