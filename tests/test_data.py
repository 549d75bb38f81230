import json
import math
import random
import re

import pytest
import torch
from transformers import AutoTokenizer

import dflash_core.data.tokenize as data
from dflash_core.data import (
    DataError,
    MicroBatchSource,
    describe_drops,
    drop_warning,
    load_samples,
    load_tokenizer,
)
from dflash_core.target.tiny import BUNDLED_DATASET

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TWO_TURNS = [
    SYSTEM,
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5. The answer is 5."},
    {"role": "user", "content": "And 5 + 4?"},
    {"role": "assistant", "content": "5 + 4 = 9. The answer is 9."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def load_one(tmp_path, tokenizer, record, **kwargs):
    kwargs.setdefault("max_length", 512)
    samples, stats = load_samples(write_jsonl(tmp_path / "one.jsonl", [record]), tokenizer, **kwargs)
    assert len(samples) == 1
    return samples[0], stats


def supervised_runs(mask):
    """(start, end) of each maximal run of 1s in a 0/1 mask."""
    runs, start = [], None
    for position, value in enumerate(mask.tolist() + [0]):
        if value and start is None:
            start = position
        elif not value and start is not None:
            runs.append((start, position))
            start = None
    return runs


# ------------------------------------------------------------------------- loss masks
def test_loss_mask_covers_each_assistant_turn_and_its_end_token(tmp_path, tokenizer):
    sample, _ = load_one(tmp_path, tokenizer, {"id": "a", "conversations": TWO_TURNS})
    ids, mask = sample["input_ids"], sample["loss_mask"]
    assert ids.tolist() == tokenizer.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True)["input_ids"]
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    runs = supervised_runs(mask)
    assert [tokenizer.decode(ids[s:e]) for s, e in runs] == [
        "2 + 3 = 5. The answer is 5.<|im_end|>", "5 + 4 = 9. The answer is 9.<|im_end|>"]
    for start, end in runs:
        assert ids[start - len(header):start].tolist() == header  # the header right before is not supervised
        assert ids[end - 1] == im_end and ids[end] == tokenizer("\n")["input_ids"][0]  # newline after: not supervised
    # The system and user turns' own <|im_end|> tokens stay unsupervised.
    assert [int(mask[p]) for p in (ids == im_end).nonzero().flatten()] == [0, 0, 1, 0, 1]


def test_last_turn_only_supervises_the_final_assistant_turn(tmp_path, tokenizer):
    sample, _ = load_one(tmp_path, tokenizer, {"conversations": TWO_TURNS}, last_turn_only=True)
    runs = supervised_runs(sample["loss_mask"])
    assert [tokenizer.decode(sample["input_ids"][s:e]) for s, e in runs] == ["5 + 4 = 9. The answer is 9.<|im_end|>"]


def test_sharegpt_records_match_role_content_records(tmp_path, tokenizer):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"id": "s", "conversations": [{"from": names[m["role"]], "value": m["content"]} for m in TWO_TURNS]}
    expected, _ = load_one(tmp_path, tokenizer, {"messages": TWO_TURNS})
    got, _ = load_one(tmp_path, tokenizer, sharegpt)
    assert torch.equal(got["input_ids"], expected["input_ids"])
    assert torch.equal(got["loss_mask"], expected["loss_mask"])


def test_preformatted_text_is_supervised_in_full(tmp_path, tokenizer):
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there!<|im_end|>\n"
    sample, _ = load_one(tmp_path, tokenizer, {"id": "t", "text": text})
    assert sample["input_ids"].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert sample["loss_mask"].all()


# ------------------------------------------------------------------------- filtering and errors
def test_truncation_is_counted(tmp_path, tokenizer):
    sample, stats = load_one(tmp_path, tokenizer, {"conversations": TWO_TURNS}, max_length=40)
    assert len(sample["input_ids"]) == 40 and stats["truncated"] == 1
    full, _ = load_one(tmp_path, tokenizer, {"conversations": TWO_TURNS})
    assert torch.equal(sample["loss_mask"], full["loss_mask"][:40])


