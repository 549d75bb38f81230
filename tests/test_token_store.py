"""The token store against the loader it replaced (tests/data_reference.py): the same samples in
the same order, the same micro-batches bit for bit, whether tokenised in one process or several,
freshly or from the cache."""
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import dflash_core.data.parallel as parallel
from dflash_core.data import DataError, MicroBatchSource, load_samples
from dflash_core.target.tiny import BUNDLED_DATASET
from tests.data_reference import reference_samples
from tests.test_chat_formats import THINKING, TOOL_CALLING, TOOLS, build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def assert_same_samples(got, want):
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        for key in ("input_ids", "loss_mask"):
            assert a[key].dtype == torch.long and torch.equal(a[key], b[key]), f"sample {k} {key}"


def split(samples, seed=0, fraction=0.05):
    """The held-out split of launcher/roles/target.py: a seeded order, the first share held out."""
    import random
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    num_eval = max(1, round(len(samples) * fraction))
    return order[:num_eval], order[num_eval:]


def test_bundled_store_yields_the_old_loaders_samples_and_micro_batches(tmp_path, tokenizer):
    want = reference_samples([BUNDLED_DATASET], tokenizer, max_length=1024)
    for _ in ("tokenised", "cached"):
        got, stats = load_samples(BUNDLED_DATASET, tokenizer, max_length=1024, cache_dir=tmp_path / "cache")
        assert_same_samples(got, want)
        assert stats["kept"] == len(want) and stats["tokens"] == sum(len(s["input_ids"]) for s in want)
    _, train_ids = split(want)
    for packing in (False, True):
        kwargs = dict(micro_batch_size=4, seed=3, pad_token_id=tokenizer.pad_token_id, packing=packing,
                      fixed_length=256 if packing else None)
        old = MicroBatchSource([want[i] for i in train_ids], **kwargs)
        new = MicroBatchSource(got.subset(train_ids), **kwargs)
        assert new.num_batches_per_epoch == old.num_batches_per_epoch
        for i in range(2 * old.num_batches_per_epoch + 1):   # two epochs and the first batch of a third
            a, b = old.batch(i), new.batch(i)
            assert a.sample_ids == b.sample_ids and a.num_tokens == b.num_tokens
            for key in ("input_ids", "loss_mask", "position_ids"):
                assert torch.equal(getattr(a, key), getattr(b, key)), f"batch {i} {key} packing={packing}"


