"""launcher.prepare fills the token stores that a training start with the same overrides opens."""
import json

import pytest
import torch

import dflash_core.data.tokenize as tokenize
from dflash_core.data import load_tokenizer
from launcher import prepare
from launcher.config import compose_config
from launcher.dataset import load_run_samples
from launcher.distributed.topology import Topology
from launcher.resolve import resolve


def test_prepare_fills_the_stores_training_opens_and_says_what_it_will_find(tmp_path, tiny_target_dir, capsys,
                                                                          monkeypatch):
    chats = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {k} + 2?"},
                          {"role": "assistant", "content": f"{k} + 2 = {k + 2}."}]} for k in range(30)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:4]) + "{broken\n")
    overrides = [f"target.path={tiny_target_dir}", f"data.paths=[{chats}]", f"data.cache_dir={tmp_path / 'tok'}",
                 "data.on_bad_line=skip", "data.max_length=64"]
    assert prepare.run(overrides) == 0
    printed = capsys.readouterr().out
    assert "30 conversations" in printed and "kept 30 of 35 records, dropped 5" in printed
    assert "4 duplicates of an earlier record" in printed and "1 invalid JSON" in printed
    assert "lengths: min" in printed and "#" in printed
    monkeypatch.setattr(tokenize, "tokenize_source", lambda *a, **k: pytest.fail("training tokenised again"))
    job = resolve(compose_config(overrides), Topology(1, 1), torch.device("cpu"))   # as a target rank loads them
    samples, stats = load_run_samples(job.data_sources(), job.data, load_tokenizer(job.tokenizer_dir))
    assert len(samples) == stats["kept"] == 30 and stats["dropped_duplicate"] == 4
