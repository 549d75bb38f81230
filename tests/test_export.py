import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash_core.export import export_drafter, load_exported
from dflash_core.model import DFlashDrafter
from tests.drafters import drafter_config


def drafter_to_export():
    cfg = drafter_config(target_layer_ids=[1, 3], num_target_layers=4,
                         layer_types=["full_attention", "sliding_attention"], sliding_window=6)
    return DFlashDrafter(cfg, seed=0)


def drafter_output(drafter):
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(1, 12, 64, generator=gen)
    embeds = torch.randn(1, 8, 32, generator=gen)
    with torch.no_grad():
        return drafter(features, embeds, torch.tensor([[2, 9]]), torch.tensor([[True, True]]),
                       backend="sdpa")


def test_round_trip_gives_identical_outputs(tmp_path):
    drafter = drafter_to_export()
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    loaded = load_exported(tmp_path / "out")
    assert loaded.config == drafter.config
    assert torch.equal(drafter_output(loaded), drafter_output(drafter))


def test_bf16_export_holds_bf16_contiguous_tensors(tmp_path):
    drafter = drafter_to_export()
    export_drafter(drafter, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(tensors) == set(drafter.state_dict())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    loaded = load_exported(tmp_path / "out")
    torch.testing.assert_close(drafter_output(loaded), drafter_output(drafter), rtol=0.05, atol=0.05)


def test_config_carries_the_serving_fields(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 49, "target_layer_ids": [1, 3],
                                       "block_size": 4}
    assert config["block_size"] == 4 and config["num_target_layers"] == 4
    for field in ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta",
                  "max_position_embeddings", "vocab_size", "attention_bias", "layer_types",
                  "sliding_window"]:
        assert field in config, field
    hf = AutoConfig.from_pretrained(tmp_path / "out")  # what the serving stacks parse
    assert hf.sliding_window == 6 and hf.layer_types == ["full_attention", "sliding_attention"]
    assert hf.rope_parameters["rope_theta"] == config["rope_theta"]


def rewrite_weights(path, edit):
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)


def test_loader_rejects_an_unexpected_key(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    rewrite_weights(tmp_path / "out",
                    lambda t: t.update({"model.embed_tokens.weight": torch.zeros(50, 32)}))
    with pytest.raises(KeyError, match=r"unexpected keys \['model.embed_tokens.weight'\]"):
        load_exported(tmp_path / "out")


def test_loader_rejects_a_missing_key(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    rewrite_weights(tmp_path / "out", lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(KeyError, match=r"missing keys \['layers.1.self_attn.k_norm.weight'\]"):
        load_exported(tmp_path / "out")


def test_export_replaces_an_existing_export_and_leaves_no_temporaries(tmp_path):
    first, second = drafter_to_export(), DFlashDrafter(drafter_to_export().config, seed=7)
    export_drafter(first, tmp_path / "out", dtype=torch.float32)
    export_drafter(second, tmp_path / "out", dtype=torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(load_exported(tmp_path / "out").fc.weight, second.fc.weight)
