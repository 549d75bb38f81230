import pytest
from tests.fixtures_tiny import build_session_tiny_target


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """Directory of the tiny locally built Qwen3 target (tokenizer + random weights)."""
    return build_session_tiny_target(tmp_path_factory)
