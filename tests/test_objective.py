import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.anchors import all_valid_anchors, sample_anchors
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.head_loss import loss_weights
from dflash_core.loss.objective import (
    block_input_ids,
    block_labels,
    decoding_walk,
    default_gamma,
    drafter_step,
    evaluate_tau,
)
from dflash_core.target.families import drafter_config_for_target
from tests.drafters import drafter_config, step_settings

VOCAB, HIDDEN, BS, MASK_ID = 40, 32, 4, 39


def tiny_drafter(seed=0):
    cfg = drafter_config(hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=VOCAB, block_size=BS,
                         mask_token_id=MASK_ID)
    return DFlashDrafter(cfg, seed=seed)


def random_batch(rows=4, seq_len=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, MASK_ID, (rows, seq_len), generator=gen)
    loss_mask = (torch.rand(rows, seq_len, generator=gen) < 0.8).long()
    hidden = torch.randn(rows, seq_len, 2 * HIDDEN, generator=gen)
    return input_ids, loss_mask, hidden


class OracleDrafter(nn.Module):
    """Emits 10 x one-hot(input_ids[a + k]) for slot k (the config's vocabulary wide): with an identity
    lm_head every correctly aligned label is an argmax hit."""

    def __init__(self, config, input_ids):
        super().__init__()
        self.config, self.input_ids = config, input_ids
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, features, block_embeds, anchors, keep, *, position_ids, backend, compiled):
        positions = anchors.unsqueeze(-1) + torch.arange(self.config.block_size)
        truth = self.input_ids.gather(1, positions.clamp(max=self.input_ids.shape[1] - 1).flatten(1))
        return 10.0 * F.one_hot(truth, self.config.vocab_size).float() + self.offset


def identity_head():
    return FrozenTargetHead(torch.randn(VOCAB, VOCAB), torch.eye(VOCAB))


def test_default_gamma():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7, 5, 4)
    assert default_gamma(4) == 2 and default_gamma(2) == 1
    assert default_gamma(12) == pytest.approx(5 + 2 / 3)
    assert default_gamma(32) == pytest.approx(7 + 16 / 3)


def test_block_input_is_anchor_token_then_mask_tokens():
    input_ids = torch.arange(10, 20).unsqueeze(0)
    ids = block_input_ids(input_ids, torch.tensor([[2, 7]]), BS, MASK_ID)
    assert ids.tolist() == [[12, MASK_ID, MASK_ID, MASK_ID, 17, MASK_ID, MASK_ID, MASK_ID]]


def test_labels_slot_k_predicts_token_a_plus_k():
    input_ids = torch.arange(100, 110).unsqueeze(0)                  # S = 10
    loss_mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    anchors, keep = torch.tensor([[1, 7, 0]]), torch.tensor([[True, True, False]])
    labels, weights = block_labels(input_ids, loss_mask, anchors, keep, BS)
    assert labels[0, 0].tolist() == [101, 102, 103, 104]
    assert labels[0, 1, :3].tolist() == [107, 108, 109]
    assert weights[0, 0].tolist() == [0, 1, 1, 0]    # slot 0 never; loss_mask[4] = 0
    assert weights[0, 1].tolist() == [0, 1, 1, 0]    # 7 + 3 = 10 is past S
    assert weights[0, 2].tolist() == [0, 0, 0, 0]    # invalid block


def test_labels_never_cross_a_document_boundary():
    input_ids = torch.arange(100, 110).unsqueeze(0)                  # S = 10
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]])      # documents 0..4, 5..7, 8..9
    anchors, keep = torch.tensor([[2, 5, 6]]), torch.tensor([[True, True, True]])
    labels, weights = block_labels(input_ids, loss_mask, anchors, keep, BS, position_ids)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]              # labels themselves unchanged
    assert weights[0].tolist() == [[0, 1, 1, 0],                       # 5 opens the next document
                                   [0, 1, 1, 0],                       # 8 opens the third
                                   [0, 1, 0, 0]]
    _, unpacked = block_labels(input_ids, loss_mask, anchors, keep, BS)
    assert unpacked[0].tolist() == [[0, 1, 1, 1]] * 3


def test_step_with_an_oracle_drafter_hits_every_label():
    input_ids, loss_mask, hidden = random_batch()
    drafter = OracleDrafter(tiny_drafter().config, input_ids)
    anchors, keep = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    out = drafter_step(drafter, identity_head(), input_ids, loss_mask, hidden, step_settings(drafter),
                       fixed_anchors=(anchors, keep))
    expected_weight = torch.zeros(BS)
    expected_tau = 0
    for b, j in keep.nonzero().tolist():
        a, run_open = int(anchors[b, j]), True
        expected_tau += 1
        for k in range(1, BS):
            supervised = a + k < input_ids.shape[1] and bool(loss_mask[b, a + k])
            expected_weight[k] += supervised
            run_open = run_open and supervised
            expected_tau += run_open
    counts = out.counts
    assert torch.equal(counts.slot_weight, expected_weight.double())
    assert torch.equal(counts.slot_correct, expected_weight.double())
    assert counts.tau_sum == expected_tau and counts.tau_count == keep.sum()
    assert counts.anchor_slots == keep.numel()
    assert counts.summary()["anchor_fill"] == pytest.approx(keep.sum().item() / keep.numel())


