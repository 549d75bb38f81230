"""`python -m launcher.regenerate`: the target answers a dataset's prompts; the output trains."""
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from dflash_core.data import load_samples, read_records
from dflash_core.data.prompts import prompt_messages
from dflash_core.target.tiny import BUNDLED_DATASET
from launcher.regeneration.parts import PartWriter, merge_parts, read_part
from tests.launching import REPO, torchrun, wait_for

NUM_PROMPTS, MAX_NEW_TOKENS = 16, 24


def _bundled_conversations(n: int) -> list[tuple[str, list[dict]]]:
    """(id, prompt turns) of the first n bundled records that have a conversation, in file order."""
    ids = [json.loads(line)["id"] for line in BUNDLED_DATASET.read_text().splitlines() if line.strip()]
    out = []
    for (location, record), record_id in zip(read_records(BUNDLED_DATASET), ids):
        if record.messages is not None and len(out) < n:
            out.append((record_id, prompt_messages(record.messages, drop_last_assistant=True)))
    return out


# ----------------------------------------------------------------------------- single process
def test_prompt_is_the_conversation_before_the_last_assistant_turn():
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert prompt_messages(turns, drop_last_assistant=True) == turns[:3]
    assert prompt_messages(turns[:3], drop_last_assistant=True) == turns[:3]  # prompt-only records
    assert prompt_messages(turns, drop_last_assistant=False) is None          # nothing left to answer
    assert prompt_messages(turns[1:2], drop_last_assistant=True) is None


def test_torn_part_line_is_dropped_and_merge_keeps_input_order(tmp_path):
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    def line(i):
        return json.dumps({"index": i, "record": {"id": i}}) + "\n"

    (parts / "rank00000.jsonl").write_text(line(2) + line(0) + '{"index": 4, "rec')  # killed mid-write
    (parts / "rank00001.jsonl").write_text(line(1))
    assert set(read_part(parts / "rank00000.jsonl")) == {0, 2}
    assert (parts / "rank00000.jsonl").read_text() == line(2) + line(0)      # ready to append to again
    assert merge_parts(parts, 2, 5, tmp_path / "out.jsonl") == 3
    assert [json.loads(text)["id"] for text in (tmp_path / "out.jsonl").read_text().splitlines()] == [0, 1, 2]


def test_answers_with_unicode_line_separators_survive_the_merge(tmp_path):
    """An answer holding U+2028 or U+0085 (json.dumps leaves them unescaped) cut its record in two at
    str.splitlines, and the merge dropped it and every answer after it: 369 of 8,000 kept on a GPU."""
    parts = tmp_path / "out.jsonl.parts"
    parts.mkdir()
    texts = ["a\u2028b", "c\x85d", "e\u2029f\x1cg", "plain"]
    with PartWriter(parts / "rank00000.jsonl") as writer:
        for i, text in enumerate(texts):
            writer.write(i, {"id": i, "text": text})
    assert [record["text"] for record in read_part(parts / "rank00000.jsonl").values()] == texts
    assert merge_parts(parts, 1, len(texts), tmp_path / "out.jsonl") == len(texts)


def test_sigterm_of_the_hf_engine_says_what_is_kept_and_keeps_it_for_the_rerun(tmp_path, tiny_target_dir):
    """Issue 46: SIGTERM (`timeout`, a job scheduler) of regenerate.engine=hf exited 143 saying nothing,
    where docs/regeneration.md promises every engine says what it keeps and how to resume."""
    output = tmp_path / "out.jsonl"
    part = output.with_name(output.name + ".parts") / "rank00000.jsonl"
    with open(tmp_path / "err", "w") as err:   # one prompt per batch: answers reach the part file one by one
        command = subprocess.Popen([sys.executable, "-m", "launcher.regenerate", f"target.path={tiny_target_dir}",
                                    f"regenerate.input={BUNDLED_DATASET}", f"regenerate.output={output}",
                                    "regenerate.limit=200", "regenerate.batch_size=1", "regenerate.max_new_tokens=32",
                                    "regenerate.device=cpu"], cwd=REPO, stderr=err,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: command.poll() is not None or (part.is_file() and len(part.read_text().splitlines()) >= 2),
                 300, "two answers in the part file")
        assert command.poll() is None, f"not mid-run:\n{(tmp_path / 'err').read_text()[-3000:]}"
        command.send_signal(signal.SIGTERM)
        code = command.wait(timeout=60)
    finally:
        command.kill()
        command.wait()
    err = (tmp_path / "err").read_text()
    said = re.search(rf"stopped by SIGTERM: (\d+) of (\d+) prompts answered and kept in {re.escape(str(part.parent))}; "
                     rf"run the same command again to answer the other (\d+)", err)
    assert code == 128 + signal.SIGTERM and said, err[-3000:]
    kept, prompts, other = map(int, said.groups())
    assert kept == len(part.read_text().splitlines()) >= 2 and kept + other == prompts
    assert "Traceback" not in err and not output.exists() and not output.with_name("out.jsonl.lock").exists()