def test_samples_without_two_consecutive_supervised_tokens_are_dropped(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"conversations": TWO_TURNS},
        {"conversations": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]},
        {"conversations": [{"role": "user", "content": "A very long question " * 20}, TWO_TURNS[2]]},
    ])
    samples, stats = load_samples(path, tokenizer, max_length=60)
    assert len(samples) == 1
    assert stats["dropped_no_pair"] == 2  # an empty answer (<|im_end|> alone) and an answer truncated away
    assert stats["read"] == 3 and stats["kept"] == 1 and stats["truncated"] == 2


@pytest.mark.parametrize("bad_line, reason", [
    ("{not json", "invalid JSON"),
    (json.dumps({"conversations": [{"from": "robot", "value": "x"}]}), "malformed record"),
    (json.dumps({"id": 3}), "malformed record")])
def test_malformed_line_fails_naming_file_and_line(tmp_path, tokenizer, bad_line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"conversations": TWO_TURNS}, "", bad_line])
    with pytest.raises(DataError, match=re.escape(f"{path} line 3: {reason}")):
        load_samples(path, tokenizer, max_length=512)


def test_invalid_utf8_is_one_bad_line_not_a_dead_file(tmp_path, tokenizer):
    path = tmp_path / "bytes.jsonl"
    good = json.dumps({"conversations": TWO_TURNS}).encode()
    path.write_bytes(good + b"\n" + b'{"text": "caf\xe9"}\n' + good + b"\n")
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: invalid UTF-8: byte 13")):
        load_samples(path, tokenizer, max_length=512)
    samples, stats = load_samples(path, tokenizer, max_length=512, on_bad_line="skip")
    assert len(samples) == 2 and stats["skipped_invalid_utf8"] == stats["bad_lines_skipped"] == 1
    assert stats["first_bad_line"].startswith(f"{path} line 2: invalid UTF-8")


def test_json_list_records_are_located_by_line(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"conversations": TWO_TURNS}, {"conversations": []}], indent=1))
    line = [n for n, text in enumerate(path.read_text().splitlines(), start=1) if text == " {"][1]  # record 2
    with pytest.raises(DataError, match=re.escape(f"{path} line {line}: malformed record")):
        load_samples(path, tokenizer, max_length=512)
    path.write_text('[\n{"text": "ok"},\n{"text": oops}\n]')
    with pytest.raises(DataError, match=re.escape(f"{path} line 3: invalid JSON (a .json file is read whole)")):
        load_samples(path, tokenizer, max_length=512, on_bad_line="skip")
    path.write_bytes(b'[\n{"text": "ok"},\n{"text": "caf\xe9"}\n]')
    with pytest.raises(DataError, match=re.escape(f"{path} line 3: invalid UTF-8 (a .json file is read whole)")):
        load_samples(path, tokenizer, max_length=512, on_bad_line="skip")


