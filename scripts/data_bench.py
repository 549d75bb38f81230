"""Data benchmark: tokenising throughput (one process, two), and a cached start at scale.

`python scripts/data_bench.py --sizes 100000,1000000 --tokenizer DIR` writes synthetic chats shaped
like the public DFlash recipes' (a system prompt, a user prompt of ~90 words, an answer of ~330
words), then measures:
  tokenise        records/s in one process and with --procs processes (wall clock and per CPU
                  second of this process and its workers: on a shared machine wall-clock rates read low)
  prepare         `launcher.prepare`'s work for each size: the token store written under a cache dir
  cached start    a fresh process opening the stores and building the train micro-batch source
                  (what a target rank does before it streams): seconds and resident memory, beside
                  the same start on the bundled chats
Prints one table and writes it as JSON (--out). Without --tokenizer the tiny target's tokenizer
is built under --work.
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = ("the of and to in is that for it as with was on be by this are or an from at which but not have has "
         "model data train token layer block draft target speed batch length answer question result value "
         "step loss rate memory file process system user number list table graph node edge point line "
         "simple small large fast slow first last next every each other more less between about").split()
PROMPT_WORDS, ANSWER_WORDS = 90, 330


def sentence_block(rng: random.Random, words: int) -> str:
    """About `words` words in sentences of 8-20 words."""
    out, left = [], words
    while left > 0:
        n = min(left, rng.randint(8, 20))
        out.append(" ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + ".")
        left -= n
    return " ".join(out)


def write_chats(path: Path, count: int, seed: int = 0) -> Path:
    """`count` synthetic conversations (a pure function of count and seed), written once."""
    from dflash_core.files.durable import atomic_file
    if path.is_file():
        return path
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as f:
        for k in range(count):
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": sentence_block(rng, PROMPT_WORDS)},
                        {"role": "assistant", "content": sentence_block(rng, ANSWER_WORDS)}]
            f.write(json.dumps({"id": k, "messages": messages}) + "\n")
    return path


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def tokenise(path: Path, tokenizer_dir: Path, procs: int, cache_dir: Path | None) -> dict:
    """Run in a fresh process: tokenise `path` with `procs` processes, the rate per wall and CPU second."""
    from transformers import AutoTokenizer

    import dflash_core.data.parallel as parallel
    from dflash_core.data import load_samples
    parallel.PARALLEL_MIN_BYTES = 0   # the pool for `procs` > 1 whatever the file's size
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    wall, cpu = time.perf_counter(), cpu_seconds()
    samples, stats = load_samples(path, tokenizer, max_length=4096, cache_dir=cache_dir, num_proc=procs)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    return {"records": stats["read"], "tokens": stats["tokens"], "wall_s": wall, "cpu_s": cpu,
            "records_per_s": stats["read"] / wall, "records_per_cpu_s": stats["read"] / cpu}


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cached_start(path: Path | None, tokenizer_dir: Path, cache_dir: Path | None) -> dict:
    """Run in a fresh process: what a target rank does before streaming, from prepared stores."""
    import torch
    from transformers import AutoTokenizer

    from dflash_core.data import MicroBatchSource, load_samples
    from dflash_core.target.tiny import BUNDLED_DATASET
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    before, started = resident_mb(), time.perf_counter()
    samples, stats = load_samples(path or BUNDLED_DATASET, tokenizer, max_length=4096, cache_dir=cache_dir,
                                  drop_duplicates=True)
    order = list(range(len(samples)))
    random.Random(0).shuffle(order)
    num_eval = max(1, round(len(samples) * 0.05))
    source = MicroBatchSource(samples.subset(order[num_eval:]), micro_batch_size=4, seed=0,
                              pad_token_id=tokenizer.pad_token_id)
    batch = source.batch(0)
    ready = time.perf_counter() - started
    assert batch.input_ids.dtype == torch.long
    return {"records": stats["read"], "tokens": stats["tokens"], "ready_s": ready, "rss_mb": resident_mb(),
            "rss_growth_mb": resident_mb() - before}


def in_fresh_process(function: str, *args) -> dict:
    """Run `function(*args)` of this file in a new interpreter (its own resident memory and CPU time)."""
    done = subprocess.run([sys.executable, __file__, "--call", function, json.dumps([str(a) if a else None
                                                                                     for a in args])],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{function}{args} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(sizes: list[int], procs: int, tokenise_records: int, tokenizer: Path, work: Path) -> list[dict]:
    rows = []
    sample = write_chats(work / f"chats_{tokenise_records}.jsonl", tokenise_records)
    for n in (1, procs):
        row = in_fresh_process("tokenise", sample, tokenizer, n, None)
        rows.append({"row": f"tokenise, {n} process{'es' if n > 1 else ''}", **row})
        print(rows[-1], flush=True)
    rows.append({"row": "cached start, bundled chats", **in_fresh_process("cached_start", None, tokenizer, None)})
    print(rows[-1], flush=True)
    for size in sizes:
        chats, cache = write_chats(work / f"chats_{size}.jsonl", size), work / f"cache_{size}"
        row = in_fresh_process("tokenise", chats, tokenizer, procs, cache)
        rows.append({"row": f"prepare {size} conversations, {procs} processes", **row})
        print(rows[-1], flush=True)
        rows.append({"row": f"cached start, {size} conversations", **in_fresh_process("cached_start", chats,
                                                                                      tokenizer, cache)})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000", help="comma-separated conversation counts to prepare")
    parser.add_argument("--procs", type=int, default=2, help="processes of the parallel rows")
    parser.add_argument("--tokenise-records", type=int, default=5000, help="conversations of the tokenise rows")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the tiny target's, built)")
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "data_bench")
    parser.add_argument("--out", type=Path, help="JSON output (default: <work>/data_bench.json)")
    parser.add_argument("--call", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="?", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.call:   # a measurement in this fresh process (in_fresh_process)
        args = [Path(a) if isinstance(a, str) and not a.isdigit() else (int(a) if a else None)
                for a in json.loads(options.args)]
        print(json.dumps(globals()[options.call](*args)))
        return
    tokenizer = options.tokenizer
    if tokenizer is None:
        from dflash_core.target.tiny import build_tiny_target
        tokenizer = build_tiny_target(options.work / "tiny-target")
    rows = bench([int(s) for s in options.sizes.split(",")], options.procs, options.tokenise_records, tokenizer,
                 options.work)
    out = options.out or options.work / "data_bench.json"
    out.write_text(json.dumps(rows, indent=1))
    for row in rows:
        print(" | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
