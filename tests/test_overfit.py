"""A tiny drafter must memorise one sample: every slot's accuracy reaches >= 0.95."""

import torch

from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.objective import drafter_step, evaluate_tau
from tests.drafters import drafter_config, step_settings

VOCAB, HIDDEN, SEQ, BS = 64, 64, 96, 8


def test_tiny_drafter_overfits_one_sample():
    torch.manual_seed(0)
    cfg = drafter_config(hidden_size=HIDDEN, head_dim=16, intermediate_size=128, vocab_size=VOCAB, block_size=BS,
                         mask_token_id=VOCAB - 1)
    drafter = DFlashDrafter(cfg, seed=0)
    head = FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB - 1, (1, SEQ), generator=gen)
    loss_mask = torch.ones(1, SEQ, dtype=torch.long)
    loss_mask[:, :10] = 0  # a "prompt"
    hidden = torch.randn(1, SEQ, 2 * HIDDEN, generator=gen)  # stands in for target features

    settings = step_settings(drafter, num_anchors=48, chunk_blocks=16)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(200):
        out = drafter_step(drafter, head, input_ids, loss_mask, hidden, settings, generator=gen)
        optimizer.zero_grad()
        (out.loss_sum / out.counts.weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()

    result = evaluate_tau(drafter, head, input_ids, loss_mask, hidden, settings).summary()
    assert len(result["acc_k"]) == BS - 1
    assert min(result["acc_k"]) >= 0.95, result["acc_k"]
    assert result["tau"] > 0.9 * (BS - 0.5)