def test_dflash_weights_decay_from_slot_one():
    weights = torch.tensor([[[1.0, 1.0, 0.0]]])   # drafted slots 1..3
    got = loss_weights(torch.zeros(1, 1, 3), weights, loss="dflash", gamma=2.0, dpace_alpha=0.5)
    assert torch.allclose(got, torch.tensor([[[1.0, math.exp(-0.5), 0.0]]]))


def test_dpace_weights_are_suffix_sums_of_acceptance_prefixes():
    ce = torch.tensor([[[0.1, 0.7, 0.3, 2.0]]])        # drafted slots 1..4
    weights = torch.tensor([[[1.0, 1.0, 1.0, 0.0]]])
    alpha = 0.5
    q = [(1 - alpha) * math.exp(-c) + alpha for c in ce.flatten().tolist()]
    prefix = [math.prod(q[:k + 1]) for k in range(4)]   # over slots 1..k
    expected = [w * sum(prefix[j] * weights.flatten()[j] for j in range(k, 4))
                for k, w in enumerate(weights.flatten().tolist())]
    got = loss_weights(ce, weights, loss="dpace", gamma=None, dpace_alpha=alpha)
    assert torch.allclose(got.flatten(), torch.tensor(expected))


def test_loss_chunking_does_not_change_loss_or_gradients():
    input_ids, loss_mask, hidden = random_batch()
    head = FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    anchors = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    results = []
    for chunk_blocks in (1, 4, 6):
        drafter = tiny_drafter()
        out = drafter_step(drafter, head, input_ids, loss_mask, hidden,
                           step_settings(drafter, loss="dpace", chunk_blocks=chunk_blocks), fixed_anchors=anchors)
        out.loss_sum.backward()
        results.append((out.loss_sum.detach(), [p.grad for p in drafter.parameters()]))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        for got, want in zip(grads, results[0][1]):
            torch.testing.assert_close(got, want)


def split_gradients(drafter, head, batch, anchors, keep, *, ranks, accum, loss,
                    normalise_globally=True):
    """Simulate `ranks` drafter ranks x `accum` micro-steps on one global batch, the way the
    launcher does it: backward each loss_sum, all-reduce the weight sums, scale every rank's
    gradients by world / global weight sum, then average across ranks."""
    input_ids, loss_mask, hidden = batch
    pieces = torch.arange(input_ids.shape[0]).chunk(ranks * accum)
    replicas = [copy.deepcopy(drafter) for _ in range(ranks)]
    weight_sums = [[] for _ in range(ranks)]
    for index, rows in enumerate(pieces):
        rank = index // accum
        out = drafter_step(replicas[rank], head, input_ids[rows], loss_mask[rows], hidden[rows],
                           step_settings(drafter, loss=loss, chunk_blocks=2),
                           fixed_anchors=(anchors[rows], keep[rows]))
        if normalise_globally:
            out.loss_sum.backward()
        else:  # the classic bug: normalise each micro-batch by its own weights
            (out.loss_sum / out.counts.weight_sum / accum).backward()
        weight_sums[rank].append(out.counts.weight_sum)
    global_weight_sum = sum(sum(w) for w in weight_sums)
    grads = []
    for params in zip(*(replica.parameters() for replica in replicas)):
        scale = ranks / global_weight_sum if normalise_globally else 1.0
        grads.append(sum(p.grad * scale for p in params) / ranks)
    return grads


@pytest.mark.parametrize("loss", ["dflash", "dpace"])
def test_gradient_is_independent_of_the_rank_and_accumulation_split(loss):
    batch = random_batch(rows=4, seq_len=24)
    drafter, head = tiny_drafter(), FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    anchors, keep = sample_anchors(batch[1], 6, torch.Generator().manual_seed(0))
    reference = split_gradients(drafter, head, batch, anchors, keep, ranks=1, accum=1,
                                loss=loss)
    for ranks, accum in [(2, 1), (1, 2), (2, 2)]:
        got = split_gradients(drafter, head, batch, anchors, keep, ranks=ranks, accum=accum,
                              loss=loss)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    naive = split_gradients(drafter, head, batch, anchors, keep, ranks=2, accum=2,
                            loss=loss, normalise_globally=False)
    assert not all(torch.allclose(g, r, rtol=1e-3) for g, r in zip(naive, reference))


