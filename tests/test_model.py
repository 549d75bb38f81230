"""Drafter config, module layout, forward against an independent loop reference, and the
frozen target head."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_core.drafter.model import DFlashDrafter, default_target_layer_ids
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.target.families import drafter_config_for_target
from tests.drafters import drafter_config


def tiny_config(**overrides):
    return drafter_config(**{"target_layer_ids": [0, 2], "num_target_layers": 3, "rope_theta": 100.0, **overrides})


def qwen3_8b_config():
    return Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                       vocab_size=151936, max_position_embeddings=40960,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(28, 2) == [1, 25]


def test_from_target_copies_the_target_shape():
    cfg = drafter_config_for_target(qwen3_8b_config(), num_layers=5, block_size=16,
                                    mask_token_id=151669)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.num_target_layers == 36
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (4096, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (12288, 151936, 1e6)
    assert cfg.layer_types == ["full_attention"] * 5


def test_from_target_reads_a_top_level_rope_theta():
    legacy = SimpleNamespace(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=48, vocab_size=50,
                             rms_norm_eps=1e-6, rope_theta=5e5, max_position_embeddings=128)
    cfg = drafter_config_for_target(legacy, num_layers=1, block_size=8, mask_token_id=49)
    assert cfg.rope_theta == 5e5 and cfg.head_dim == 8 and cfg.target_layer_ids == [2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden_size=1024), "1024.*4096"),
    (dict(target_layer_ids=[1, 36]), r"36.*\[0, 36\)"),
    (dict(block_size=1), "block_size"),
    (dict(layer_types=["full_attention"] * 4 + ["local"]), "local"),
    (dict(layer_types=["sliding_attention"] * 5), "sliding_window"),
    (dict(mask_token_id=151936), "mask_token_id"),
])
def test_from_target_validation_errors(kwargs, message):
    args = dict(num_layers=5, block_size=16, mask_token_id=151669)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        drafter_config_for_target(qwen3_8b_config(), **args)


def test_state_dict_keys_are_the_serving_layout():
    drafter = DFlashDrafter(tiny_config(num_hidden_layers=2))
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    expected = {f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    expected |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert set(drafter.state_dict()) == expected
    assert drafter.fc.weight.shape == (32, 2 * 32)
    assert {n for n, _ in drafter.named_parameters()} == expected


def test_seeded_init_is_reproducible():
    a, b, c = (DFlashDrafter(tiny_config(), seed=s) for s in (3, 3, 4))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.fc.weight, c.fc.weight)
    assert torch.equal(a.norm.weight, torch.ones(32))


def reference_forward(drafter, features, block_embeds, anchors, keep):
    """The spec written out query by query: HF's RoPE, explicit visible-key lists."""
    cfg = drafter.config
    batch, context_len, _ = features.shape
    bs, hd, group = cfg.block_size, cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    rope = Qwen3RotaryEmbedding(Qwen3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=hd,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}))

    def rms(x, norm):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm.weight

    def rotate(x, positions):  # x [B, P, heads, hd]
        cos, sin = rope(x, positions)
        return apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)[0]

    block_pos = (anchors[:, :, None] + torch.arange(bs)).flatten(1)
    kv_pos = torch.cat([torch.arange(context_len).expand(batch, -1), block_pos], 1)
    ctx = rms(features @ drafter.fc.weight.T, drafter.hidden_norm)
    h = block_embeds
    for layer, layer_type in zip(drafter.layers, cfg.layer_types):
        attn = layer.self_attn
        x = rms(h, layer.input_layernorm)
        both = torch.cat([ctx, x], 1)
        q = rotate(rms((x @ attn.q_proj.weight.T).unflatten(-1, (-1, hd)), attn.q_norm), block_pos)
        k = rotate(rms((both @ attn.k_proj.weight.T).unflatten(-1, (-1, hd)), attn.k_norm), kv_pos)
        v = (both @ attn.v_proj.weight.T).unflatten(-1, (-1, hd)).transpose(1, 2)
        out = torch.zeros_like(q)
        for b in range(batch):
            for j in range(anchors.shape[1]):
                a = int(anchors[b, j])
                for q_off in range(bs if keep[b, j] else 0):
                    if layer_type == "full_attention":
                        keys = list(range(a)) + [context_len + j * bs + m for m in range(bs)]
                    else:
                        oldest = max(0, a + q_off - cfg.sliding_window + 1)
                        keys = list(range(oldest, a)) + [context_len + j * bs + m
                                                         for m in range(q_off + 1)]
                    row = j * bs + q_off
                    for head in range(cfg.num_attention_heads):
                        scores = k[b, head // group, keys] @ q[b, head, row] / hd ** 0.5
                        out[b, head, row] = scores.softmax(0) @ v[b, head // group, keys]
        h = h + out.transpose(1, 2).flatten(2) @ attn.o_proj.weight.T
        y = rms(h, layer.post_attention_layernorm)
        h = h + (F.silu(y @ layer.mlp.gate_proj.weight.T) * (y @ layer.mlp.up_proj.weight.T)) \
            @ layer.mlp.down_proj.weight.T
    return rms(h, drafter.norm)


def test_forward_matches_the_loop_reference():
    cfg = tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    drafter = DFlashDrafter(cfg, seed=0)
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2, 20, 2 * 32, generator=gen)
    embeds = torch.randn(2, 3 * 4, 32, generator=gen)
    anchors = torch.tensor([[0, 7, 15], [2, 12, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    with torch.no_grad():
        got = drafter(features, embeds, anchors, keep, backend="sdpa")
        want = reference_forward(drafter, features, embeds, anchors, keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_forward_casts_bf16_inputs_to_the_parameter_dtype():
    drafter = DFlashDrafter(tiny_config(), seed=0)
    features = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    out = drafter(features, torch.randn(1, 8, 32, dtype=torch.bfloat16),
                  torch.tensor([[1, 3]]), torch.tensor([[True, True]]), backend="sdpa")
    assert out.dtype == torch.float32


def test_forward_refuses_an_unresolved_backend():
    """The caller resolves the backend once (attention.resolve_backend); forward never picks one itself."""
    drafter = DFlashDrafter(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="backend='auto': expected one of"):
        drafter(torch.randn(1, 8, 64), torch.randn(1, 8, 32), torch.tensor([[1, 3]]), torch.tensor([[True, True]]),
                backend="auto")



def test_forward_announces_every_weight_before_reading_it():
    """weights_ready (the hook a sharded optimiser's all-gathers wait in) names a module, or one it lies in,
    before any of its weights is read, and names every weight of the drafter once per forward."""
    drafter = DFlashDrafter(tiny_config(layer_types=["full_attention", "sliding_attention"], sliding_window=5),
                            seed=0)
    announced, unannounced = set(), []
    names = {id(p): name for name, p in drafter.named_parameters()}

    def ready(*modules):
        for module in modules:
            announced.update(id(p) for p in module.parameters())

    def check(module, _inputs):
        unannounced.extend(names[id(p)] for p in module.parameters(recurse=False) if id(p) not in announced)
    drafter.weights_ready = ready
    for module in drafter.modules():
        module.register_forward_pre_hook(check)
    anchors, keep = torch.tensor([[1, 3]]), torch.tensor([[True, True]])
    drafter(torch.randn(1, 8, 64), torch.randn(1, 8, 32), anchors, keep, backend="sdpa").sum().backward()
    assert not unannounced
    assert announced == set(names)

# ---- frozen target head ----

def save_tiny_target(path, *, tied, **save_kwargs):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied))
    model.save_pretrained(path, **save_kwargs)
    return model


@pytest.mark.parametrize("tied, save_kwargs", [
    (False, {}), (True, {}), (False, {"max_shard_size": "4KB"})])
def test_head_reads_embed_and_lm_head_from_the_target(tmp_path, tied, save_kwargs):
    model = save_tiny_target(tmp_path, tied=tied, **save_kwargs)
    if "max_shard_size" in save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    head = FrozenTargetHead.from_target_dir(tmp_path, device="cpu", dtype=torch.float32)
    embed = model.model.embed_tokens.weight.detach()
    assert torch.equal(head.embed_weight, embed)
    assert torch.equal(head.lm_head_weight, model.lm_head.weight.detach())
    assert torch.equal(head.lm_head_weight, embed) == tied
    ids = torch.tensor([[1, 5, 63]])
    assert torch.equal(head.embed(ids), embed[ids])
    h = torch.randn(1, 3, 16)
    torch.testing.assert_close(head.logits(h), model.lm_head(h))


def test_head_is_frozen_and_outside_every_state_dict(tmp_path):
    head = FrozenTargetHead.random(50, 32, seed=0)
    assert list(head.parameters()) == [] and head.state_dict() == {}
    assert {name for name, _ in head.named_buffers()} == {"embed_weight", "lm_head_weight"}


def test_head_without_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        FrozenTargetHead.from_target_dir(tmp_path, device="cpu", dtype=torch.float32)


def test_head_without_lm_head_needs_tied_embeddings(tmp_path):
    save_file({"model.embed_tokens.weight": torch.randn(50, 32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    with pytest.raises(KeyError, match="lm_head.weight"):
        FrozenTargetHead.from_target_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    head = FrozenTargetHead.from_target_dir(tmp_path)
    assert torch.equal(head.lm_head_weight, head.embed_weight)
