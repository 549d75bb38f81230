import pytest
import torch

from tests.fixtures_tiny import build_session_tiny_target


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """Directory of the tiny locally built Qwen3 target (tokenizer + random weights)."""
    return build_session_tiny_target(tmp_path_factory)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: two intra-op threads only add contention when other jobs share the cores (the
    linear-attention fallback's small triangular solves ran 50x slower with two threads on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