# ----------------------------------------------------------------------------- multi-process
@pytest.mark.multiproc
def test_two_ranks_greedy_matches_hf_generate_and_output_trains(tmp_path, tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output = tmp_path / "regenerated.jsonl"
    proc = torchrun(2, f"target.path={tiny_target_dir}", f"regenerate.output={output}",
                    f"regenerate.limit={NUM_PROMPTS}", f"regenerate.max_new_tokens={MAX_NEW_TOKENS}",
                    "regenerate.batch_size=4", "regenerate.device=cpu", "target.dtype=fp32",   # exact, as below
                    module="launcher.regenerate")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not output.with_name(output.name + ".parts").exists()

    records = [json.loads(line) for line in output.read_text().splitlines()]
    expected = _bundled_conversations(NUM_PROMPTS)
    assert [r["id"] for r in records] == [record_id for record_id, _ in expected]  # input order, across ranks
    for record, (_, prompt) in zip(records, expected):
        *turns, answer = record["conversations"]
        assert [t["role"] for t in turns] == [t["role"] for t in prompt]
        assert [t for t in turns if t["role"] != "assistant"] == [t for t in prompt if t["role"] != "assistant"]
        assert answer["role"] == "assistant" and answer["content"].strip() and answer["token_ids"]

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    samples, stats = load_samples([output], tokenizer, max_length=256)
    assert stats["read"] == NUM_PROMPTS and samples

    # Greedy answers from left-padded batches on 2 ranks == HF generate on each prompt alone.
    # (fp32; the smallest top-1/top-2 logit gap seen on these prompts is ~3e-4, far above noise.)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    for record in records:
        text = tokenizer.apply_chat_template(record["conversations"][:-1], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in new:
            new = new[:new.index(tokenizer.eos_token_id)]
        assert tokenizer.decode(new, skip_special_tokens=True).strip() == record["conversations"][-1]["content"]

    run_dir = tmp_path / "run"
    proc = torchrun(2, "topology=t1d1", f"data.paths=[{output}]", f"run.dir={run_dir}",
                    f"target.path={tiny_target_dir}", "train.steps=2", "run.progress=false",
                    f"data.cache_dir={tmp_path / 'tok'}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "summary.json").is_file()


# ----------------------------------------------------------------------------- generated token ids
def _supervised(tmp_path, tokenizer, turn: dict, name: str) -> tuple[list[int], dict]:
    data = tmp_path / f"{name}.jsonl"
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "How many hours are in 8 days?"},
                                                  turn]}) + "\n")
    samples, stats = load_samples([data], tokenizer, max_length=256)
    sample = samples[0]
    return [t for t, m in zip(sample["input_ids"].tolist(), sample["loss_mask"].tolist()) if m], stats


def test_an_answer_that_retokenises_otherwise_trains_on_the_ids_the_target_generated(tmp_path, tiny_target_dir):
    """Issue 27 item B: the target generated the answer one character per token; its text
    re-tokenises into merged tokens, which the target never produced. The drafter must learn the
    generated ids; a record without ids (or with ids that are not the answer) trains on the text."""
    from dflash_core.data import load_tokenizer
    tokenizer = load_tokenizer(tiny_target_dir)
    answer = "There are 192 hours in 8 days."
    text_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    generated = [i for char in answer for i in tokenizer(char, add_special_tokens=False)["input_ids"]]
    assert tokenizer.decode(generated) == answer and generated != text_ids   # the premise
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    supervised, stats = _supervised(tmp_path, tokenizer, {"role": "assistant", "content": answer,
                                                          "token_ids": generated}, "generated")
    assert supervised == generated + [end]
    assert stats["generated_id_turns"] == 1 and stats["supervised_tokens"] == len(generated) + 1

    with_stop = {"role": "assistant", "content": answer, "token_ids": generated + [end]}   # the stop token kept too
    assert _supervised(tmp_path, tokenizer, with_stop, "with_stop")[0] == generated + [end]
    old, _ = _supervised(tmp_path, tokenizer, {"role": "assistant", "content": answer}, "text_only")
    assert old == text_ids + [end]
    other, stats = _supervised(tmp_path, tokenizer, {"role": "assistant", "content": answer,
                                                     "token_ids": generated[:-1]}, "not_the_answer")
    assert other == text_ids + [end] and stats["generated_ids_unused"] == 1


def test_token_ids_must_be_integers_on_an_assistant_turn():
    from dflash_core.data.records import BadRecord, normalise_record
    for turns in ([{"role": "user", "content": "a", "token_ids": [1]}],
                  [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "token_ids": ["x"]}],
                  [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "token_ids": [-1]}]):
        with pytest.raises(BadRecord, match="token_ids must be a list of non-negative integers"):
            normalise_record({"conversations": turns})
