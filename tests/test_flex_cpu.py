"""Compiled flex_attention on CPU (forward only) against the sdpa reference.

CPU flex has no backward, and one compiled call with requires_grad inputs would make dynamo
skip the function for the rest of this process, so everything here runs under no_grad on
plain tensors, and the compile counter proves the flex path really compiled. The whole file
uses ONE shape and the drafter has a full and a sliding layer, so the process compiles flex
twice (once per layer type's mask, ~10-25 s each on 2 cores), packed rows or not.
"""

import sys
import types

import pytest
import torch

from dflash_core.drafter import attention
from dflash_core.drafter.compile import compile_count
from dflash_core.drafter.model import DFlashDrafter
from tests.drafters import drafter_config, step_settings

B, S, N, BS, HIDDEN = 2, 40, 6, 4, 32
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32; measured max abs difference ~1.2e-7
DOC_LENGTHS = [(12, 18, 10), (20, 15, 5)]  # per row, packed back to back (each row S tokens)
PACKED = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOC_LENGTHS])


def random_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(B, S, 2 * HIDDEN, generator=gen)
    embeds = torch.randn(B, N * BS, HIDDEN, generator=gen)
    anchors = torch.randint(0, S - 1, (B, N), generator=gen).sort(dim=1).values
    keep = torch.rand(B, N, generator=gen) > 0.25
    keep[0, -1] = False  # at least one invalid block
    return features, embeds, anchors, keep


@pytest.fixture(scope="module")
def compiles_before():
    """Flex graphs compiled in this process before this module's first flex call."""
    return compile_count("flex_attention")


@pytest.fixture(scope="module")
def drafter():
    cfg = drafter_config(hidden_size=HIDDEN, block_size=BS, layer_types=["full_attention", "sliding_attention"],
                         sliding_window=6)
    return DFlashDrafter(cfg, seed=0)


def test_auto_backend_is_sdpa_on_cpu():
    assert attention.resolve_backend("auto", "cpu") == "sdpa"
    assert attention.resolve_backend("auto", "cuda") == "flex"


@pytest.fixture
def hopper_gpu(monkeypatch):
    """What resolve_backend sees on a Hopper GPU: CUDA there, compute capability 9.0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_flash_is_chosen_by_name_only(hopper_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    assert attention.flash_unavailable("cuda") is None
    assert attention.resolve_backend("flash", "cuda") == "flash"
    assert attention.resolve_backend("auto", "cuda") == "flex", "auto keeps flex's shorter cold compile"


def test_flash_that_cannot_run_is_an_error_naming_why(hopper_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails: not installed
    with pytest.raises(ValueError, match=r"'flash' cannot run here: flash-attn-4 is not installed.*\[flash\]"):
        attention.resolve_backend("flash", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 9.0 or newer.*has 8.0"):
        attention.resolve_backend("flash", "cuda")
    with pytest.raises(ValueError, match="needs a CUDA GPU, not cpu"):
        attention.resolve_backend("flash", "cpu")


def test_flex_refuses_to_train_on_cpu():
    _, _, anchors, keep = random_inputs(0)
    mask = attention.build_attention_mask(anchors, keep, context_len=S, block_size=BS,
                                          layer_type="full_attention", window=None, backend="flex")
    q = torch.randn(B, 4, N * BS, 8, requires_grad=True)
    kv = torch.randn(B, 2, S + N * BS, 8)
    before = compile_count("flex_attention")
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        attention.attend(q, kv, kv, mask)
    assert compile_count("flex_attention") == before, "refused before compiling"


@torch.no_grad()
def test_compiled_flex_forward_equals_sdpa(drafter, compiles_before):
    for seed in range(3):  # changing data, one shape, packed or not: must not recompile
        features, embeds, anchors, keep = random_inputs(seed)
        for position_ids in (None, PACKED):
            flex = drafter(features, embeds, anchors, keep, position_ids=position_ids, backend="flex")
            sdpa = drafter(features, embeds, anchors, keep, position_ids=position_ids, backend="sdpa")
            torch.testing.assert_close(flex, sdpa, **TOLERANCE)
    assert compile_count("flex_attention") == compiles_before + 2, "one graph per layer type"


def alone_rows(ids, mask, features, anchors, keep, doc):
    """Document `doc` of each row moved to offset 0 of an unpacked row of S tokens (padding after),
    with the packed row's anchors in it shifted accordingly (padded to N with invalid blocks)."""
    rows = [torch.zeros(B, S, dtype=torch.long), torch.zeros(B, S, dtype=torch.long), torch.zeros_like(features)]
    doc_anchors, doc_keep = torch.zeros_like(anchors), torch.zeros_like(keep)
    for r, lengths in enumerate(DOC_LENGTHS):
        start, n = sum(lengths[:doc]), lengths[doc]
        for out, packed in zip(rows, (ids, mask, features)):
            out[r, :n] = packed[r, start:start + n]
        mine = anchors[r][keep[r] & (anchors[r] >= start) & (anchors[r] < start + n)] - start
        doc_anchors[r, :len(mine)], doc_keep[r, :len(mine)] = mine, True
    return rows, (doc_anchors, doc_keep)


