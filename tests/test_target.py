import re
import shutil
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dflash_core.target.capture import TargetError, load_target


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(0))


def reference_hidden_states(path, input_ids):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids, output_hidden_states=True).hidden_states


@pytest.fixture(scope="module")
def tiny_hidden_states(tiny_target_dir, input_ids):
    return reference_hidden_states(tiny_target_dir, input_ids)


@pytest.mark.parametrize("layer_ids", [[1], [0, 2], [2, 0], [3], [1, 3]])
def test_capture_equals_output_hidden_states(tiny_target_dir, input_ids, tiny_hidden_states, layer_ids):
    target = load_target(tiny_target_dir, layer_ids=layer_ids, device="cpu", dtype=torch.float32)
    features = target.capture(input_ids)
    expected = torch.cat([tiny_hidden_states[i + 1] for i in layer_ids], dim=-1)
    assert features.shape == (2, 48, len(layer_ids) * 128)
    torch.testing.assert_close(features, expected, rtol=0, atol=1e-5)
    assert target.num_kept_layers == max(layer_ids) + 1  # later layers are never built
    assert target.num_layers == target.config.num_hidden_layers == 4  # the full target's config


def test_truncated_target_is_frozen_and_smaller(tiny_target_dir):
    target = load_target(tiny_target_dir, layer_ids=[1], device="cpu", dtype=torch.float32)
    assert target.num_kept_layers == 2 < target.num_layers
    assert target.decoder.config.num_hidden_layers == 2 and len(target.decoder.config.layer_types) == 2
    assert not target.decoder.training
    assert not any(p.requires_grad for p in target.decoder.parameters())
    assert target.hidden_size == 128 and target.dtype == torch.float32


def test_features_can_feed_a_trainable_layer(tiny_target_dir, input_ids):
    """Inference tensors cannot be saved for backward; the drafter's fc must be able to."""
    target = load_target(tiny_target_dir, layer_ids=[0, 1], device="cpu", dtype=torch.float32)
    fc = torch.nn.Linear(256, 128, bias=False)
    fc(target.capture(input_ids)).sum().backward()
    assert fc.weight.grad is not None


def test_bf16_load_captures_in_bf16(tiny_target_dir, input_ids):
    target = load_target(tiny_target_dir, layer_ids=[1], device="cpu", dtype=torch.bfloat16)
    assert target.capture(input_ids).dtype == torch.bfloat16


def test_llama_style_targets_are_supported(tmp_path, input_ids):
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    target = load_target(tmp_path, layer_ids=[0, 1], device="cpu", dtype=torch.float32)
    hidden_states = reference_hidden_states(tmp_path, input_ids)
    torch.testing.assert_close(target.capture(input_ids), torch.cat([hidden_states[1], hidden_states[2]], -1),
                               rtol=0, atol=1e-5)
    assert target.num_kept_layers == 2


def test_checkpoint_errors(tiny_target_dir, tmp_path):
    with pytest.raises(TargetError, match="target directory not found"):
        load_target(tmp_path / "missing", layer_ids=[0], device="cpu", dtype=torch.float32)
    with pytest.raises(TargetError, match="has no config.json"):
        load_target(tmp_path, layer_ids=[0], device="cpu", dtype=torch.float32)
    shutil.copy(tiny_target_dir / "config.json", tmp_path)
    with pytest.raises(TargetError, match=re.escape(f"{tmp_path} has no weights")):
        load_target(tmp_path, layer_ids=[0], device="cpu", dtype=torch.float32)


@pytest.mark.parametrize("layer_id", [4, -1])
def test_layer_id_out_of_range_names_the_id_and_layer_count(tiny_target_dir, layer_id):
    with pytest.raises(TargetError, match=rf"target layer id {layer_id} is out of range: the target has 4 decoder"):
        load_target(tiny_target_dir, layer_ids=[0, layer_id], device="cpu", dtype=torch.float32)


def test_truncated_forward_is_faster(tiny_target_dir):
    """Prints the timing only: wall-clock comparisons are too noisy on shared CI cores to assert."""
    tokens = torch.randint(0, 1024, (4, 512), generator=torch.Generator().manual_seed(1))
    full = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    target = load_target(tiny_target_dir, layer_ids=[0], device="cpu", dtype=torch.float32)

    def best_of(fn, repeats=5):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.no_grad():
        full_time = best_of(lambda: full(tokens, output_hidden_states=True))
    capture_time = best_of(lambda: target.capture(tokens))
    print(f"\nfull forward with output_hidden_states: {full_time * 1e3:.1f} ms; "
          f"truncated capture of layer 0: {capture_time * 1e3:.1f} ms ({full_time / capture_time:.1f}x faster)")


def test_compiled_capture_equals_eager_unpacked_and_packed(tiny_target_dir, input_ids):
    """target.compile: each layer through one compiled graph; the same features, one graph for all
    layers and batches (static shape), packed rows included."""
    from dflash_core.drafter.compile import compile_count
    eager = load_target(tiny_target_dir, layer_ids=[0, 2], device="cpu", dtype=torch.float32)
    compiled = load_target(tiny_target_dir, layer_ids=[0, 2], device="cpu", dtype=torch.float32, compiled=True)
    packed_positions = torch.cat([torch.arange(20), torch.arange(28)]).expand(2, -1)
    before = compile_count("target_layer")
    for positions in (None, packed_positions, packed_positions):
        want = eager.capture(input_ids, position_ids=positions)
        got = compiled.capture(input_ids, position_ids=positions)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert 1 <= compile_count("target_layer") - before <= 2   # unpacked (no mask) and packed (a mask) inputs


@pytest.mark.parametrize("compiled", [False, True])
def test_varlen_attention_captures_each_document_as_if_alone(tiny_target_dir, input_ids, compiled):
    """Packed rows through dflash_core.target.packing.varlen_attention (flash's variable-length kernel on
    GPU, its per-document reference here): each document equals its own unpacked capture."""
    from dflash_core.target.packing import VARLEN
    varlen = load_target(tiny_target_dir, layer_ids=[0, 3], device="cpu", dtype=torch.float32,
                         attn_implementation=VARLEN, compiled=compiled)
    plain = load_target(tiny_target_dir, layer_ids=[0, 3], device="cpu", dtype=torch.float32)
    lengths = (20, 28)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    packed = varlen.capture(input_ids, position_ids=positions)
    start = 0
    for n in lengths:
        alone = plain.capture(input_ids[:, start:start + n])
        torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    torch.testing.assert_close(varlen.capture(input_ids), plain.capture(input_ids), rtol=1e-5, atol=1e-5)
