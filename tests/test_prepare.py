"""launcher.prepare fills the token stores that a training start with the same overrides opens, and
says when it reuses them or finds them stale."""
import json
import logging

import pytest
import torch

import dflash_core.data.tokenize as tokenize
from dflash_core.data import load_tokenizer
from launcher import prepare
from launcher.config import compose_config
from launcher.config.schema import DataSettings
from launcher.dataset import data_report, load_run_samples
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


def test_no_data_group_caps_a_users_lengths_and_a_truncation_names_its_setting(tmp_path, tiny_target_dir, capsys):
    """data.max_length has one default, the schema's (the target's max_position_embeddings), which a user's
    data.paths keeps; a record cut shorter is counted in a warning naming the setting, a clean load is info."""
    assert compose_config([]).data.max_length is DataSettings().max_length is None
    chats = tmp_path / "long.jsonl"
    answer = " ".join(str(k) for k in range(150))   # a few hundred tokens: past 256, within the tiny target's 1024
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Count."},
                                              {"role": "assistant", "content": answer}]}) + "\n")
    overrides = [f"target.path={tiny_target_dir}", f"data.paths=[{chats}]", f"data.cache_dir={tmp_path / 'tok'}"]
    assert prepare.run(overrides) == 0
    assert "kept 1 of 1 records, dropped 0\n" in capsys.readouterr().out   # whole, as the user gave it
    assert prepare.run([*overrides, "data.max_length=64"]) == 0
    assert "1 truncated to data.max_length=64 tokens (raise data.max_length" in capsys.readouterr().out
    truncated = {"read": 2, "kept": 2, "truncated": 1}
    assert data_report(truncated, DataSettings(max_length=64))[0] == logging.WARNING
    assert data_report({**truncated, "truncated": 0}, DataSettings(max_length=64))[0] == logging.INFO
    assert data_report({"read": 2, "kept": 1}, DataSettings(max_length=64))[0] == logging.WARNING


@pytest.fixture
def dflash_log(caplog):
    """The project's log lines (its logger does not propagate once a command set it up)."""
    logger, level = logging.getLogger("dflash"), logging.getLogger("dflash").level
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def test_a_prepared_store_is_reused_saying_so_and_a_changed_file_is_named_stale(tmp_path, tiny_target_dir,
                                                                               dflash_log, capsys):
    """Issue 46: with a changed source file the store was rebuilt, but nothing said it was stale;
    reusing it was not logged either."""
    chats = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"What is {k} + 2?"},
                          {"role": "assistant", "content": f"{k} + 2 = {k + 2}."}]} for k in range(6)]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"target.path={tiny_target_dir}", f"data.paths=[{chats}]", f"data.cache_dir={tmp_path / 'tok'}",
                 "data.max_length=64", "data.num_proc=1"]
    assert prepare.run(overrides) == 0
    assert "token store" not in dflash_log.text   # the first preparation: nothing to reuse, nothing stale
    assert prepare.run(overrides) == 0
    assert f"reusing the prepared token store of {chats}" in dflash_log.text and "stale" not in dflash_log.text
    dflash_log.clear()

    with chats.open("a") as f:
        f.write(json.dumps(rows[0] | {"messages": rows[0]["messages"][:1] + [{"role": "assistant", "content": "4"}]})
                + "\n")
    assert prepare.run(overrides) == 0
    assert f"the prepared token store of {chats.resolve()} is stale: the file changed since it was prepared" \
        in dflash_log.text and "reusing" not in dflash_log.text
    assert "7 conversations" in capsys.readouterr().out
