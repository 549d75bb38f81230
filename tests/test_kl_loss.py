"""drafter.kl_weight: the unary term's KL share from the target's own distribution at each drafted position
(dflash_core/loss/head_loss.py), the target hidden state it reads (dflash_core/loss/objective.py) and the
target's extra captured layer (launcher/resolve.py), down to a launched run."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F

from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.anchors import sample_anchors
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.head_loss import FusedHeadLoss, head_loss, loss_weights
from dflash_core.loss.objective import drafter_step, evaluate_tau
from launcher.config import compose_config
from launcher.distributed.topology import Topology
from launcher.resolve import resolve
from tests.drafters import drafter_config, step_settings
from tests.launching import tiny_overrides, torchrun
from tests.test_objective import OracleDrafter

VOCAB, HIDDEN, BS = 24, 16, 4


@pytest.mark.parametrize("loss", ["dflash", "dpace"])
@pytest.mark.parametrize("kl_weight", [0.25, 1.0])
def test_the_kl_share_matches_autograd_of_the_blended_objective(loss, kl_weight):
    """(1 - w) CE(label) + w KL(p_target || q) per position, weighted by the slots' loss weights, against
    plain autograd through the whole float64 logits (the terms compute in fp32, as the step does: fp32
    rounding, 1e-5 relative); 5 blocks in chunks of 2 (a ragged last chunk); the evaluation path (no
    gradient) sums the same loss."""
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, BS - 1, HIDDEN, dtype=torch.float64, generator=generator, requires_grad=True)
    teacher = torch.randn(2, 5, BS - 1, HIDDEN, dtype=torch.float64, generator=generator)
    head = FrozenTargetHead.random(VOCAB, HIDDEN, seed=3, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 5, BS - 1), generator=generator)
    weights = (torch.rand(2, 5, BS - 1, generator=generator) > 0.3).double()
    fused = FusedHeadLoss.apply(h, head.lm_head_weight, labels, weights, 2, loss, 4.0, 0.5, False, None, 0, teacher,
                                kl_weight)
    logits = head.logits(h.reshape(-1, HIDDEN))
    ce = F.cross_entropy(logits, labels.flatten(), reduction="none").view_as(weights)
    log_p = torch.log_softmax(head.logits(teacher.reshape(-1, HIDDEN)), dim=-1)
    kl = F.kl_div(torch.log_softmax(logits, dim=-1), log_p, log_target=True, reduction="none").sum(-1)
    final = loss_weights(ce.detach(), weights, loss=loss, gamma=4.0, dpace_alpha=0.5)
    plain = (final * ((1 - kl_weight) * ce + kl_weight * kl.view_as(ce))).sum()
    (grad_fused,), (grad_plain,) = (torch.autograd.grad(out * 3.0, h) for out in (fused[0], plain))
    torch.testing.assert_close(fused[0], plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_fused, grad_plain, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        evaluated = head_loss(h, head, labels, weights, loss=loss, gamma=4.0, dpace_alpha=0.5, chunk_blocks=2,
                              compiled=False, teacher=teacher, kl_weight=kl_weight)
    torch.testing.assert_close(evaluated.loss_sum, plain.detach(), rtol=1e-5, atol=1e-6)


def _oracle_case(shift: int):
    """An oracle drafter, and features whose last VOCAB columns (the target's final hidden state, through an
    identity head) give position p the logits 10 x one-hot(input_ids[p + 1 + shift])."""
    gen = torch.Generator().manual_seed(0)
    rows, seq_len = 3, 20
    ids = torch.randint(0, VOCAB - 1, (rows, seq_len), generator=gen)
    mask = (torch.rand(rows, seq_len, generator=gen) < 0.8).long()
    next_ids = torch.roll(ids, -(1 + shift), dims=1)
    hidden = torch.cat([torch.randn(rows, seq_len, 2 * VOCAB, generator=gen),
                        10.0 * F.one_hot(next_ids, VOCAB).float()], dim=-1)
    cfg = drafter_config(hidden_size=VOCAB, num_hidden_layers=1, vocab_size=VOCAB, block_size=BS,
                         mask_token_id=VOCAB - 1)
    drafter = OracleDrafter(cfg, ids)
    head = FrozenTargetHead(torch.randn(VOCAB, VOCAB, generator=gen), torch.eye(VOCAB))
    anchors = sample_anchors(mask, 6, torch.Generator().manual_seed(1))
    return drafter, head, ids, mask, hidden, anchors


def test_each_slot_is_taught_by_the_target_where_the_target_predicts_that_token():
    """Slot k of the block anchored at a is taught by the target's distribution at position a + k - 1: an
    oracle drafter matches it exactly (KL 0, where its CE is not), and a teacher one position off is far."""
    drafter, head, ids, mask, hidden, anchors = _oracle_case(shift=0)
    settings = step_settings(drafter, kl_weight=1.0)
    aligned = drafter_step(drafter, head, ids, mask, hidden, settings, fixed_anchors=anchors)
    ce_only = drafter_step(drafter, head, ids, mask, hidden, step_settings(drafter, kl_weight=0.0),
                           fixed_anchors=anchors)
    # The oracle's CE is log(1 + 23 e^-10) = 1.0e-3 a slot; between two equal distributions only fp32
    # rounding of the two log-normalisers remains (~1e-7 a slot): 100x below the CE is far from both.
    assert abs(float(aligned.counts.loss_sum)) < 1e-2 * float(ce_only.counts.loss_sum)
    assert aligned.counts.weight_sum == ce_only.counts.weight_sum > 0
    *_, shifted_hidden, _ = _oracle_case(shift=1)
    shifted = drafter_step(drafter, head, ids, mask, shifted_hidden, settings, fixed_anchors=anchors)
    assert shifted.counts.loss_sum > 1.0
    # Held-out scoring reads the label's CE alone, whatever the teacher says.
    held_out = evaluate_tau(drafter, head, ids, mask, hidden, settings)
    assert held_out.summary()["loss"] == pytest.approx(
        evaluate_tau(drafter, head, ids, mask, hidden[..., :-VOCAB], step_settings(drafter)).summary()["loss"])


def test_the_compiled_kl_step_matches_eager(fresh_dynamo):
    """compiled=True (CPU, sdpa): the KL share's loss and gradients as eager computes them (fp32; 1e-4, the
    compiled step's reductions run in another order)."""
    cfg = drafter_config(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=VOCAB, block_size=BS,
                         mask_token_id=VOCAB - 1)
    eager = DFlashDrafter(cfg, seed=0)
    compiled = copy.deepcopy(eager)
    head = FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (2, 28), generator=gen)
    mask = torch.ones_like(ids)
    hidden = torch.randn(2, 28, (cfg.num_features + 1) * HIDDEN, generator=gen)
    outs = []
    for model, is_compiled in ((eager, False), (compiled, True)):
        settings = step_settings(model, num_anchors=6, chunk_blocks=3, compiled=is_compiled, kl_weight=0.5)
        out = drafter_step(model, head, ids, mask, hidden, settings, generator=torch.Generator().manual_seed(0))
        out.loss_sum.backward()
        outs.append((out.loss_sum, [p.grad for p in model.parameters()]))
    (want, want_grads), (got, got_grads) = outs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_target_captures_its_last_layer_for_the_kl_share(tiny_target_dir):
    """kl_weight > 0: the target's last layer (reported after its final norm) is captured after the drafter's
    layers, one hidden_size wider; at 0 nothing changes."""
    base = [f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny"]
    plain = resolve(compose_config(base), Topology(1, 1), torch.device("cpu"))
    taught = resolve(compose_config([*base, "drafter.kl_weight=0.5"]), Topology(1, 1), torch.device("cpu"))
    layers = plain.target.hf_config.num_hidden_layers
    assert layers - 1 not in plain.target.layer_ids
    assert taught.target.layer_ids == [*plain.target.layer_ids, layers - 1]
    assert taught.target.feature_width == plain.target.feature_width + plain.drafter.hidden_size
    assert (plain.step.kl_weight, taught.step.kl_weight) == (0.0, 0.5)


@pytest.mark.multiproc
def test_a_launched_run_trains_with_the_kl_share(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    proc = torchrun(2, "topology=t1d1", f"run.dir={run_dir}", "train.steps=4", "train.eval_every=4",
                    "drafter.kl_weight=0.5", *tiny_overrides(tmp_path, tiny_target_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "target loaded" in (run_dir / "logs" / "target0.log").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4]
    assert all(r["loss"] > 0 for r in records if "loss" in r)


def test_a_dflash2_keeps_its_selector_term_under_the_kl_share():
    """The KL share changes the unary term only: a DFlash 2's selector term (its K-way CE over the unary
    top-K) and its counts are those of the CE-only step on the same blocks."""
    from tests.test_dflash2_training import batch, dflash2
    drafter = dflash2()
    head = FrozenTargetHead.random(drafter.config.vocab_size, drafter.config.hidden_size, seed=2)
    ids, mask, hidden = batch()
    teacher = torch.randn(*ids.shape, drafter.config.hidden_size, generator=torch.Generator().manual_seed(5))
    anchors = sample_anchors(mask, 4, torch.Generator().manual_seed(1))
    plain = drafter_step(drafter, head, ids, mask, hidden, step_settings(drafter), fixed_anchors=anchors)
    taught = drafter_step(drafter, head, ids, mask, torch.cat([hidden, teacher], dim=-1),
                          step_settings(drafter, kl_weight=0.5), fixed_anchors=anchors)
    assert taught.counts.selector_loss_sum == pytest.approx(float(plain.counts.selector_loss_sum), rel=1e-6)
    assert torch.equal(taught.counts.slot_correct, plain.counts.slot_correct)
    assert abs(float(taught.counts.loss_sum - plain.counts.loss_sum)) > 1e-3
    taught.loss_sum.backward()
    assert drafter.candidate_selector.predecessor_codebook.grad.abs().sum() > 0