def test_step_is_reproducible_with_equal_generators_and_noise_changes_it():
    input_ids, loss_mask, hidden = random_batch()
    drafter, head = tiny_drafter(), FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)

    def loss(seed, noise=0.0):
        out = drafter_step(drafter, head, input_ids, loss_mask, hidden,
                           step_settings(drafter, num_anchors=5, feature_noise_std=noise),
                           generator=torch.Generator().manual_seed(seed))
        return out.loss_sum.item()
    assert loss(0) == loss(0)
    assert loss(0) != loss(1)
    # The noise draws from the global RNG: seeded here, so the draw is this test's own whatever ran before it
    # (at std 0.05 the tiny drafter's loss of ~154 moved by ~1e-3, and one unlucky draw by less than an ulp).
    # Seeded, std 0.5 moves it by 2.4e-3: the bound is 10 ulps of the loss, far under that, far over rounding.
    torch.manual_seed(0)
    assert abs(loss(0, noise=0.5) - loss(0)) > 1e-4


def test_evaluate_tau_of_an_oracle_is_the_supervised_run_length():
    input_ids, loss_mask, hidden = random_batch()
    drafter = OracleDrafter(tiny_drafter().config, input_ids)
    counts = evaluate_tau(drafter, identity_head(), input_ids, loss_mask, hidden, step_settings(drafter, num_anchors=4))
    result = counts.summary()
    taus = []
    for b in range(input_ids.shape[0]):
        for a in range(input_ids.shape[1] - 1):
            if loss_mask[b, a] and loss_mask[b, a + 1]:
                run = 0
                while run + 1 < BS and a + run + 1 < input_ids.shape[1] and loss_mask[b, a + run + 1]:
                    run += 1
                taus.append(1 + run)
    assert counts.tau_count == len(taus)
    assert result["tau"] == pytest.approx(sum(taus) / len(taus))
    assert result["acc_k"] == [1.0] * (BS - 1) and result["eal"] == pytest.approx(BS)


def test_evaluate_tau_counts_misses():
    input_ids, loss_mask, hidden = random_batch()
    drafter = OracleDrafter(tiny_drafter().config, torch.roll(input_ids, 1, dims=1))
    result = evaluate_tau(drafter, identity_head(), input_ids, loss_mask, hidden,
                          step_settings(drafter, num_anchors=4)).summary()
    assert result["tau"] < 1.5 and max(result["acc_k"]) < 0.5 and result["eal"] < 1.5


@pytest.mark.parametrize("loss", ["dflash", "dpace"])
def test_fused_head_loss_matches_plain_autograd(loss):
    """The gradient formed in the forward pass equals autograd through the logits (5 blocks in
    chunks of 2: a ragged last chunk)."""
    from dflash_core.loss.head_loss import FusedHeadLoss
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 4, HIDDEN, dtype=torch.float64, generator=generator, requires_grad=True)
    head = FrozenTargetHead.random(VOCAB, HIDDEN, seed=3, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (2, 5, 4), generator=generator)
    weights = (torch.rand(2, 5, 4, generator=generator) > 0.3).double()
    weights[..., 0] = 0
    fused = FusedHeadLoss.apply(h, head.lm_head_weight, labels, weights, 2, loss, 4.0, 0.5, False)
    logits = head.logits(h.reshape(-1, HIDDEN)).float()
    ce = F.cross_entropy(logits, labels.flatten(), reduction="none").view_as(weights)
    final = loss_weights(ce.detach(), weights, loss=loss, gamma=4.0, dpace_alpha=0.5)
    plain = (final * ce).sum(), final.sum(), (logits.argmax(-1) == labels.flatten()).view_as(labels)
    # An upstream gradient other than 1 checks that backward scales the saved gradient.
    (grad_fused,), (grad_plain,) = (torch.autograd.grad(out[0] * 3.0, h) for out in (fused, plain))
    torch.testing.assert_close(fused[0], plain[0].double(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], plain[1].double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(fused[2], plain[2])
    torch.testing.assert_close(grad_fused, grad_plain, rtol=1e-5, atol=1e-6)


def test_compiled_layers_and_head_loss_match_eager_and_compile_once(fresh_dynamo):
    """compiled=True: same loss and gradients as eager (CPU, sdpa), and a second micro-batch
    with new data at the same shape compiles nothing new."""
    from dflash_core.drafter.compile import compile_count
    cfg = drafter_config(hidden_size=HIDDEN, num_hidden_layers=3, vocab_size=VOCAB, block_size=BS,
                         mask_token_id=MASK_ID)
    eager = DFlashDrafter(cfg, seed=0)
    compiled = copy.deepcopy(eager)
    head = FrozenTargetHead.random(VOCAB, HIDDEN, seed=1)
    before = {name: compile_count(name) for name in ("drafter_layer", "head_loss", "rms_norm", "context_projection")}
    for seed in (0, 1):
        batch = random_batch(rows=2, seq_len=28, seed=seed)   # 28 context rows, 6 x 4 block rows
        outs = []
        for model, is_compiled in ((eager, False), (compiled, True)):
            model.zero_grad()
            out = drafter_step(model, head, *batch,
                               step_settings(model, num_anchors=6, loss="dpace", chunk_blocks=3, compiled=is_compiled),
                               generator=torch.Generator().manual_seed(seed))
            out.loss_sum.backward()
            outs.append((out, [p.grad.clone() for p in model.parameters()]))
        (want, want_grads), (got, got_grads) = outs
        torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.counts.slot_correct, want.counts.slot_correct)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        if seed == 0:
            first = {name: compile_count(name) - before[name] for name in before}
    # One layer graph for every layer (the first included); one head graph; one graph for the final norm
    # (the blocks' rows) and one for the context's projection and norm.
    assert first == {"drafter_layer": 1, "head_loss": 1, "rms_norm": 1, "context_projection": 1}
    assert {name: compile_count(name) - before[name] for name in before} == first


