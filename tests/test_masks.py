"""The DFlash mask_mod, rule by rule, against a hand-written mask built from the spec, and the
flex BlockMask built from its intervals against create_block_mask."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from dflash_core.drafter.attention import (
    attend,
    block_doc_starts,
    build_attention_mask,
    dense_mask,
    make_mask_mod,
)
from dflash_core.drafter.compile import compile_count

S, BS, WINDOW = 24, 4, 6
ANCHORS = torch.tensor([[0, 5, 11, 20], [3, 4, 9, 22]])
KEEP = torch.tensor([[True, True, True, True], [True, False, True, True]])
N = ANCHORS.shape[1]
Q, KV = N * BS, S + N * BS
# Row 0 one document; row 1 packed: documents at 0..7, 8..18, then padding 19..23 as a segment.
PACKED = torch.stack([torch.arange(S), torch.cat([torch.arange(8), torch.arange(11), torch.arange(5)])])


def mask_for(layer_type, anchors=ANCHORS, keep=KEEP, position_ids=None):
    mod = make_mask_mod(anchors, keep, context_len=S, block_size=BS, layer_type=layer_type,
                        window=WINDOW, doc_starts=block_doc_starts(anchors, position_ids))
    return dense_mask(mod, anchors.shape[0], anchors.shape[1] * BS, S + anchors.shape[1] * BS,
                      "cpu")[:, 0]


def hand_written_mask(layer_type, position_ids):
    """Spec rules, one query and one key at a time; documents and windows in positions."""
    sliding = layer_type == "sliding_attention"
    expected = torch.zeros(ANCHORS.shape[0], Q, KV, dtype=torch.bool)
    for b in range(ANCHORS.shape[0]):
        pos = position_ids[b].tolist()
        for j in range(N):
            if not KEEP[b, j]:
                continue
            a = int(ANCHORS[b, j])
            for q_off in range(BS):
                q_pos = pos[a] + q_off
                for t in range(S):
                    same_document = t - pos[t] == a - pos[a]
                    if same_document and t < a and (not sliding or pos[t] >= q_pos - (WINDOW - 1)):
                        expected[b, j * BS + q_off, t] = True
                for k_off in range(BS):
                    if not sliding or (k_off <= q_off and pos[a] + k_off >= q_pos - (WINDOW - 1)):
                        expected[b, j * BS + q_off, S + j * BS + k_off] = True
    return expected


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("packed", [False, True])
def test_mask_equals_hand_written_mask(layer_type, packed):
    position_ids = PACKED if packed else None
    expected = hand_written_mask(layer_type, PACKED if packed else torch.arange(S).expand(2, -1))
    assert torch.equal(mask_for(layer_type, position_ids=position_ids), expected)
    if packed:  # row 1's blocks at anchors 9 (second document) and 3 see different contexts
        assert not expected[1, 2 * BS:3 * BS, :8].any() and expected[1, 2 * BS, 8]
        assert not torch.equal(expected, hand_written_mask(layer_type, torch.arange(S).expand(2, -1)))


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
    """create_block_mask pads Q to a multiple of 128 and evaluates mask_mod there: the per-block
    bounds must cover those rows (no out-of-range gather) and mask them."""
    mod = make_mask_mod(ANCHORS, KEEP, context_len=S, block_size=BS, layer_type="full_attention")
    padded = create_mask(mod, 2, 1, 128, KV, device="cpu")[:, 0]  # vmap path, like the kernels
    assert torch.equal(padded[:, :Q], mask_for("full_attention"))
    assert not padded[:, Q:].any()


def random_packed_rows(batch, seq_len, num_anchors, seed, packed):
    """Anchors drawn from a random loss mask, some blocks invalid; packed rows get 3-6 documents."""
    from dflash_core.loss.anchors import sample_anchors
    gen = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(seq_len).repeat(batch, 1)
    if packed:
        for row in position_ids:
            cuts = torch.randint(1, seq_len, (int(torch.randint(2, 6, (), generator=gen)),), generator=gen)
            for cut in cuts.sort().values.tolist():
                row[cut:] = torch.arange(seq_len - cut)
    loss_mask = (torch.rand(batch, seq_len, generator=gen) < 0.9).long()
    anchors, keep = sample_anchors(loss_mask, num_anchors, gen, position_ids)
    keep[0, -3:] = False
    return anchors, keep, position_ids if packed else None


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


# (batch, S, anchors, block size): Q = 148 and 512 + 200 are not multiples of 128; the large
# unpacked case has full tiles, the sliding window (6 or 200 positions) cuts through tiles.
@pytest.mark.parametrize("shape", [(2, 200, 37, 4), (1, 600, 64, 8), (2, 1000, 25, 8)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 6),
                                               ("sliding_attention", 200)])
def test_interval_block_mask_equals_create_block_mask(shape, packed, layer_type, window):
    batch, seq_len, num_anchors, block_size = shape
    anchors, keep, position_ids = random_packed_rows(batch, seq_len, num_anchors, seed=seq_len, packed=packed)
    graphs_before, compiles_before = counters["stats"]["unique_graphs"], compile_count()
    got = build_attention_mask(anchors, keep, context_len=seq_len, block_size=block_size, layer_type=layer_type,
                               window=window, backend="flex", position_ids=position_ids)
    assert (counters["stats"]["unique_graphs"], compile_count()) == (graphs_before, compiles_before), \
        "building the BlockMask compiles nothing"
    q_len = num_anchors * block_size
    want = create_block_mask(got.mask_mod, batch, None, q_len, seq_len + q_len, device="cpu")
    for field in BLOCK_MASK_FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.seq_lengths == want.seq_lengths == (q_len, seq_len + q_len)
    assert torch.equal(got.to_dense(), want.to_dense())
    if shape == (1, 600, 64, 8) and not packed and window is None:
        assert got.full_kv_num_blocks.sum() > 0 and got.kv_num_blocks.sum() > 0


def test_block_mask_skips_invisible_tiles():
    anchors = torch.zeros(1, 64, dtype=torch.long)
    keep = torch.zeros(1, 64, dtype=torch.bool)
    keep[0, 0] = True  # one live block at anchor 0: it sees only its own 4 keys
    block_mask = build_attention_mask(anchors, keep, context_len=256, block_size=BS, layer_type="full_attention",
                                      window=None, backend="flex")
    assert block_mask.kv_num_blocks.sum() == 1 and block_mask.full_kv_num_blocks.sum() == 0


def test_packed_documents_skip_other_documents_tiles():
    """Two 256-token documents, 16 blocks anchored at 300..360 in the second: of the context tiles
    only the one holding 256..383 is computed; the block part is one tile."""
    position_ids = torch.cat([torch.arange(256), torch.arange(256)]).unsqueeze(0)
    anchors = torch.arange(300, 364, 4).unsqueeze(0)
    keep = torch.ones_like(anchors, dtype=torch.bool)
    block_mask = build_attention_mask(anchors, keep, context_len=512, block_size=8, layer_type="full_attention",
                                      window=None, backend="flex", position_ids=position_ids)
    dense = block_mask.to_dense()[0, 0]  # [query tiles, key tiles]: 1 where computed
    assert dense.tolist() == [[0, 0, 1, 0, 1]]


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
