"""Training a DFlash 2 drafter (drafter.kind=dflash2): its objective against a plain reference, identity with
the DFlash backbone it starts from, and a launched CPU run that trains, evaluates and resumes bit for bit."""
import copy

import pytest
import torch
import torch.nn.functional as F

from dflash_core.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.head_loss import loss_weights
from dflash_core.loss.objective import block_input_ids, block_labels, drafter_step, evaluate_tau
from dflash_core.loss.selector_loss import selector_terms
from dflash_core.serving.model_card import read_card_info
from launcher.run_io import checkpoint
from tests.drafters import SMALL, step_settings
from tests.launching import tiny_overrides, torchrun

VOCAB, K = 40, 5
SELECTOR = dict(conv_group_size=8, conv_kernel_size=2, selector_rank=6, selector_top_k=K)


def dflash2(seed=0, moved=True, **overrides):
    """A small DFlash 2 (vocabulary 40, top-5), its new parts off their identity start when `moved`."""
    cfg = DFlash2Config(**{**SMALL, "vocab_size": VOCAB, "mask_token_id": VOCAB - 1, **SELECTOR, **overrides})
    drafter = DFlash2Drafter(cfg, seed=seed)
    if moved:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if "conv" in name or "candidate_selector" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return drafter


def batch(seed=0, rows=2, seq_len=24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (rows, seq_len), generator=gen)
    mask = (torch.rand(rows, seq_len, generator=gen) < 0.85).long()
    return ids, mask, torch.randn(rows, seq_len, 2 * SMALL["hidden_size"], generator=gen)


def reference_loss(drafter, head, ids, mask, hidden, anchors, keep, *, selector_weight, gamma):
    """The DFlash 2 objective written out slot by slot with plain autograd through the whole logits:
    the position-weighted unary CE plus selector_weight x the position-weighted K-way CE of the
    selector after the true previous token, the label joining the softmax (only) where it is not in
    the top-K."""
    cfg = drafter.config
    h = drafter(hidden, head.embed(block_input_ids(ids, anchors, cfg.block_size, cfg.mask_token_id)), anchors, keep,
                backend="sdpa").view(*anchors.shape, cfg.block_size, -1)
    labels, weights = block_labels(ids, mask, anchors, keep, cfg.block_size)
    logits = h[:, :, 1:] @ head.lm_head_weight.T
    final = loss_weights(None, weights[..., 1:], loss="dflash", gamma=gamma, dpace_alpha=0.0)
    unary_ce = F.cross_entropy(logits.flatten(0, 2), labels[..., 1:].flatten(), reduction="none")
    total = (final.flatten() * unary_ce).sum()
    selector = drafter.candidate_selector
    A, B = selector.predecessor_codebook, selector.successor_codebook
    for b, n, s in (final > 0).nonzero().tolist():
        label, previous = int(labels[b, n, s + 1]), int(labels[b, n, s])
        candidates = logits[b, n, s].topk(K).indices.tolist()
        target = candidates.index(label) if label in candidates else K
        if target == K:
            candidates.append(label)
        query = A[previous] * selector.hidden_projection(h[b, n, s + 1])
        scores = torch.stack([logits[b, n, s, c] + (query * B[c]).sum() for c in candidates])
        total = total + selector_weight * final[b, n, s] * -torch.log_softmax(scores, 0)[target]
    return total, final.sum()


