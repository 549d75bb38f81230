import pytest
import torch
from transformers import Qwen3_5TextConfig, Qwen3Config

from launcher.config import ConfigError, compose_config
from launcher.resolve import compile_plan


@pytest.mark.parametrize("overrides,backend,compiled,warm_up", [
    ([], "flex", False, None),                                   # auto, varying lengths: eager layers, no warm-up
    (["data.fixed_length=256"], "flex", True, (4, 256)),         # auto, flex at one static length
    (["data.fixed_length=256"], "sdpa", False, (4, 256)),        # sdpa (CPU): eager, still warmed up
    (["drafter.compile=true"], "sdpa", True, None),
    (["data.fixed_length=256", "drafter.compile=false", "run.warm_up=false"], "flex", False, None),
])
def test_one_function_decides_compile_and_warm_up(overrides, backend, compiled, warm_up):
    plan = compile_plan(compose_config(overrides), backend, torch.device("cpu"), Qwen3Config())
    assert (plan.compiled, plan.warm_up_shape) == (compiled, warm_up)


@pytest.mark.parametrize("overrides,device,family_config,compiled", [
    (["data.fixed_length=256"], "cuda", Qwen3Config(), True),          # auto: GPU at a static length
    ([], "cuda", Qwen3Config(), False),                                 # varying lengths
    (["data.fixed_length=256"], "cpu", Qwen3Config(), False),
    (["data.fixed_length=256"], "cuda", Qwen3_5TextConfig(), False),    # recurrent layers: eager
    (["target.compile=true"], "cpu", Qwen3Config(), True),
])
def test_when_the_target_compiles(overrides, device, family_config, compiled):
    plan = compile_plan(compose_config(overrides), "flex", torch.device(device), family_config)
    assert plan.target_compiled is compiled


def test_a_compiled_recurrent_target_is_refused():
    with pytest.raises(ConfigError, match="target.compile=True: not for the qwen3_5"):
        compile_plan(compose_config(["target.compile=true"]), "flex", torch.device("cpu"), Qwen3_5TextConfig())
