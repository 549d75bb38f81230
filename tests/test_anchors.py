import torch

from dflash_core.loss.anchors import all_valid_anchors, anchor_candidates, sample_anchors

LOSS_MASK = torch.tensor([
    [0, 1, 1, 1, 0, 1, 1, 0, 1, 1],   # candidates 1, 2, 5, 8
    [0, 0, 0, 0, 0, 1, 0, 1, 0, 1],   # no two consecutive supervised tokens
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],   # candidates 0..8 (never the last position)
])
CANDIDATES = [[1, 2, 5, 8], [], list(range(9))]


def test_candidates_need_two_consecutive_supervised_tokens():
    found = [torch.nonzero(row).flatten().tolist() for row in anchor_candidates(LOSS_MASK)]
    assert found == CANDIDATES


def test_sampled_anchors_are_sorted_candidates_padded_with_invalid_blocks():
    anchors, keep = sample_anchors(LOSS_MASK, 6, torch.Generator().manual_seed(0))
    assert anchors.shape == keep.shape == (3, 6)
    assert anchors.dtype == torch.long and keep.dtype == torch.bool
    for row, candidates in enumerate(CANDIDATES):
        valid = anchors[row][keep[row]].tolist()
        assert len(valid) == min(6, len(candidates))
        assert valid == sorted(set(valid)) and set(valid) <= set(candidates)
        assert keep[row].tolist() == sorted(keep[row].tolist(), reverse=True), "padding last"
        assert (anchors[row][~keep[row]] == 0).all()


def test_sampling_is_controlled_by_the_generator():
    def draw(seed):
        return sample_anchors(LOSS_MASK, 4, torch.Generator().manual_seed(seed))[0]
    assert torch.equal(draw(1), draw(1))
    assert any(not torch.equal(draw(1), draw(seed)) for seed in range(2, 6))


def test_sampling_reaches_every_candidate():
    seen = set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        anchors, keep = sample_anchors(LOSS_MASK[2:], 2, generator)
        seen.update(anchors[keep].tolist())
    assert seen == set(CANDIDATES[2])


def test_all_valid_anchors_lists_every_candidate_padded_to_a_multiple():
    anchors, keep = all_valid_anchors(LOSS_MASK, multiple_of=4)
    assert anchors.shape == (3, 12)
    for row, candidates in enumerate(CANDIDATES):
        assert anchors[row][keep[row]].tolist() == candidates
        assert (anchors[row][~keep[row]] == 0).all()


def test_packed_candidates_keep_slot_one_in_the_anchors_document():
    """Row 2 of LOSS_MASK packed as documents 0..3 and 4..9: t = 3 (last of the first document)
    is no candidate, its slot 1 being the second document's first token."""
    position_ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5]).expand(3, -1)
    found = [torch.nonzero(row).flatten().tolist() for row in anchor_candidates(LOSS_MASK, position_ids)]
    assert found == [[1, 2, 5, 8], [], [0, 1, 2, 4, 5, 6, 7, 8]]
    anchors, keep = all_valid_anchors(LOSS_MASK, position_ids=position_ids)
    assert anchors[2][keep[2]].tolist() == found[2]
    for seed in range(20):
        anchors, keep = sample_anchors(LOSS_MASK, 4, torch.Generator().manual_seed(seed), position_ids)
        assert 3 not in anchors[2][keep[2]].tolist() and keep[2].all()
