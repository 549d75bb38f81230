"""Drafter configs the tests share (a small one to vary, and the production Qwen3-8B shape), the
step settings a test's drafter trains with, and a checkpoint of a drafter's weights."""
import dataclasses

from dflash_core.drafter.model import DrafterConfig
from dflash_core.loss.settings import StepSettings
from launcher.config.schema import DrafterSettings
from launcher.resolve import step_settings as resolved_step_settings
from launcher.run_io import checkpoint

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=48, vocab_size=50, block_size=4, target_layer_ids=[0, 1], num_target_layers=2,
             mask_token_id=49)


def drafter_config(**overrides) -> DrafterConfig:
    """A small drafter config (hidden 32, 2 layers, block 4, vocabulary 50) with `overrides`."""
    return DrafterConfig(**{**SMALL, **overrides})


def qwen3_8b_drafter_config() -> DrafterConfig:
    """dflash5 on Qwen3-8B: 5 layers, block 16, layers [1, 9, 17, 25, 33], Qwen3's mask token."""
    return drafter_config(hidden_size=4096, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=12288, vocab_size=151936, block_size=16,
                          target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=151669,
                          rope_theta=1e6)


def step_settings(drafter, *, backend: str = "sdpa", compiled: bool = False, **keys) -> StepSettings:
    """The config's default step settings (launcher/config/schema.py) for `drafter`'s block size, as
    launcher/resolve.py builds them on the drafter's device, with drafter.* `keys` overridden (sdpa,
    eager by default)."""
    device = next(drafter.parameters()).device
    return resolved_step_settings(DrafterSettings(block_size=drafter.config.block_size, **keys), backend, compiled,
                                  device)


def save_drafter_checkpoint(root, drafter, step: int, keep: int = 2):
    """A checkpoint of `drafter`'s weights at `step` in `root`, as one drafter rank writes it (what
    launcher.export and launcher.evaluate read of a checkpoint)."""
    weights = drafter.state_dict()
    pieces = [checkpoint.Piece.whole(f"model.{name}", value) for name, value in weights.items()]
    return checkpoint.save(root, step, pieces, {"step": step, "drafter_config": dataclasses.asdict(drafter.config),
                            "shapes": {name: list(value.shape) for name, value in weights.items()}}, keep)