@torch.no_grad()
def test_packed_flex_loss_equals_its_documents_alone(drafter, compiles_before):
    """Forward only (CPU flex has no backward); the alone rows keep the packed shape: no recompile."""
    from dflash_core.loss.anchors import sample_anchors
    from dflash_core.loss.frozen_head import FrozenTargetHead
    from dflash_core.loss.objective import drafter_step
    head = FrozenTargetHead.random(50, HIDDEN, seed=0)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 49, (B, S), generator=gen)
    mask = (torch.rand(B, S, generator=gen) < 0.8).long()
    features = torch.randn(B, S, 2 * HIDDEN, generator=gen)
    anchors, keep = sample_anchors(mask, N, gen, PACKED)
    settings = step_settings(drafter, backend="flex", chunk_blocks=N)
    packed = drafter_step(drafter, head, ids, mask, features, settings, position_ids=PACKED,
                          fixed_anchors=(anchors, keep)).loss_sum
    alone = sum(drafter_step(drafter, head, *rows, settings, fixed_anchors=doc_anchors).loss_sum
                for rows, doc_anchors in (alone_rows(ids, mask, features, anchors, keep, doc) for doc in range(3)))
    torch.testing.assert_close(packed, alone, **TOLERANCE)
    assert compile_count("flex_attention") <= compiles_before + 2


@torch.no_grad()
def test_flex_returns_zero_for_rows_without_keys(compiles_before):
    _, _, anchors, keep = random_inputs(1)
    masks = [attention.build_attention_mask(anchors, keep, context_len=S, block_size=BS,
                                            layer_type="full_attention", window=None,
                                            backend=backend) for backend in ("flex", "sdpa")]
    # The layouts the drafter passes (strides are guarded): queries [B, L, heads, D] transposed,
    # keys and values concatenated [context | block] along the length, hence contiguous.
    q = torch.randn(B, N * BS, 4, 8).transpose(1, 2)
    k, v = (torch.randn(B, 2, S + N * BS, 8) for _ in range(2))
    flex, sdpa = (attention.attend(q, k, v, mask) for mask in masks)
    assert torch.equal(flex[0, :, -BS:], torch.zeros_like(flex[0, :, -BS:]))
    torch.testing.assert_close(flex, sdpa, **TOLERANCE)
    assert compile_count("flex_attention") <= compiles_before + 2, "same shape as the drafter's"


@torch.no_grad()
def test_evaluation_recompiles_nothing_across_batches(drafter):
    """Held-out batches with different numbers of valid anchors, and packed rows, reuse the
    compiled layer (flex inside): the anchor chunks must not reach the graph as slices with
    batch-dependent strides, and document ids are data, not shape. Also with one row (micro-batch
    1), whose size-1 dimension kept a slice's stride through .contiguous() (an H200 e2e run
    recompiled at its first held-out evaluation)."""
    from dflash_core.loss.frozen_head import FrozenTargetHead
    from dflash_core.loss.objective import evaluate_tau
    head = FrozenTargetHead.random(50, HIDDEN, seed=0)
    gen = torch.Generator().manual_seed(0)
    counts = []
    # All positions, then few (padded anchor chunks), then packed rows; two rows, then one.
    for rows in (B, 1):
        for supervised, position_ids in ((S, None), (N // 2, None), (S, PACKED)):
            ids = torch.randint(0, 49, (rows, S), generator=gen)
            mask = (torch.arange(S) < supervised).long().expand(rows, -1)
            features = torch.randn(rows, S, 2 * HIDDEN, generator=gen)
            evaluate_tau(drafter, head, ids, mask, features,
                         step_settings(drafter, backend="flex", compiled=True, num_anchors=N, chunk_blocks=N),
                         position_ids=None if position_ids is None else position_ids[:rows])
            counts.append(compile_count("drafter_layer"))
    assert counts[0] > 0 and counts[2] == counts[1] == counts[0]   # two rows: one graph
    assert counts[5] == counts[4] == counts[3]                      # one row: one more, once
