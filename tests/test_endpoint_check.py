"""Issue 46, item 3: the model and the drafter behind a URL are the ones the command names
(launcher/serving/endpoint_check.py), checked before any prompt is sent.

A real `vllm serve` on loopback: the session's pair (conftest.served_qwen3, in vLLM's development
mode, so the speculating one says which drafter it serves); `xdist_group` keeps these tests on the
worker that started it."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from dflash_core.data import load_tokenizer
from dflash_core.drafter.dflash2 import build_drafter
from dflash_core.serving.export import export_drafter, read_exported_config
from dflash_core.serving.model_card import read_card_info
from launcher import evaluate
from launcher.config import ConfigError, compose_config
from launcher.regenerate import run as regenerate
from launcher.serving.endpoint_check import check_serves_drafter, check_serves_target
from launcher.serving.openai_client import OpenAIClient
from launcher.serving.served_evaluate import evaluate_served
from tests.targets import other_family_copy

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.timeout(1800)]


def _regenerate(target: Path, url: str, output: Path) -> int:
    return regenerate([f"target.path={target}", "regenerate.engine=openai", f"regenerate.endpoints=[{url}]",
                       f"regenerate.output={output}", "regenerate.limit=2", "regenerate.max_new_tokens=4"])


def _evaluate_overrides(target, drafter, url, *extra) -> list[str]:
    return [f"target.path={target}", f"evaluate.drafter={drafter}", "evaluate.engine=vllm", "evaluate.device=cpu",
            f"evaluate.endpoint={url}", "evaluate.check_lossless=false", "evaluate.num_prompts=1",
            "evaluate.max_new_tokens=8", *extra]


def test_a_server_of_another_model_is_refused_naming_both(served_qwen3, tmp_path, capfd):
    """Issue 46: regenerate.engine=openai against a server of another model than target.path exited 0
    with that model's text and token ids. A copy of the served model (the same config.json) is it."""
    other = other_family_copy(tmp_path, served_qwen3.target)
    with pytest.raises(ConfigError) as refused:
        _regenerate(other, served_qwen3.plain.url, tmp_path / "out.jsonl")
    said = str(refused.value)
    assert f"regenerate.endpoints: the server at {served_qwen3.plain.url} serves '{served_qwen3.target}', " \
           f"not the model target.path='{other}' names" in said
    assert "model_type: served 'qwen3', target.path's 'llama'" in said
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny-llama"]   # no output, no parts
    # The served evaluation's servers too, before any prompt.
    cfg = compose_config(_evaluate_overrides(other, served_qwen3.export, served_qwen3.speculative.url),
                         config_name="evaluate")
    with pytest.raises(ConfigError, match=rf"evaluate.endpoint: the server at {served_qwen3.speculative.url} "
                                          rf"serves '{served_qwen3.target}', not the model target.path='{other}'"):
        evaluate_served(cfg)

    copy = shutil.copytree(served_qwen3.target, tmp_path / "copy")
    assert _regenerate(copy, served_qwen3.plain.url, tmp_path / "copy.jsonl") == 0
    assert len((tmp_path / "copy.jsonl").read_text().splitlines()) == 2
    assert f"serves '{served_qwen3.target}', a copy of target.path={copy}" in capfd.readouterr().err


def test_a_server_elsewhere_is_checked_by_its_tokenizer(served_qwen3, caplog):
    """A server on another machine reports a path that is no directory here: its tokenizer must give
    a probe text the local tokenizer's ids."""
    client = OpenAIClient(served_qwen3.plain.url)
    client.connect()
    client.served["root"] = "org/tiny-elsewhere"   # what a server elsewhere (or of a hub name) reports
    tokenizer = load_tokenizer(served_qwen3.target)
    with caplog.at_level("INFO", logger="dflash"):
        check_serves_target(client, served_qwen3.target, tokenizer, "regenerate.endpoints")
    assert "its tokenizer is target.path" in caplog.text and "weights are not compared from here" in caplog.text
    tokenizer.add_tokens(["Speculative"])   # another tokenizer: the probe's first word is one token here
    with pytest.raises(ConfigError, match=r"serves 'org/tiny-elsewhere', not the model target.path=.*: its "
                                          r"tokenizer gives a probe text other ids \(from token 0: served \["):
        check_serves_target(client, served_qwen3.target, tokenizer, "regenerate.endpoints")


def test_an_endpoint_speculating_with_another_drafter_is_refused_naming_both(served_qwen3, tmp_path):
    """Issue 46: evaluate.endpoint= a server speculating with drafter A, evaluate.drafter= B exited 0
    and B's model card recorded A's served acceptance."""
    other = tmp_path / "other"
    export_drafter(build_drafter(read_exported_config(served_qwen3.export), seed=1), other, dtype=torch.float32)
    cfg = compose_config(_evaluate_overrides(served_qwen3.target, other, served_qwen3.speculative.url),
                         config_name="evaluate")
    with pytest.raises(ConfigError) as refused:
        evaluate_served(cfg)
    said = str(refused.value)
    assert f"evaluate.endpoint: the server at {served_qwen3.speculative.url} speculates with " \
           f"'{served_qwen3.export}' (method 'dflash', 7 draft tokens), not with evaluate.drafter='{other}' " \
           f"(other weights: model.safetensors sha256" in said


def test_the_card_records_the_endpoint_and_only_a_checked_drafters_figures(served_qwen3, tmp_path, monkeypatch,
                                                                           caplog):
    """Without vLLM's development mode the server says only its draft length: a block size that differs
    is refused, one that agrees is evaluated, but the card is left alone. Said which drafter it serves
    (here a copy of evaluate.drafter), the card records the figures and the endpoint they came from."""
    drafter, url = shutil.copytree(served_qwen3.export, tmp_path / "copy"), served_qwen3.speculative.url
    small = tmp_path / "block-4"
    config = read_exported_config(served_qwen3.export)
    export_drafter(build_drafter(dataclasses.replace(config, block_size=4), seed=0), small)
    client = OpenAIClient(url)
    monkeypatch.setattr(OpenAIClient, "server_config", lambda self: None)   # no /server_info
    with pytest.raises(ConfigError, match=rf"the server at {url} drafts 7 tokens per step \(block size 8\), "
                                          rf"evaluate.drafter='{small}' has block size 4"):
        check_serves_drafter(client, small, 4, "evaluate.endpoint")
    before = read_card_info(drafter)
    output = tmp_path / "served.json"
    with caplog.at_level("INFO", logger="dflash"):
        assert evaluate.run(_evaluate_overrides(served_qwen3.target, drafter, url, f"evaluate.output={output}")) == 0
    result = json.loads(output.read_text())
    assert result["drafter_checked"] is False and result["endpoint"] == url and result["tau"] >= 1
    assert read_card_info(drafter) == before
    assert "does not say which drafter it speculates with" in caplog.text and "is not updated" in caplog.text

    monkeypatch.undo()
    assert evaluate.run(_evaluate_overrides(served_qwen3.target, drafter, url, f"evaluate.output={output}",
                                            "evaluate.overwrite=true")) == 0
    card = read_card_info(drafter)
    assert json.loads(output.read_text())["drafter_checked"] is True
    assert card["served_acceptance_length"] == json.loads(output.read_text())["tau"]
    assert card["served_acceptance_eval"]["endpoint"] == url
