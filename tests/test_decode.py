"""The static decode loop (dflash_core.target.decode) against HF's own forward and generate, and how
regeneration and synthesis choose it (`<section>.decode`)."""
import logging

import pytest
import torch
from omegaconf import OmegaConf

from dflash_core.target.decode import Sampling, StaticDecoder, unsupported

STOP, PAD = 299, 0
# fp32 on CPU: two attention implementations round differently by ~1e-6 of a logit; a chosen token may
# differ from HF's argmax only where HF's own top-2 margin is below this (a near-tie, not a bug).
NEAR_TIE = 1e-4


def _tiny(tmp_path, model_type: str, **settings):
    """A tiny random `model_type` target (vocabulary 300, 4 query and 2 KV heads), saved and loaded back
    through `from_pretrained`, in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(model_type, **{
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False, **settings})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / model_type)
    return AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=torch.float32).eval()


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def target(request, tmp_path):
    return _tiny(tmp_path, request.param, **({"head_dim": 16} if request.param == "qwen3" else {}))


@pytest.fixture
def windowed(tmp_path):
    """A Qwen3 whose first layer attends through a sliding window: a target the loop cannot run."""
    return _tiny(tmp_path / "windowed", "qwen3", head_dim=16, num_hidden_layers=2, sliding_window=32,
                 layer_types=["sliding_attention", "full_attention"], use_sliding_window=True)


def _batch(lengths: list[int], seed: int = 1):
    """Left-padded random prompts of these lengths (no stop token in them)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, STOP, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def _assert_targets_argmax(target, ids, lengths, out):
    """Each row's tokens, fed back through HF's forward on that row alone (no padding, no cache), are its
    argmax at every position, but where HF's own top-2 margin is a near-tie."""
    for row, n in enumerate(lengths):
        new = out[row].tolist()
        if STOP in new:   # after its stop token a row is padding
            end = new.index(STOP) + 1
            assert all(t == PAD for t in new[end:]), f"row {row}: tokens after its stop token"
            new = new[:end]
        sequence = torch.cat([ids[row, ids.shape[1] - n:], torch.tensor(new)]).to(out.device)
        with torch.inference_mode():
            logits = target(sequence[None]).logits[0, n - 1:n - 1 + len(new)].float()
        top2 = logits.topk(2).values
        for k, token in enumerate(new):
            margin = float(top2[k, 0] - logits[k, token])
            assert margin == 0 or float(top2[k, 0] - top2[k, 1]) < NEAR_TIE, (
                f"row {row}, new token {k}: chose {token}, HF's argmax is {int(logits[k].argmax())} "
                f"({margin:.2e} above it)")


def test_greedy_tokens_are_the_targets_argmax_at_every_position(target):
    """The cache, the left padding, the positions and the bucketed attention hold."""
    lengths = [70, 9, 1, 33]   # one prompt wider than a bucket of 64 slots, one of a single token
    ids, mask = _batch(lengths)
    out = StaticDecoder(target, 80, [STOP], PAD, Sampling())(ids, mask)
    assert out.shape == (4, 80)
    _assert_targets_argmax(target, ids, lengths, out)


def test_greedy_equals_hf_generate_on_a_left_padded_batch(target):
    from transformers import GenerationConfig
    ids, mask = _batch([12, 7, 3, 10, 1])
    config = GenerationConfig(do_sample=False, max_new_tokens=40, eos_token_id=[STOP], pad_token_id=PAD)
    with torch.inference_mode():
        expected = target.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]
    got = StaticDecoder(target, 40, [STOP], PAD, Sampling())(ids, mask)
    assert torch.equal(got[:, :expected.shape[1]], expected)


def test_a_row_that_stops_is_padding_after_its_stop_token(target):
    """Every token a stop token: each row stops at its first new token, the rest is padding."""
    ids, mask = _batch([5, 2])
    out = StaticDecoder(target, 20, list(range(300)), PAD, Sampling())(ids, mask)
    assert (out[:, 1:] == PAD).all() and (out[:, 0] != PAD).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7), Sampling(temperature=1.0, top_k=5),
                                      Sampling(temperature=1.3, top_p=0.8), Sampling(1.0, top_p=0.9, top_k=8)])
def test_sampling_draws_from_hf_warped_distribution(sampling, dtype):
    """The token frequencies of 40,000 draws against the distribution HF's warpers (temperature, top-k,
    top-p) leave: nothing they cut, each frequency within 0.015 of its probability (about 6 standard
    deviations of a frequency estimated from 40,000 draws, sqrt(0.25 / 40,000) = 0.0025). bf16 logits, as a
    bf16 head gives them, are cut by their own order and HF's warpers read them in fp32, as generate does."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    torch.manual_seed(0)
    logits = (torch.randn(1, 24) * 2).to(dtype)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)]
                                  + ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k else [])
                                  + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []))
    expected = warpers(None, logits.float()).softmax(-1)[0]
    draws = sampling.choose(logits.expand(40_000, -1))
    frequency = torch.bincount(draws, minlength=24).float() / draws.numel()
    assert not (frequency[expected == 0] > 0).any(), "drew a token the warpers cut"
    assert (frequency - expected).abs().max() < 0.015, (frequency, expected)


def test_a_target_the_loop_cannot_run_is_named(windowed):
    assert "layers [0] use sliding-window attention" in unsupported(windowed)
    with pytest.raises(ValueError, match="sliding-window"):
        StaticDecoder(windowed, 4, [STOP], PAD, Sampling())


def test_decode_setting_picks_the_loop_or_refuses(caplog, target, windowed):
    """auto takes the loop where it runs the target and HF generate, saying why, where not; static on a
    target it cannot run is a ConfigError naming the setting."""
    from dflash_core.data.prompts import Prompt
    from launcher.config import ConfigError
    from launcher.regeneration.hf import batch_decoder
    section = OmegaConf.create({"decode": "auto", "max_new_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0})
    prompts = [Prompt(0, None, "", [], token_ids=[5, 6, 7]), Prompt(1, None, "", [], token_ids=[8])]
    ours = batch_decoder(target, section, "regenerate", [STOP], PAD)(prompts)
    hf = batch_decoder(target, OmegaConf.merge(section, {"decode": "generate"}), "regenerate", [STOP], PAD)(prompts)
    assert [row[:len(h)] for row, h in zip(ours, hf)] == hf

    with caplog.at_level(logging.INFO, logger="dflash"):
        batch_decoder(windowed, section, "synthesize", [STOP], PAD)
    assert "synthesize.decode=auto: HF generate" in caplog.text
    with pytest.raises(ConfigError, match=r"synthesize.decode=static: .*sliding-window"):
        batch_decoder(windowed, OmegaConf.merge(section, {"decode": "static"}), "synthesize", [STOP], PAD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_decodes_the_targets_argmax(target):
    """On a GPU: the compiled, captured steps (one graph per bucket of slots) in fp32, as the CPU test checks
    the eager loop."""
    model = target.cuda()
    lengths = [70, 9, 1, 33]
    ids, mask = _batch(lengths)
    out = StaticDecoder(model, 90, [STOP], PAD, Sampling())(ids, mask)
    _assert_targets_argmax(model, ids, lengths, out)
