"""The DFlash mask_mod, rule by rule, against a hand-written mask built from the spec."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_core.attention import attend, dense_mask, make_mask_mod

S, BS, WINDOW = 24, 4, 6
ANCHORS = torch.tensor([[0, 5, 11, 20], [3, 4, 9, 22]])
KEEP = torch.tensor([[True, True, True, True], [True, False, True, True]])
N = ANCHORS.shape[1]
Q, KV = N * BS, S + N * BS


def mask_for(layer_type, anchors=ANCHORS, keep=KEEP):
    mod = make_mask_mod(anchors, keep, context_len=S, block_size=BS, layer_type=layer_type,
                        window=WINDOW)
    return dense_mask(mod, anchors.shape[0], anchors.shape[1] * BS, S + anchors.shape[1] * BS,
                      "cpu")[:, 0]


def hand_written_mask(layer_type):
    """Spec rules, one query and one key at a time."""
    sliding = layer_type == "sliding_attention"
    expected = torch.zeros(ANCHORS.shape[0], Q, KV, dtype=torch.bool)
    for b in range(ANCHORS.shape[0]):
        for j in range(N):
            if not KEEP[b, j]:
                continue
            a = int(ANCHORS[b, j])
            for q_off in range(BS):
                q_pos = a + q_off
                for t in range(S):
                    if t < a and (not sliding or t >= q_pos - (WINDOW - 1)):
                        expected[b, j * BS + q_off, t] = True
                for k_off in range(BS):
                    if not sliding or (k_off <= q_off and a + k_off >= q_pos - (WINDOW - 1)):
                        expected[b, j * BS + q_off, S + j * BS + k_off] = True
    return expected


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_mask_equals_hand_written_mask(layer_type):
    assert torch.equal(mask_for(layer_type), hand_written_mask(layer_type))


def test_context_strictly_before_anchor():
    mask = mask_for("full_attention")
    b, j = 0, 2
    a = int(ANCHORS[b, j])
    rows = mask[b, j * BS:(j + 1) * BS]
    assert rows[:, :a].all(), "every context key before the anchor is visible"
    assert not rows[:, a:S].any(), "the anchor's own target state (and later) is invisible"
    first_block = mask[0, 0:BS]  # anchor 0: no context at all
    assert not first_block[:, :S].any()


def test_own_block_bidirectional_on_full_layers():
    mask = mask_for("full_attention")
    b, j = 0, 1
    rows = mask[b, j * BS:(j + 1) * BS, S:]
    own = torch.zeros(N * BS, dtype=torch.bool)
    own[j * BS:(j + 1) * BS] = True
    assert rows[:, own].all(), "slot 0 sees the last slot and vice versa"
    assert not rows[:, ~own].any(), "other blocks are invisible"


def test_sliding_layers_causal_in_block_and_windowed_context():
    mask = mask_for("sliding_attention")
    b, j = 0, 3
    a = int(ANCHORS[b, j])
    block = mask[b, j * BS:(j + 1) * BS, S + j * BS:S + (j + 1) * BS]
    assert torch.equal(block, torch.ones(BS, BS, dtype=torch.bool).tril())
    for q_off in range(BS):
        oldest = a + q_off - (WINDOW - 1)
        context = mask[b, j * BS + q_off, :S]
        assert context[oldest:a].all()
        assert not context[:oldest].any(), f"key {oldest - 1} is outside the window"
        assert not context[a:].any()


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_invalid_blocks_see_nothing(layer_type):
    mask = mask_for(layer_type)
    assert not mask[1, 1 * BS:2 * BS].any()
    assert mask[1, 2 * BS:3 * BS].any()


def test_padded_query_rows_are_masked():
    """create_block_mask pads Q to a multiple of 128 and evaluates mask_mod there: the block
    index must be clamped (no out-of-range gather) and those rows masked."""
    mod = make_mask_mod(ANCHORS, KEEP, context_len=S, block_size=BS, layer_type="full_attention")
    padded = create_mask(mod, 2, 1, 128, KV, device="cpu")[:, 0]  # vmap path, like the kernels
    assert torch.equal(padded[:, :Q], mask_for("full_attention"))
    assert not padded[:, Q:].any()


def test_block_mask_skips_invisible_tiles():
    anchors = torch.zeros(1, 64, dtype=torch.long)
    keep = torch.zeros(1, 64, dtype=torch.bool)
    keep[0, 0] = True  # one live block at anchor 0: it sees only its own 4 keys
    mod = make_mask_mod(anchors, keep, context_len=256, block_size=BS, layer_type="full_attention")
    block_mask = create_block_mask(mod, 1, None, 64 * BS, 256 + 64 * BS, device="cpu")
    assert block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum() == 1


def test_sdpa_rows_without_keys_are_zero_and_gradients_finite():
    mask = dense_mask(make_mask_mod(ANCHORS, KEEP, context_len=S, block_size=BS,
                                    layer_type="full_attention"), 2, Q, KV, "cpu")
    q = torch.randn(2, 4, Q, 8, requires_grad=True)
    k = torch.randn(2, 2, KV, 8, requires_grad=True)
    v = torch.randn(2, 2, KV, 8, requires_grad=True)
    out = attend(q, k, v, mask)
    out.sum().backward()
    assert torch.equal(out[1, :, BS:2 * BS], torch.zeros_like(out[1, :, BS:2 * BS]))
    assert all(t.grad.isfinite().all() for t in (q, k, v))
    assert torch.equal(q.grad[1, :, BS:2 * BS], torch.zeros_like(q.grad[1, :, BS:2 * BS]))


def test_unknown_layer_type_and_missing_window_are_errors():
    with pytest.raises(ValueError, match="unknown layer type"):
        make_mask_mod(ANCHORS, KEEP, context_len=S, block_size=BS, layer_type="local")
    with pytest.raises(ValueError, match="window"):
        make_mask_mod(ANCHORS, KEEP, context_len=S, block_size=BS, layer_type="sliding_attention")
