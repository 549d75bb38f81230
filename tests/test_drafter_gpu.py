"""GPU checks of the drafter (skipped without CUDA; run through the device tool): the flex backends
in bf16 against an fp32 sdpa reference, forward and backward, and one compile per shape."""

import dataclasses

import pytest
import torch

from dflash_core.drafter.attention import flash_unavailable
from dflash_core.drafter.compile import compile_count
from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.objective import drafter_step
from tests.drafters import drafter_config, step_settings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Relative Frobenius error of bf16 flex vs the fp32 sdpa reference (H200, torch 2.11: 0.002 forward,
# 0.006 backward, the same as bf16 sdpa).
FORWARD_TOLERANCE, BACKWARD_TOLERANCE = 1e-2, 2e-2


def _moderate():
    return drafter_config(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=64, intermediate_size=2816, vocab_size=32000, block_size=16,
                          target_layer_ids=[1, 5, 9], num_target_layers=12, mask_token_id=31999)


def _relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


@pytest.mark.parametrize("backend", ["flex", "flash"])
def test_flex_matches_sdpa_forward_and_backward_in_bf16(backend):
    """Both flex kernels (Triton; flash-attn-4's where installed) on a full and a sliding layer,
    over packed rows (three documents)."""
    if backend == "flash" and (reason := flash_unavailable("cuda")):
        pytest.skip(reason)
    cfg, batch, seq_len, num_anchors = _moderate(), 1, 512, 32
    cfg = dataclasses.replace(cfg, layer_types=["full_attention", "sliding_attention"], sliding_window=40)
    drafter = DFlashDrafter(cfg, seed=0).cuda()
    positions = torch.cat([torch.arange(n) for n in (200, 250, 62)]).unsqueeze(0).cuda()
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(batch, seq_len, cfg.num_features * cfg.hidden_size, generator=gen).cuda()
    embeds = torch.randn(batch, num_anchors * cfg.block_size, cfg.hidden_size, generator=gen).cuda()
    anchors = torch.randint(0, seq_len - 1, (batch, num_anchors), generator=gen).sort(1).values.cuda()
    keep = (torch.rand(batch, num_anchors, generator=gen) > 0.1).cuda()
    probe = torch.randn(batch, num_anchors * cfg.block_size, cfg.hidden_size, generator=gen).cuda()

    def run(backend, bf16):
        drafter.zero_grad(set_to_none=True)
        inputs = features.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = drafter(inputs, embeds, anchors, keep, position_ids=positions, backend=backend)
        (out.float() * probe).sum().backward()
        grads = [p.grad.clone() for p in drafter.parameters()] + [inputs.grad]
        return out.detach(), torch.cat([g.flatten().float() for g in grads])

    ref_out, ref_grad = run("sdpa", bf16=False)
    out, grad = run(backend, bf16=True)
    assert _relative_error(out, ref_out) < FORWARD_TOLERANCE
    assert _relative_error(grad, ref_grad) < BACKWARD_TOLERANCE


@pytest.mark.parametrize("backend", ["flex", "flash"])
def test_training_compiles_once_per_shape_and_never_waits_for_the_device(backend):
    if backend == "flash" and (reason := flash_unavailable("cuda")):
        pytest.skip(reason)
    cfg = _moderate()
    drafter = DFlashDrafter(cfg, seed=0).cuda()
    head = FrozenTargetHead.random(cfg.vocab_size, cfg.hidden_size, seed=0, device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    after_first = None
    for step in range(5):
        ids = torch.randint(0, cfg.mask_token_id, (1, 512), generator=gen, device="cuda")
        mask = (torch.arange(512, device="cuda") >= 100).long().unsqueeze(0)
        hidden = torch.randn(1, 512, cfg.num_features * cfg.hidden_size, generator=gen, device="cuda",
                             dtype=torch.bfloat16)
        # After the first step (compiling), no part of forward and backward waits for the device: the
        # host must stay ahead of the GPU (docs/perf_notes.md).
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = drafter_step(drafter, head, ids, mask, hidden,
                                   step_settings(drafter, backend=backend, compiled=True, num_anchors=24,
                                                 chunk_blocks=16), generator=gen)
            optimizer.zero_grad(set_to_none=True)
            (out.loss_sum / out.counts.weight_sum).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        optimizer.step()
        if step == 0:
            after_first = compile_count()
    assert after_first > 0 and compile_count() == after_first


def test_varlen_target_attention_matches_the_masked_target():
    """Packed rows: flash attention's variable-length kernel per document equals sdpa with the
    block-diagonal mask (bf16), at a Qwen3-like shape."""
    from transformers import Qwen3Config

    from dflash_core.target.capture import random_target
    from dflash_core.target.packing import VARLEN
    config = Qwen3Config(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                         head_dim=64, intermediate_size=2816, vocab_size=32000)
    ids = torch.randint(0, 32000, (2, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.cat([torch.arange(n) for n in (300, 500, 224)]).expand(2, -1).cuda()
    varlen, masked = (random_target(config, layer_ids=[1, 2], device="cuda", dtype=torch.bfloat16, seed=0,
                                    attn_implementation=attention) for attention in (VARLEN, None))
    got, want = varlen.capture(ids, position_ids=positions), masked.capture(ids, position_ids=positions)
    assert _relative_error(got, want) < FORWARD_TOLERANCE
