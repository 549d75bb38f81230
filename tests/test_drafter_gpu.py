"""GPU checks (flex forward/backward vs sdpa, one compile per shape), reusing the functions of
scripts/gpu_drafter_check.py at small sizes. Skipped without CUDA."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_drafter_check.py"
needs_cuda = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_drafter_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_script_imports_without_a_gpu(check):
    assert callable(check.main) and check.FORWARD_TOLERANCE < check.BACKWARD_TOLERANCE


class TestOnGpu:
    pytestmark = needs_cuda

    def test_flex_matches_sdpa_forward_and_backward_in_bf16(self, check):
        result = check.check_backends(batch=1, seq_len=512, num_anchors=32)
        assert result["passed"], result

    def test_training_compiles_the_flex_path_once(self, check):
        result = check.check_single_compile(steps=5, batch=1, seq_len=512, num_anchors=24)
        assert result["passed"], result
