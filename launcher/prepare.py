"""`python -m launcher.prepare key=value ...` (or `dflash-prepare`): tokenise a run's dataset on CPU
before the GPU job, into the token stores under data.cache_dir that `launcher.train` then opens in
seconds. It takes launcher.train's keys (only `target.*` and `data.*` matter): pass it the same
overrides as the training run, and the training finds every store prepared. Prints what training
will find: conversations, tokens, supervised tokens, drops by reason, a length histogram."""
from __future__ import annotations

import time

import numpy as np

USAGE = """\
Usage: python -m launcher.prepare [key=value ...]     (the same target.* and data.* overrides as launcher.train)
       dflash-prepare [key=value ...]
Example:
  python -m launcher.prepare target=qwen3_8b target.path=/models/Qwen3-8B data.paths='[/data/regen.jsonl]' \\
      data.max_length=4096 data.cache_dir=/fast/tokenized data.num_proc=32"""


def length_histogram(lengths: np.ndarray, width: int = 40) -> list[str]:
    """Lines of a histogram of sample lengths in power-of-two bins."""
    if len(lengths) == 0:
        return []
    edges = [0] + [2 ** k for k in range(4, max(5, int(np.ceil(np.log2(max(int(lengths.max()), 2)))) + 1))]
    counts = np.histogram(lengths, bins=edges + [max(edges[-1], int(lengths.max())) + 1])[0]
    top = max(int(counts.max()), 1)
    lines = []
    for low, high, count in zip(edges, edges[1:] + [None], counts):
        label = f"{low:>6}-{high - 1:<6}" if high is not None else f"{low:>6}+      "
        lines.append(f"  {label} {int(count):>10}  {'#' * round(width * int(count) / top)}")
    return lines


def summary(samples, stats: dict, seconds: float, data) -> str:
    from launcher.dataset import data_report
    lengths = np.asarray(samples.lengths)
    lines = [f"prepared in {seconds:.1f} s: {stats['kept']} conversations, {stats['tokens']} tokens, "
             f"{stats['supervised_tokens']} supervised "
             f"({stats['supervised_tokens'] / max(stats['tokens'], 1):.1%})",
             f"  {data_report(stats, data)[1]}",
             f"  lengths: min {int(lengths.min())}, median {int(np.median(lengths))}, "
             f"max {int(lengths.max())} tokens",
             *length_histogram(lengths)]
    return "\n".join(lines)


def run(overrides: list[str]) -> int:
    from transformers import AutoConfig

    from dflash_core.data import load_tokenizer
    from launcher.config import compose_config
    from launcher.dataset import load_run_samples
    from launcher.resolve import data_settings, dataset_paths, ensure_embedded_target, target_dir, tokenizer_dir

    cfg = compose_config(overrides)
    ensure_embedded_target(cfg, cfg.run.seed)   # the embedded tiny target's tokenizer, as training builds it
    data = data_settings(cfg, AutoConfig.from_pretrained(target_dir(cfg)))   # its lengths, as training resolves them
    started = time.perf_counter()
    samples, stats = load_run_samples(dataset_paths(cfg.data.paths, "data.paths"), data,
                                      load_tokenizer(tokenizer_dir(cfg)))
    print(summary(samples, stats, time.perf_counter() - started, data))
    print(f"token stores under {cfg.data.cache_dir}: launcher.train with the same target.* and data.* finds them")
    return 0


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "config", USAGE, command="prepare", about=__doc__)


if __name__ == "__main__":
    main()
