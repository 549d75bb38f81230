"""Resolve what both roles must agree on from the target checkpoint: layer ids, mask token, widths."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import AutoConfig, AutoTokenizer

from dflash_core.families import text_config
from dflash_core.model import DrafterConfig
from dflash_core.tiny import first_unused_token_id
from launcher.config import ConfigError

# Drafter shape keys that default to the target's (null in conf/drafter/*.yaml).
_SHAPE_OVERRIDES = ("hidden_size", "intermediate_size", "layer_types", "sliding_window")


def ensure_embedded_target(cfg: DictConfig, seed: int) -> None:
    """Build the embedded tiny target at target.path when the config asks for it and it is missing."""
    if cfg.target.build_tiny and not Path(cfg.target.path).is_dir():
        from dflash_core.tiny import DEFAULT_FAMILY, build_tiny_target
        logging.getLogger("dflash").warning("building the embedded tiny target at %s", cfg.target.path)
        build_tiny_target(cfg.target.path, seed=seed, family=cfg.target.get("tiny_family", DEFAULT_FAMILY))


def target_dir(cfg: DictConfig) -> Path:
    path = Path(cfg.target.path)
    if not path.is_dir():
        raise ConfigError(f"target.path={str(path)!r}: no such directory (a local Hugging Face model directory; "
                          f"target=tiny builds the embedded one there)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"target.path={str(path)!r}: no config.json (not a Hugging Face model directory)")
    return path


def tokenizer_dir(cfg: DictConfig) -> Path:
    return Path(cfg.data.tokenizer) if cfg.data.tokenizer else target_dir(cfg)


def drafter_config(cfg: DictConfig) -> DrafterConfig:
    path = target_dir(cfg)
    hf_config = AutoConfig.from_pretrained(path)
    mask_token_id = cfg.drafter.mask_token_id
    if mask_token_id == "auto":
        mask_token_id = first_unused_token_id(AutoTokenizer.from_pretrained(tokenizer_dir(cfg)), hf_config)
    for key in ("max_length", "fixed_length"):
        length = cfg.data[key]
        if length is not None and length > text_config(hf_config).max_position_embeddings:
            raise ConfigError(f"data.{key}={length} exceeds the target's max_position_embeddings "
                              f"({text_config(hf_config).max_position_embeddings})")
    ids = list(cfg.drafter.target_layer_ids) if cfg.drafter.target_layer_ids is not None else None
    overrides = {key: (list(value) if key == "layer_types" else value)
                 for key in _SHAPE_OVERRIDES if (value := cfg.drafter.get(key)) is not None}
    return DrafterConfig.from_target(hf_config, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                                     mask_token_id=int(mask_token_id), target_layer_ids=ids, **overrides)


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
            "fp16": torch.float16, "float16": torch.float16}[setting]