def test_decoding_walk_visits_only_the_anchors_decoding_lands_on():
    """Two documents in one packed row, spans of 9 and 4 supervised tokens. Span 1: the block at its
    first token accepts 3 (commits 4), the next lands 4 on and accepts everything left (the block's
    bonus token ends the span): 2 steps, 9 tokens, though six anchors in between accepted nothing.
    Span 2: 0 then 1 accepted. Anchors decoding skips never count."""
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]])
    anchors = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 0]])
    keep = torch.tensor([[True] * 11 + [False]])
    accepted = torch.tensor([[3, 0, 0, 0, 4, 0, 0, 0, 0, 1, 0, 7]])
    tokens, steps = decoding_walk(anchors, keep, accepted, loss_mask, position_ids)
    assert (tokens, steps) == (4 + 5 + 1 + 2, 4)
    # The documents' boundary comes from position_ids alone when the masks of two answers touch.
    touching = torch.tensor([[1, 1, 1, 1]])
    walk = decoding_walk(torch.tensor([[0, 2]]), torch.tensor([[True, True]]), torch.tensor([[0, 0]]),
                         touching, torch.tensor([[0, 1, 0, 1]]))
    assert walk == (2, 2)


def test_decode_tau_is_what_speculative_decoding_of_the_same_text_reports(tiny_target_dir):
    """A drafter fitted to the tiny target's greedy answer is decoded speculatively; the same answer as
    held-out data gives, through evaluate_tau's walk, exactly the steps decoding took (all but the last,
    which decoding may commit past its max_new_tokens). Everything runs in float64, so no argmax of
    either path sits close enough to a tie for the two summation orders to flip it, on any CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_core.drafter.model import DFlashDrafter
    from dflash_core.serving.speculative import greedy_decode, head_from_target, speculative_generate
    from dflash_core.target.tiny import first_unused_token_id

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    prompt = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "How many hours are in 3 days?"}],
                                                     tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    config = drafter_config_for_target(target.config, num_layers=1, block_size=8, target_layer_ids=[0, 2],
                                       mask_token_id=first_unused_token_id(tokenizer, target.config))
    drafter = DFlashDrafter(config, seed=0).double()
    head = head_from_target(target)

    def as_data(answer):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            states = target(ids, output_hidden_states=True).hidden_states
        hidden = torch.cat([states[i + 1] for i in config.target_layer_ids], dim=-1)
        return ids, torch.tensor([[0] * len(prompt) + [1] * len(answer)]), hidden

    ids, mask, hidden = as_data(greedy_decode(target, prompt, 40))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(40):   # partly fitted: uneven acceptance along the answer tells the walk from the anchor mean
        drafter_step(drafter, head, ids, mask, hidden, step_settings(drafter, num_anchors=64),
                     fixed_anchors=all_valid_anchors(mask)).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad()
    drafter.eval()

    decoded = speculative_generate(target, drafter, prompt, max_new_tokens=40)
    steps = decoded.accepted[:-1]
    assert len(steps) >= 3 and len(set(steps)) > 1, decoded.accepted
    answer = decoded.tokens[:1 + sum(a + 1 for a in steps)]
    counts = evaluate_tau(drafter, head, *as_data(answer), step_settings(drafter, num_anchors=8))
    assert (counts.walk_steps, counts.walk_tokens) == (len(steps), sum(a + 1 for a in steps))
    assert counts.summary()["decode_tau"] == pytest.approx(sum(a + 1 for a in steps) / len(steps))