def test_malformed_lines_are_skipped_and_counted(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", ["{not json", {"conversations": TWO_TURNS}, "[1, 2]"])
    samples, stats = load_samples(path, tokenizer, max_length=512, on_bad_line="skip")
    assert len(samples) == 1 and stats["bad_lines_skipped"] == 2 and stats["read"] == 3


def test_empty_dataset_after_filtering_is_an_error_with_counts(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "empty.jsonl", ["oops", {"conversations": [{"role": "user", "content": "Hi"}]}])
    with pytest.raises(DataError, match=r"no usable samples.*'dropped_no_pair': 1.*'bad_lines_skipped': 1"):
        load_samples(path, tokenizer, max_length=512, on_bad_line="skip")


def test_drop_counts_say_why_and_warn_when_most_are_dropped(tmp_path, tokenizer):
    lines = ["{oops", json.dumps({"conversations": [{"role": "robot", "content": "x"}]}),
             {"conversations": [{"role": "user", "content": "Hi"}]}, {"conversations": TWO_TURNS}]
    samples, stats = load_samples(write_jsonl(tmp_path / "d.jsonl", lines), tokenizer, max_length=512,
                                  on_bad_line="skip")
    assert len(samples) == 1 and stats["read"] == stats["kept"] + stats["dropped_no_pair"] + stats["bad_lines_skipped"]
    warning = drop_warning(stats)
    assert warning.startswith("WARNING: most of the dataset was dropped: kept 1 of 4 records, dropped 3 "
                              "(1 invalid JSON, 1 malformed record, 1 with fewer than two supervised tokens)")
    assert f"first skipped line: {tmp_path / 'd.jsonl'} line 1: invalid JSON" in warning
    _, clean = load_samples(write_jsonl(tmp_path / "ok.jsonl", [{"conversations": TWO_TURNS}] * 3), tokenizer,
                            max_length=512)
    assert drop_warning(clean) is None and describe_drops(clean) == "kept 3 of 3 records, dropped 0"


def test_tokenizer_paths_are_checked_before_any_hub_lookup(tmp_path, tiny_target_dir, monkeypatch):
    import transformers
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(k) or real(*a, **k))
    with pytest.raises(DataError, match="tokenizer path 'Qwen/Qwen3-8B' does not exist"):
        load_tokenizer("Qwen/Qwen3-8B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no tokenizer"):
        load_tokenizer(tmp_path / "empty")
    assert calls == []
    assert load_tokenizer(tiny_target_dir).is_fast and calls == [{"local_files_only": True}]


def test_tokenizer_without_chat_template_is_a_clear_error(tmp_path, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"conversations": TWO_TURNS}])
    with pytest.raises(DataError, match=re.escape(f"tokenizer {tiny_target_dir} has no chat template")):
        load_samples(path, tokenizer, max_length=512)


def test_json_list_files_are_read(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"conversations": TWO_TURNS}, {"text": "plain text sample"}]))
    samples, stats = load_samples(path, tokenizer, max_length=512)
    assert len(samples) == 2 and stats["read"] == 2


