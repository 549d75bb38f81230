"""Anchor selection: block j starts at anchor a_j; slot 0 holds input_ids[a_j] and slots
1..Bs-1 are predicted. Anchors come out sorted ascending and padded to a fixed count with
invalid blocks (keep=False, anchor 0) so every micro-batch has the same shapes.

Packed rows: position_ids [B, S] restart at 0 at every document start (None: one document
per row). A row's anchor slots are shared by its documents, drawn uniformly over all of the
row's candidates."""

import torch

_SENTINEL = torch.iinfo(torch.long).max  # sorts after every real position


def anchor_candidates(loss_mask, position_ids=None):
    """bool [B, S]: t in [0, S-2] with loss_mask[t] and loss_mask[t+1] (slot 1 is supervised),
    t+1 in t's document."""
    supervised = loss_mask.bool()
    candidates = torch.zeros_like(supervised)
    candidates[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    if position_ids is not None:
        candidates[:, :-1] &= position_ids[:, 1:] == position_ids[:, :-1] + 1
    return candidates


def _sorted_and_padded(positions, valid, num_anchors):
    """Per row: valid positions ascending, then (anchor 0, keep False) up to num_anchors."""
    ordered = positions.masked_fill(~valid, _SENTINEL).sort(dim=1).values[:, :num_anchors]
    missing = num_anchors - ordered.shape[1]
    if missing > 0:
        ordered = torch.cat([ordered, ordered.new_full((ordered.shape[0], missing), _SENTINEL)], 1)
    keep = ordered != _SENTINEL
    return ordered.masked_fill(~keep, 0), keep


def sample_anchors(loss_mask, num_anchors, generator=None, position_ids=None):
    """Up to num_anchors random candidates per row -> (anchors [B, N] long, keep [B, N] bool).
    The draw uses `generator` (on its own device) so equal generators give equal anchors."""
    candidates = anchor_candidates(loss_mask, position_ids)
    device = generator.device if generator is not None else loss_mask.device
    scores = torch.rand(candidates.shape, generator=generator, device=device).to(loss_mask.device)
    # Non-candidates score above every candidate, so the smallest scores are a uniform
    # random subset of the candidates (all of them when there are fewer than num_anchors).
    scores = scores.masked_fill(~candidates, 2.0)
    picked = scores.topk(min(num_anchors, scores.shape[1]), dim=1, largest=False).indices
    return _sorted_and_padded(picked, candidates.gather(1, picked), num_anchors)


def all_valid_anchors(loss_mask, multiple_of=1, position_ids=None):
    """Every candidate of every row -> (anchors [B, M], keep [B, M]) for evaluation, with M the
    largest per-row count rounded up to `multiple_of` (so fixed-size chunks keep shapes static)."""
    candidates = anchor_candidates(loss_mask, position_ids)
    most = max(int(candidates.sum(dim=1).max()), 1)
    count = -(-most // multiple_of) * multiple_of
    positions = torch.arange(candidates.shape[1], device=loss_mask.device).expand_as(candidates)
    return _sorted_and_padded(positions, candidates, count)
