"""Compiled flex_attention on CPU (forward only) against the sdpa reference.

CPU flex has no backward, and one compiled call with requires_grad inputs would make dynamo
skip the function for the rest of this process, so everything here runs under no_grad on
plain tensors, and the compile counter proves the flex path really compiled. The whole file
uses ONE shape, so the process compiles flex once (~10-25 s on 2 cores).
"""

import pytest
import torch

from dflash_core import attention
from dflash_core.compile import compile_count
from dflash_core.model import DFlashDrafter
from tests.drafters import drafter_config

B, S, N, BS, HIDDEN = 2, 40, 6, 4, 32
TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # fp32; measured max abs difference ~1.2e-7


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
    cfg = drafter_config(hidden_size=HIDDEN, block_size=BS)
    return DFlashDrafter(cfg, seed=0)


def test_auto_backend_is_sdpa_on_cpu():
    assert attention.resolve_backend("auto", "cpu") == "sdpa"
    assert attention.resolve_backend("auto", "cuda") == "flex"


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
    for seed in range(3):  # changing data, one shape: must not recompile
        features, embeds, anchors, keep = random_inputs(seed)
        flex = drafter(features, embeds, anchors, keep, backend="flex")
        sdpa = drafter(features, embeds, anchors, keep, backend="sdpa")
        torch.testing.assert_close(flex, sdpa, **TOLERANCE)
    assert compile_count("flex_attention") == compiles_before + 1


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
    assert compile_count("flex_attention") == compiles_before + 1, "same shape"


@torch.no_grad()
def test_evaluation_recompiles_nothing_across_batches(drafter):
    """Held-out batches with different numbers of valid anchors reuse the compiled layer (flex
    inside): the anchor chunks must not reach the graph as slices with batch-dependent strides."""
    from dflash_core.frozen_head import FrozenTargetHead
    from dflash_core.objective import evaluate_tau
    head = FrozenTargetHead.random(50, HIDDEN, seed=0)
    gen = torch.Generator().manual_seed(0)
    counts = []
    for supervised in (S, S // 2):   # all positions, then half: fewer anchor chunks
        ids = torch.randint(0, 49, (B, S), generator=gen)
        mask = (torch.arange(S) < supervised).long().expand(B, -1)
        features = torch.randn(B, S, 2 * HIDDEN, generator=gen)
        evaluate_tau(drafter, head, ids, mask, features, backend="flex", num_anchors=N, chunk_blocks=N,
                     compiled=True)
        counts.append(compile_count("drafter_layer"))
    assert counts[1] == counts[0] > 0
