"""Shared test fixtures: the tiny target, built once per test session (a few seconds)."""

from dflash_core.tiny import build_tiny_target


def build_session_tiny_target(tmp_path_factory):
    return build_tiny_target(tmp_path_factory.mktemp("tiny_target") / "target")
