import pytest
import torch

from launcher.config import compose_config
from launcher.drafter_role import DrafterTrainer


@pytest.mark.parametrize("overrides,device,expected", [
    ([], "cuda", False),                                   # auto, varying lengths: eager layers
    (["data.fixed_length=256"], "cuda", True),             # auto, flex at one static length
    (["data.fixed_length=256"], "cpu", False),             # auto on CPU: sdpa backend
    (["data.fixed_length=256", "drafter.backend=sdpa"], "cuda", False),
    (["drafter.compile=true"], "cpu", True),
    (["data.fixed_length=256", "drafter.compile=false"], "cuda", False),
])
def test_when_the_drafter_layers_compile(overrides, device, expected):
    cfg = compose_config(overrides)
    assert DrafterTrainer.compiles_layers(cfg, torch.device(device)) is expected