def test_the_step_equals_the_objective_written_out_with_its_gradients():
    drafter = dflash2().double()
    head = FrozenTargetHead.random(VOCAB, SMALL["hidden_size"], seed=2, dtype=torch.float64)
    ids, mask, hidden = batch()
    hidden = hidden.double()
    settings = step_settings(drafter, num_anchors=6, chunk_blocks=4, selector_weight=0.7)   # 4: a ragged chunk
    anchors = torch.tensor([[0, 3, 8, 12, 17, 0], [2, 6, 9, 14, 19, 20]])
    keep = torch.tensor([[True] * 5 + [False], [True] * 6])
    reference = copy.deepcopy(drafter)
    out = drafter_step(drafter, head, ids, mask, hidden, settings, fixed_anchors=(anchors, keep))
    out.loss_sum.backward()
    want, want_weight = reference_loss(reference, head, ids, mask, hidden, anchors, keep, selector_weight=0.7,
                                       gamma=settings.gamma)
    want.backward()
    counts = out.counts
    # The reference runs in float64; the step's row statistics and unary logits are fp32 (as the served unary
    # logits are): agreement to fp32's ~1e-7 relative, summed over a few dozen terms.
    torch.testing.assert_close(out.loss_sum.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(counts.weight_sum, want_weight.double(), rtol=1e-6, atol=1e-6)   # fp32 label weights
    for (name, got), (_, expected) in zip(drafter.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # The batch has labels inside and outside the top-K, so both branches of the reference ran.
    supervised = counts.slot_weight[1:].sum()
    assert 0 < counts.recall_hits < supervised and counts.selector_hits <= counts.recall_hits
    summary = counts.summary()
    assert summary["loss"] == pytest.approx(float(want.detach() / want_weight))
    assert summary["recall_at_k"] == pytest.approx(float(counts.recall_hits / supervised))
    # A training step runs no walk: its tau is the unary top-1's, the oracle's counts any top-K hit.
    assert summary["unary_tau"] == summary["tau"] <= summary["oracle_tau"] and summary["decode_tau"] == 0


def test_selector_terms_mask_the_label_where_it_is_a_candidate_and_count_recall_and_picks():
    drafter = dflash2()
    hidden = torch.randn(1, 1, 2, SMALL["hidden_size"], generator=torch.Generator().manual_seed(3))
    # Slot 1: the label 7 is the top-K's third; slot 2: the label 30 is not among the K.
    ids = torch.tensor([[[[4, 9, 7, 1, 2, 7], [5, 6, 8, 11, 12, 30]]]])
    logits = torch.tensor([[[[3.0, 2.5, 2.0, 1.0, 0.5, 2.0], [3.0, 2.0, 1.5, 1.0, 0.0, -1.0]]]])
    terms = selector_terms(drafter, hidden, logits, ids, torch.tensor([[[13, 7]]]))
    with torch.no_grad():
        scores = drafter.teacher_forced_scores(torch.tensor([[[13, 7]]]), ids, logits, hidden)[0, 0]
    torch.testing.assert_close(terms.ce[0, 0, 0], torch.logsumexp(scores[0, :K], 0) - scores[0, 2])
    torch.testing.assert_close(terms.ce[0, 0, 1], torch.logsumexp(scores[1], 0) - scores[1, K])
    assert terms.recalled.tolist() == [[[True, False]]]
    assert terms.picked.tolist() == [[[bool(scores[0, :K].argmax() == 2), False]]]


def test_detach_stops_the_selector_term_at_the_backbone():
    ids, mask, hidden = batch()
    head = FrozenTargetHead.random(VOCAB, SMALL["hidden_size"], seed=2)
    grads = {}
    for case, keys in ((False, {}), (True, dict(selector_detach=True)), ("unary", dict(selector_weight=0))):
        drafter = dflash2()
        drafter_step(drafter, head, ids, mask, hidden, step_settings(drafter, num_anchors=6, **keys),
                     generator=torch.Generator().manual_seed(0)).loss_sum.backward()
        grads[case] = {name: p.grad for name, p in drafter.named_parameters()}
    for name, grad in grads[True].items():
        if "candidate_selector" in name:   # the selector's own weights learn from it either way
            torch.testing.assert_close(grad, grads[False][name])
            assert grad.abs().sum() > 0
        else:   # the backbone sees the unary term alone (the same sums in the same order: exact)
            assert torch.equal(grad, grads["unary"][name]), name
            assert not torch.equal(grad, grads[False][name]), name


def test_a_fresh_dflash2_on_dflash_weights_scores_and_evaluates_as_dflash():
    """Identity at the start: the backbone's weights, the new parts as initialised -> the unary loss, its
    gradient into the backbone and every held-out figure of the unary walk are DFlash's bit for bit; the
    selector's greedy walk is the unary walk, so the drafted walk is too."""
    fresh = dflash2(seed=4, moved=False)
    dflash = DFlashDrafter(fresh.config.backbone(), seed=5)
    fresh.load_state_dict(dflash.state_dict(), strict=False)
    head = FrozenTargetHead.random(VOCAB, SMALL["hidden_size"], seed=2)
    ids, mask, hidden = batch(seed=1, rows=3)
    outs = {}
    for drafter in (dflash, fresh):
        settings = step_settings(drafter, num_anchors=6, selector_weight=0)
        out = drafter_step(drafter, head, ids, mask, hidden, settings, generator=torch.Generator().manual_seed(0))
        out.loss_sum.backward()
        outs[type(drafter)] = out, evaluate_tau(drafter, head, ids, mask, hidden, settings).summary()
    (step, held_out), (step2, held_out2) = outs[DFlashDrafter], outs[DFlash2Drafter]
    assert torch.equal(step2.loss_sum, step.loss_sum) and torch.equal(step2.counts.tau_sum, step.counts.tau_sum)
    for name, p in dflash.named_parameters():
        assert torch.equal(fresh.get_parameter(name).grad, p.grad), name
    for key, value in held_out.items():
        assert held_out2[key] == value, key
    assert (held_out2["unary_tau"], held_out2["unary_decode_tau"]) == (held_out["tau"], held_out["decode_tau"])
    assert held_out2["oracle_tau"] >= held_out2["tau"] and held_out2["recall_at_k"] > held_out2["acc"]


@pytest.mark.multiproc
def test_a_launched_dflash2_run_trains_evaluates_and_resumes_bitwise(tmp_path, tiny_target_dir):
    """t1d2 on CPU (sdpa, eager: torch refuses flex_attention's backward on CPU) with packed fixed-length
    rows and the sharded optimiser over two drafters; killed after its step-4 checkpoint and relaunched, it
    ends with exactly the weights of the straight run."""
    import json
    steps = 8
    common = ["topology=t1d2", "drafter.kind=dflash2", f"train.steps={steps}", "run.checkpoint_every=4",
              "train.eval_every=4", "data.fixed_length=192", "optim.lr=3e-3", "run.log_every=1",
              *tiny_overrides(tmp_path, tiny_target_dir)]
    straight = tmp_path / "straight"
    proc = torchrun(3, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"] and train[-1]["selector_loss"] < train[0]["selector_loss"]
    evals = [r for r in records if r["kind"] == "eval"]
    figures = {"unary_decode_tau", "oracle_decode_tau", "recall_at_k", "selector_acc"}
    assert len(evals) == 2 and all(figures <= set(r) for r in evals)
    # The held-out figures reach summary.json, the end summary and the export's card.
    held_out = json.loads((straight / "summary.json").read_text())["held_out"]
    assert held_out == {key: value for key, value in evals[-1].items() if key not in ("kind", "step")}
    assert held_out["oracle_decode_tau"] >= held_out["decode_tau"] and held_out["recall_at_k"] >= held_out["acc"]
    assert f"held-out: decoding tau {held_out['decode_tau']:.3f}" in proc.stderr
    assert f"[selector walk; unary-only walk {held_out['unary_decode_tau']:.3f}, oracle walk" in proc.stderr
    card = read_card_info(straight / "export")
    assert card["heldout_tau"] == held_out["decode_tau"]
    assert card["heldout_unary_tau"] == held_out["unary_decode_tau"]
    assert card["heldout_recall_at_k"] == held_out["recall_at_k"]
    assert "Held-out tau of the unary top-1 walk" in (straight / "export" / "README.md").read_text()
    assert json.loads((straight / "export" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]

    resumed = tmp_path / "resumed"
    assert torchrun(3, *common, f"run.dir={resumed}", "fault.rank=1", "fault.step=6").returncode != 0
    relaunched = torchrun(3, *common, f"run.dir={resumed}")
    assert relaunched.returncode == 0, relaunched.stderr[-4000:]
    assert "resuming at step 4" in relaunched.stderr
    final = [checkpoint.load_weights(run / "checkpoints" / f"step_{steps:08d}")[2] for run in (straight, resumed)]
    assert final[0].keys() == final[1].keys() and any("candidate_selector" in key for key in final[0])
    for key in final[0]:
        assert torch.equal(final[0][key], final[1][key]), key


def test_the_compiled_step_matches_eager_and_compiles_once(fresh_dynamo):
    """drafter.compile: the DFlash 2 layers (convolutions around attention and MLP) through the one compiled
    layer graph, the selector term beside it: the loss and gradients of eager (CPU, sdpa), and a second
    micro-batch of the same shape compiles nothing new."""
    from dflash_core.drafter.compile import compile_count
    eager = dflash2()
    compiled = copy.deepcopy(eager)
    head = FrozenTargetHead.random(VOCAB, SMALL["hidden_size"], seed=1)
    names = ("drafter_layer", "head_loss", "rms_norm", "context_projection")
    before = {name: compile_count(name) for name in names}
    for seed in (0, 1):
        ids, mask, hidden = batch(seed=seed, rows=2, seq_len=28)
        outs = []
        for model, is_compiled in ((eager, False), (compiled, True)):
            out = drafter_step(model, head, ids, mask, hidden,
                               step_settings(model, num_anchors=6, chunk_blocks=3, compiled=is_compiled),
                               generator=torch.Generator().manual_seed(seed))
            out.loss_sum.backward()
            outs.append((out, {name: p.grad for name, p in model.named_parameters()}))
            model.zero_grad()
        (want, want_grads), (got, got_grads) = outs
        # Inductor fuses and reorders fp32 sums (as for DFlash, tests/test_objective.py).
        torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=1e-5, atol=1e-6)
        assert torch.equal(got.counts.recall_hits, want.counts.recall_hits)
        for name, grad in got_grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if seed == 0:
            first = {name: compile_count(name) - before[name] for name in names}
    # One graph each (the DFlash 2 layer is one graph of its own); the second micro-batch none at all.
    assert first == {name: 1 for name in names}
    assert {name: compile_count(name) - before[name] for name in names} == first