# ------------------------------------------------------------------------- cache and bundled data
def test_tokenisation_is_cached_per_file_tokenizer_and_settings(tmp_path, tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": TWO_TURNS}])
    cache = tmp_path / "cache"
    first, first_stats = load_samples(path, tokenizer, max_length=512, cache_dir=cache)
    monkeypatch.setattr(data, "tokenize_source", lambda *a, **k: pytest.fail("cache miss"))
    again, again_stats = load_samples(path, tokenizer, max_length=512, cache_dir=cache)
    assert again_stats == first_stats
    assert torch.equal(again[0]["input_ids"], first[0]["input_ids"])
    assert torch.equal(again[0]["loss_mask"], first[0]["loss_mask"])
    assert again[0]["input_ids"].dtype == torch.long
    monkeypatch.undo()
    load_samples(path, tokenizer, max_length=256, cache_dir=cache)  # other settings: a new entry
    write_jsonl(path, [{"conversations": TWO_TURNS[:3]}])  # other bytes: a new entry
    changed, _ = load_samples(path, tokenizer, max_length=512, cache_dir=cache)
    assert len(list(cache.glob("*/meta.json"))) == 3
    assert len(changed[0]["input_ids"]) < len(first[0]["input_ids"])


@pytest.mark.parametrize("damage", ["torn ids", "torn index", "flipped index", "no meta", "foreign meta"])
def test_corrupt_or_partial_store_is_rebuilt_with_a_warning_never_used(tmp_path, tokenizer, damage):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": TWO_TURNS}, {"text": "plain text sample"}])
    cache = tmp_path / "cache"
    first = list(load_samples(path, tokenizer, max_length=512, cache_dir=cache)[0])  # copies, not the damaged map
    [store] = [meta.parent for meta in cache.glob("*/meta.json")]
    file = {"torn ids": "ids.bin", "torn index": "offsets.bin", "flipped index": "offsets.bin"}.get(damage, "meta.json")
    content = (store / file).read_bytes()
    if damage.startswith("torn"):
        (store / file).write_bytes(content[:len(content) // 2])
    elif damage == "flipped index":  # same size, other offsets: only the checksum tells
        (store / file).write_bytes(content[:8] + bytes([content[8] ^ 1]) + content[9:])
    elif damage == "no meta":  # a writer killed before its rename leaves no meta.json under the final name
        (store / file).unlink()
    else:
        (store / file).write_text('{"format": "something-else"}')
    with pytest.warns(UserWarning, match=re.escape(f"tokenised store {store} is unusable") + ".*rebuilding it"):
        again, _ = load_samples(path, tokenizer, max_length=512, cache_dir=cache)
    for got, want in zip(again, first, strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
    assert data.open_store(store) is not None  # rewritten whole
    assert not list(cache.glob(".*"))  # no temporary or set-aside store left behind


def test_directories_and_plain_strings_are_read(tmp_path, tokenizer):
    folder = tmp_path / "set"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"conversations": TWO_TURNS}])
    (folder / "b.json").write_text(json.dumps([{"text": "plain text sample"}]))
    (folder / "README.md").write_text("not data")
    samples, stats = load_samples(str(folder), tokenizer, max_length=512)
    assert len(samples) == 2 and stats["read"] == 2
    assert len(load_samples(str(folder / "a.jsonl"), tokenizer, max_length=512)[0]) == 1
    (tmp_path / "none").mkdir()
    for path, message in [(tmp_path / "none", "holds no .jsonl/.json/.parquet file"),
                          (tmp_path / "missing", "dataset path not found"), (folder / "README.md", "unsupported")]:
        with pytest.raises(DataError, match=re.escape(str(path)) + ".*" + re.escape(message) + "|"
                           + re.escape(message) + ".*" + re.escape(str(path))):
            load_samples(path, tokenizer, max_length=512)


def test_datasets_dict_directory_reads_its_train_split(tmp_path, tokenizer):
    import datasets
    datasets.disable_progress_bars()
    train = [{"conversations": TWO_TURNS, "text": None}, {"conversations": None, "text": "plain text sample"}]
    splits = datasets.DatasetDict(train=datasets.Dataset.from_list(train),
                                  test=datasets.Dataset.from_list(train[:1]))
    splits.save_to_disk(str(tmp_path / "dd"))
    samples, stats = load_samples(tmp_path / "dd", tokenizer, max_length=512)
    assert len(samples) == 2 and stats["read"] == 2
    datasets.DatasetDict(a=splits["train"], b=splits["test"]).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(DataError, match="splits \\['a', 'b'\\] and no 'train' split"):
        load_samples(tmp_path / "ab", tokenizer, max_length=512)
    datasets.Dataset.from_list([*train, {"conversations": [], "text": None}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad'} row 3: malformed record")):
        load_samples(tmp_path / "bad", tokenizer, max_length=512)


def test_chat_template_kwargs_must_be_a_json_dict(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": TWO_TURNS}])
    with pytest.raises(ValueError, match="chat_template_kwargs must hold JSON values"):
        load_samples(path, tokenizer, max_length=512, chat_template_kwargs={"when": object()})


def test_several_files_add_up_even_when_one_keeps_nothing(tmp_path, tokenizer):
    useful = write_jsonl(tmp_path / "useful.jsonl", [{"conversations": TWO_TURNS}])
    useless = write_jsonl(tmp_path / "useless.jsonl", [{"conversations": [{"role": "user", "content": "Hi"}]}])
    for _ in range(2):  # the second pass reads both files' results from the cache
        samples, stats = load_samples([useful, useless], tokenizer, max_length=512, cache_dir=tmp_path / "cache")
        assert len(samples) == 1 and stats["read"] == 2 and stats["dropped_no_pair"] == 1


def test_bundled_dataset_loads_completely(tokenizer):
    samples, stats = load_samples(BUNDLED_DATASET, tokenizer, max_length=1024)
    assert stats["read"] == stats["kept"] == len(samples) >= 400
    assert stats["bad_lines_skipped"] == stats["dropped_no_pair"] == stats["truncated"] == 0
    assert 0.3 < stats["supervised_tokens"] / stats["tokens"] < 0.9
    print(f"\nbundled dataset: {stats}")


# ------------------------------------------------------------------------- micro-batches
def synthetic_samples(count=37, seed=0):
    """Samples of random lengths whose tokens encode their own index (sample k holds 1000 + k)."""
    rng = random.Random(seed)
    samples = []
    for k in range(count):
        length = rng.randint(5, 150)
        samples.append({"input_ids": torch.full((length,), 1000 + k, dtype=torch.long),
                        "loss_mask": torch.ones(length, dtype=torch.long)})
    return samples


def make_source(samples, **kwargs):
    kwargs = {"micro_batch_size": 4, "seed": 7, "pad_token_id": 0, "length_multiple": 16, **kwargs}
    return MicroBatchSource(samples, **kwargs)


def test_batch_is_a_pure_function_of_its_index():
    samples = synthetic_samples()
    source = make_source(samples)
    indices = [0, 5, 9, 10, 23, 3]  # crosses the epoch boundary (10 batches per epoch)
    batches = [source.batch(i) for i in indices]
    for i, batch in zip(reversed(indices), reversed(batches)):  # a fresh object, resuming out of order
        again = make_source(samples).batch(i)
        assert again.index == batch.index == i and again.sample_ids == batch.sample_ids
        assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.loss_mask, batch.loss_mask)
    assert len({tuple(b.sample_ids) for b in batches}) == len(batches)
    assert make_source(samples, seed=8).batch(0).sample_ids != batches[0].sample_ids


def epoch_rows(source, epoch):
    per_epoch = source.num_batches_per_epoch
    return [row for i in range(epoch * per_epoch, (epoch + 1) * per_epoch) for row in source.batch(i).sample_ids]


@pytest.mark.parametrize("packing", [False, True])
def test_every_sample_appears_once_per_epoch(packing):
    samples = synthetic_samples()
    source = make_source(samples, packing=packing, fixed_length=256 if packing else None)
    assert source.num_batches_per_epoch == (math.ceil(source.num_rows / 4) if packing else 10)
    orders = []
    for epoch in range(2):
        rows = epoch_rows(source, epoch)
        assert sorted(sid for row in rows for sid in row) == list(range(len(samples)))
        assert rows.count(()) == source.num_batches_per_epoch * 4 - source.num_rows  # filler rows
        orders.append(rows)
    assert orders[0] != orders[1]


def test_padding_is_on_the_right_with_pad_id_and_no_loss():
    samples = synthetic_samples()
    source = make_source(samples, pad_token_id=3)
    for i in range(source.num_batches_per_epoch):
        batch = source.batch(i)
        assert batch.input_ids.shape[0] == 4 and batch.input_ids.shape[1] % 16 == 0
        for row, sids in enumerate(batch.sample_ids):
            assert len(sids) <= 1
            sid = sids[0] if sids else -1
            n = len(samples[sid]["input_ids"]) if sid >= 0 else 0
            assert torch.equal(batch.position_ids[row], torch.arange(batch.input_ids.shape[1]))
            if sid >= 0:
                assert torch.equal(batch.input_ids[row, :n], samples[sid]["input_ids"])
                assert torch.equal(batch.loss_mask[row, :n], samples[sid]["loss_mask"])
            assert (batch.input_ids[row, n:] == 3).all() and (batch.loss_mask[row, n:] == 0).all()


def test_fixed_length_pads_every_batch_to_it():
    source = make_source(synthetic_samples(), fixed_length=160)
    assert {source.batch(i).input_ids.shape[1] for i in range(10)} == {160}
    with pytest.raises(ValueError, match=r"sample \d+ has 148 tokens, more than fixed_length=100"):
        make_source(synthetic_samples(), fixed_length=100)


def test_length_bucketing_reduces_padding():
    samples = synthetic_samples(count=400)
    bucketed, unbucketed = make_source(samples, bucket_window=8), make_source(samples, bucket_window=1)
    assert bucketed.padding_fraction() < unbucketed.padding_fraction()
    print(f"\npadding: bucketed {bucketed.padding_fraction():.3f}, unbucketed {unbucketed.padding_fraction():.3f}")


# ------------------------------------------------------------------------- packing
def test_packed_rows_hold_whole_samples_back_to_back():
    samples = synthetic_samples()
    source = make_source(samples, packing=True, fixed_length=256, pad_token_id=3)
    assert source.num_rows < len(samples) / 2
    for i in range(source.num_batches_per_epoch):
        batch = source.batch(i)
        assert batch.input_ids.shape == batch.position_ids.shape == (4, 256)
        assert batch.num_tokens == sum(len(samples[sid]["input_ids"]) for sids in batch.sample_ids for sid in sids)
        for row, sids in enumerate(batch.sample_ids):
            offset = 0
            for sid in sids:
                n = len(samples[sid]["input_ids"])
                assert torch.equal(batch.input_ids[row, offset:offset + n], samples[sid]["input_ids"])
                assert torch.equal(batch.loss_mask[row, offset:offset + n], samples[sid]["loss_mask"])
                assert torch.equal(batch.position_ids[row, offset:offset + n], torch.arange(n))
                offset += n
            # The padding is a segment of its own, starting at 0, with no loss.
            assert torch.equal(batch.position_ids[row, offset:], torch.arange(256 - offset))
            assert (batch.input_ids[row, offset:] == 3).all() and (batch.loss_mask[row, offset:] == 0).all()


def test_packed_batch_is_a_pure_function_of_its_index():
    samples = synthetic_samples()
    source = make_source(samples, packing=True, fixed_length=256)
    indices = [0, 2, 3, 7, 5]  # crosses the epoch boundary
    assert source.num_batches_per_epoch < 7
    for i in reversed(indices):  # a fresh object, resuming out of order
        again, first = make_source(samples, packing=True, fixed_length=256).batch(i), source.batch(i)
        assert again.sample_ids == first.sample_ids
        for field in ("input_ids", "loss_mask", "position_ids"):
            assert torch.equal(getattr(again, field), getattr(first, field))
    other_seed = make_source(samples, packing=True, fixed_length=256, seed=8)
    assert epoch_rows(other_seed, 0) != epoch_rows(source, 0)


def test_packing_fills_rows():
    samples = synthetic_samples(count=400)  # 5..150 tokens
    padded = make_source(samples, fixed_length=512)
    windows = {rows: make_source(samples, fixed_length=512, packing=True, pack_window_rows=rows) for rows in (1, 64)}
    assert windows[64].padding_fraction() < 0.05 and padded.padding_fraction() > 0.7
    assert windows[64].padding_fraction() < windows[1].padding_fraction()
    assert windows[64].padding_fraction(epoch=3) == windows[64].padding_fraction()
    print(f"\npadding at fixed_length=512: padded {padded.padding_fraction():.3f}, "
          f"packed {windows[64].padding_fraction():.3f} (window of 1 row: {windows[1].padding_fraction():.3f})")


def test_packing_needs_fixed_length_and_rejects_longer_samples():
    with pytest.raises(ValueError, match="packing needs a fixed row length"):
        make_source(synthetic_samples(), packing=True)
    with pytest.raises(ValueError, match=r"has 148 tokens, more than fixed_length=147.*max_length <= 147"):
        make_source(synthetic_samples(), packing=True, fixed_length=147)
