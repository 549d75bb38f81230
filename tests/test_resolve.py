import pytest

from launcher.config import compose_config
from launcher.resolve import compile_plan


@pytest.mark.parametrize("overrides,backend,compiled,warm_up", [
    ([], "flex", False, None),                                   # auto, varying lengths: eager layers, no warm-up
    (["data.fixed_length=256"], "flex", True, (4, 256)),         # auto, flex at one static length
    (["data.fixed_length=256"], "sdpa", False, (4, 256)),        # sdpa (CPU): eager, still warmed up
    (["drafter.compile=true"], "sdpa", True, None),
    (["data.fixed_length=256", "drafter.compile=false", "run.warm_up=false"], "flex", False, None),
])
def test_one_function_decides_compile_and_warm_up(overrides, backend, compiled, warm_up):
    plan = compile_plan(compose_config(overrides), backend)
    assert (plan.compiled, plan.warm_up_shape) == (compiled, warm_up)
