"""Export the drafter as the Hugging Face directory vLLM and SGLang load, and load it back.

config.json: Qwen3 fields + architectures ["DFlashDraftModel"], block_size,
num_target_layers, dflash_config {mask_token_id, target_layer_ids (HF numbering), block_size}.
model.safetensors: exactly the drafter's state_dict keys (no prefix, no embedding, no LM
head). SGLang silently ignores unknown names, so both directions are checked strictly.
"""

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .model import DFlashDrafter, DrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def expected_keys(cfg):
    """The exact tensor names of an exported drafter with this config."""
    attn_params = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    per_layer = [f"self_attn.{proj}_proj.{p}" for proj in "qkvo" for p in attn_params]
    per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += [f"mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    keys = [f"layers.{i}.{name}" for i in range(cfg.num_hidden_layers) for name in per_layer]
    return keys + ["fc.weight", "hidden_norm.weight", "norm.weight"]


def config_to_json(cfg, dtype=torch.bfloat16):
    sliding = "sliding_attention" in cfg.layer_types
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        # transformers 5 reads RoPE from rope_parameters; rope_theta stays for older readers.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "layer_types": list(cfg.layer_types),
        # Qwen3Config drops sliding_window unless use_sliding_window is true.
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
        },
    }


def config_from_json(data):
    dflash = data["dflash_config"]
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    values = {name: data[name] for name in fields if name in data}
    values.update(mask_token_id=dflash["mask_token_id"],
                  target_layer_ids=dflash["target_layer_ids"],
                  block_size=dflash["block_size"])
    return DrafterConfig(**values)


def export_drafter(drafter, out_dir, *, dtype=torch.bfloat16):
    """Write config.json + model.safetensors into out_dir atomically (a temporary sibling
    directory renamed into place; an existing out_dir is replaced)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported export dtype {dtype}")
    cfg = drafter.config
    state = drafter.state_dict()
    _check_keys(set(state), set(expected_keys(cfg)), "drafter state_dict")
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous()
               for name, t in state.items()}

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp_dir / CONFIG_NAME).write_text(json.dumps(config_to_json(cfg, dtype), indent=2) + "\n")
        if out_dir.exists():
            old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old_dir / out_dir.name)
            os.replace(tmp_dir, out_dir)
            shutil.rmtree(old_dir)
        else:
            os.replace(tmp_dir, out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
    return out_dir


def _check_keys(found, expected, where):
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise KeyError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")


def load_exported(path, *, device=None, dtype=torch.float32):
    """Load an exported drafter; any missing or unexpected tensor name is an error."""
    path = Path(path)
    cfg = config_from_json(json.loads((path / CONFIG_NAME).read_text()))
    with safe_open(str(path / WEIGHTS_NAME), framework="pt") as f:
        state = {name: f.get_tensor(name) for name in f.keys()}
    _check_keys(set(state), set(expected_keys(cfg)), str(path / WEIGHTS_NAME))
    with torch.device("meta"):  # skip the random init: every tensor comes from the file
        drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(state, assign=True)
    return drafter.to(device=device, dtype=dtype)
