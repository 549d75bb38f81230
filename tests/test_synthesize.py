"""`python -m launcher.synthesize`: user prompts sampled from the target (Magpie): the opening it is
fed, what is dropped as junk or as a near-duplicate, and an interrupted run resuming to the same output."""
import json

import pytest

from dflash_core.data import load_tokenizer
from launcher.config import ConfigError, compose_config
from launcher.synthesize import Candidate, HFSampler, Judge, NearDuplicates, synthesize, user_turn_opening, validate


def _cfg(tiny_target_dir, tmp_path, *extra):
    return compose_config([f"target.path={tiny_target_dir}", f"synthesize.output={tmp_path / 'prompts.jsonl'}",
                           "synthesize.device=cpu", *extra], config_name="synthesize")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_opening_is_the_template_up_to_the_users_words(tiny_target_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_target_dir)
    s = _cfg(tiny_target_dir, tmp_path).synthesize
    opening = user_turn_opening(tokenizer, s)
    assert opening == "<|im_start|>user\n"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False)
    assert rendered.startswith(opening + "hi there")
    with_system = _cfg(tiny_target_dir, tmp_path, "synthesize.system_prompt=Be brief.").synthesize
    assert user_turn_opening(tokenizer, with_system) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_near_duplicates_by_normalised_text_and_shared_ngrams():
    near = NearDuplicates(n=3, overlap=0.6)
    assert near.add_unless_duplicate("Can you provide a summary of the benefits of using AI in healthcare?")
    assert not near.add_unless_duplicate("can you provide a SUMMARY of the benefits of using AI in healthcare")
    # 10 of its 11 word 3-grams are the first's
    assert not near.add_unless_duplicate("Can you provide a summary of the benefits of using AI in education?")
    assert near.add_unless_duplicate("What is a non-trivial solution to the Poisson distribution?")
    # a short request inside a longer kept one: the smaller side's n-grams decide
    assert not near.add_unless_duplicate("What is a non-trivial solution")
    assert near.add_unless_duplicate("Can you help me plan a beach vacation for my family?")


def test_junk_is_dropped_and_counted(tiny_target_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_target_dir)
    judge = Judge(tokenizer, _cfg(tiny_target_dir, tmp_path, "synthesize.max_chars=200").synthesize)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    good = "Can you recommend a healthy meal plan for a toddler?"
    cases = {
        "unfinished": Candidate(ids(good), finished=False),
        "template_token": Candidate(ids("Tell me a joke") + [tokenizer.convert_tokens_to_ids("<|im_start|>")] +
                                    ids("assistant"), True),
        "too_short": Candidate(ids("Hello there"), True),
        "too_long": Candidate(ids("Please explain the following words to me: " + "lorem ipsum " * 20), True),
        "not_text": Candidate(ids("1234 5678 9012 3456 ++-- == {} [] 42"), True),
        "repetitive": Candidate(ids("Help me plan" + " ENTIRE" * 17), True),
    }
    for why, case in cases.items():
        assert judge(case) is None, why
    assert judge(Candidate(ids(good), True)) == good
    assert judge(Candidate(ids(good.upper()), True)) is None   # the same request, normalised
    assert dict(judge.counts) == {**{why: 1 for why in cases}, "kept": 1, "near_duplicate": 1}


def test_bad_settings_are_named(tiny_target_dir, tmp_path):
    for extra, key in ((["synthesize.num_prompts=4", "synthesize.heldout=4"], "synthesize.heldout"),
                       (["synthesize.output=/tmp/prompts.txt"], "synthesize.output"),
                       (["synthesize.endpoints=[http://127.0.0.1:1]"], "synthesize.endpoints"),
                       (["synthesize.num_prompts=8", "synthesize.max_candidates=4"], "synthesize.max_candidates")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(_cfg(tiny_target_dir, tmp_path, *extra))


# Loose filters: the tiny target writes few requests a real model would; what is checked is the machinery.
LOOSE = ["synthesize.min_words=1", "synthesize.min_letter_fraction=0", "synthesize.max_new_tokens=12",
         "synthesize.batch_size=4", "synthesize.num_prompts=6", "synthesize.heldout=2", "synthesize.max_candidates=400"]


def test_interrupted_run_resumes_to_the_same_prompts(tiny_target_dir, tmp_path, monkeypatch):
    whole = _cfg(tiny_target_dir, tmp_path / "whole", *LOOSE)
    report = synthesize(whole)
    train, heldout = tmp_path / "whole" / "prompts.jsonl", tmp_path / "whole" / "prompts.heldout.jsonl"
    records = _lines(train) + _lines(heldout)
    assert (len(_lines(train)), len(_lines(heldout))) == (4, 2)
    assert all([turn["role"] for turn in r["conversations"]] == ["user"] for r in records)
    assert len({r["id"] for r in records}) == 6 and report["counts"]["kept"] == 6
    assert not (tmp_path / "whole" / "prompts.jsonl.parts").exists()

    rounds = []
    sample = HFSampler.sample

    def dies_after_a_round(self, start, wanted):   # 6 prompts take at least two rounds of 4
        if rounds:
            raise KeyboardInterrupt("killed")
        rounds.append(start)
        return sample(self, start, wanted)

    resumed = _cfg(tiny_target_dir, tmp_path / "resumed", *LOOSE)
    monkeypatch.setattr(HFSampler, "sample", dies_after_a_round)
    with pytest.raises(KeyboardInterrupt):
        synthesize(resumed)
    assert (tmp_path / "resumed" / "prompts.jsonl.parts").is_dir()
    monkeypatch.setattr(HFSampler, "sample", lambda self, start, wanted: rounds.append(start) or
                        sample(self, start, wanted))
    synthesize(resumed)
    assert _lines(tmp_path / "resumed" / "prompts.jsonl") + _lines(tmp_path / "resumed" / "prompts.heldout.jsonl") \
        == records
    assert len(rounds) == len(set(rounds)), rounds   # no round sampled twice