def test_thinking_and_tool_call_store_yields_the_old_loaders_samples(tmp_path):
    qwen = build_tokenizer("qwen3")
    rows = [{"messages": THINKING, "tools": TOOLS}, {"messages": TOOL_CALLING, "tools": TOOLS},
            {"messages": THINKING[:2] + [{"role": "assistant", "content": "51."}]}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for kwargs in ({}, {"chat_template_kwargs": {"enable_thinking": False}}, {"last_turn_only": True}):
        want = reference_samples([path], qwen, max_length=4096, **kwargs)
        got, _ = load_samples(path, qwen, max_length=4096, cache_dir=tmp_path / "cache", **kwargs)
        assert_same_samples(got, want)


def test_a_pool_of_processes_gives_the_same_samples_and_stats(tmp_path, tokenizer, monkeypatch):
    lines = [json.dumps({"conversations": [{"role": "user", "content": f"What is {k} + 1?"},
                                           {"role": "assistant", "content": f"It is {k + 1}."}]})
             for k in range(700)]
    lines[300] = "{not json"                                           # a bad row, read by a worker
    lines[5] = json.dumps({"messages": [{"role": "user", "content": "only a prompt"}]})  # no pair: dropped
    path = tmp_path / "many.jsonl"
    path.write_text("\n".join(lines) + "\n")
    one, one_stats = load_samples(path, tokenizer, max_length=512, on_bad_line="skip")
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BYTES", 0)  # this small file goes to the pool too
    seen = []
    two, two_stats = load_samples(path, tokenizer, max_length=512, on_bad_line="skip", num_proc=2,
                                  cache_dir=tmp_path / "cache", progress=lambda done, total: seen.append((done, total)))
    assert_same_samples(two, one)
    assert two_stats == one_stats and one_stats["skipped_invalid_json"] == 1 and one_stats["dropped_no_pair"] == 1
    assert seen[-1] == (700, 700) and len(seen) == -(-700 // parallel.CHUNK_RECORDS)  # one report per line range
    with pytest.raises(DataError, match=r"many\.jsonl.*line 301"):   # refused by the worker that read it
        load_samples(path, tokenizer, max_length=512, on_bad_line="fail", num_proc=2, cache_dir=tmp_path / "cache2")


def test_the_pool_starts_its_workers_with_arguments_that_fit_a_pipe(tmp_path, tokenizer, monkeypatch):
    """A spawned worker reads its start-up arguments from a pipe only after importing the caller's main module;
    arguments larger than the pipe's buffer (64 KiB on Linux) block each start until that import is done, so the
    workers start one after another (issue 44: most of prepare's 69 s on a 16-core machine). The tokenizer goes
    by a file, which each worker reads itself."""
    import pickle
    from concurrent.futures import ProcessPoolExecutor
    started = []

    class RecordingPool(ProcessPoolExecutor):
        def __init__(self, *args, initargs=(), **kwargs):
            started.append(len(pickle.dumps(initargs)))
            super().__init__(*args, initargs=initargs, **kwargs)

    monkeypatch.setattr(parallel, "ProcessPoolExecutor", RecordingPool)
    monkeypatch.setattr(parallel, "PARALLEL_MIN_BYTES", 0)
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": f"Say {k}."},
                                                         {"role": "assistant", "content": f"{k}."}]}) + "\n"
                            for k in range(40)))
    pooled, _ = load_samples(path, tokenizer, max_length=512, num_proc=2, cache_dir=tmp_path / "cache")
    assert_same_samples(pooled, load_samples(path, tokenizer, max_length=512)[0])
    assert len(pickle.dumps(tokenizer)) > 4 << 10     # this test's tokenizer as an argument would fail the bound below
    assert started and max(started) < 4 << 10, started


def test_duplicate_records_are_dropped_and_counted(tmp_path, tokenizer):
    record = {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    other = {"conversations": [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]}
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(record) + "\n" + json.dumps(other) + "\n" + json.dumps(record) + "\n")
    b.write_text(json.dumps(other) + "\n")
    samples, stats = load_samples([a, b], tokenizer, max_length=512, drop_duplicates=True)
    kept = load_samples(a, tokenizer, max_length=512)[0]
    assert_same_samples(samples, [kept[0], kept[1]])   # the first of each, in order
    assert stats["read"] == 4 and stats["kept"] == 2 and stats["dropped_duplicate"] == 2
    assert stats["tokens"] == int(np.sum(samples.lengths))
    assert stats["supervised_tokens"] == sum(int(s["loss_mask"].sum()) for s in samples)
    assert "2 duplicates of an earlier record" in __import__("dflash_core.data", fromlist=["x"]).describe_drops(stats)


def test_the_tokenising_bar_estimates_from_the_tokenising_not_the_pool_start(tmp_path, monkeypatch):
    """Issue 44: the first estimate read 5.42 conversations/s, 31:59 left, for a job done in 48 s: the pool's
    start-up counted as tokenising time. On a simulated clock (no real timing): 30 s of start-up, then a chunk
    of 256 records a second; the bar's rate once it is shown is within 2x of 256/s (bursts of one chunk per
    worker could put it off by the workers' count, never by the start-up's 30x)."""
    import tqdm.std
    clock = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    progress = parallel._Progress(tmp_path / "big.jsonl", 256 * 100, None, show=True)
    clock[0] = 30.0
    for _ in range(5):
        progress.advance(256)
        clock[0] += 1.0
    shown = progress.bar.format_dict
    rate = shown["rate"] or (shown["n"] - shown["initial"]) / shown["elapsed"]
    progress.close()
    assert 128 <= rate <= 512, shown
