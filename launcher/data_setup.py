"""Turn the data config into the train and held-out micro-batch sources a target unit serves."""
from __future__ import annotations

import random
from pathlib import Path

from omegaconf import DictConfig
from transformers import AutoTokenizer

from dflash_core.data import MicroBatchSource, load_samples
from dflash_core.tiny import BUNDLED_DATASET
from launcher.config import ConfigError
from launcher.setup_models import tokenizer_dir

_BUNDLED = {"bundled:tiny_chat": BUNDLED_DATASET}


def resolve_dataset(entry) -> Path:
    """A dataset path, or the name of a bundled set (`bundled:tiny_chat`)."""
    return Path(_BUNDLED.get(str(entry), entry))


def dataset_paths(cfg: DictConfig) -> list[Path]:
    paths = [resolve_dataset(p) for p in cfg.data.paths]
    if not paths:
        raise ConfigError("data.paths=[]: name at least one .jsonl/.json/.parquet file")
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"data.paths: {str(path)!r} does not exist")
    return paths


def build_sources(cfg: DictConfig) -> tuple[MicroBatchSource, MicroBatchSource | None, dict]:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir(cfg))
    samples, stats = load_samples(
        dataset_paths(cfg), tokenizer, max_length=cfg.data.max_length, last_turn_only=cfg.data.last_turn_only,
        on_bad_line=cfg.data.on_bad_line, cache_dir=cfg.data.cache_dir)
    order = list(range(len(samples)))
    random.Random(cfg.run.seed).shuffle(order)
    num_eval = round(len(samples) * cfg.data.eval_fraction) if cfg.train.eval_batches > 0 else 0
    if cfg.data.eval_fraction > 0 and cfg.train.eval_batches > 0:
        num_eval = max(1, num_eval)
    if num_eval >= len(samples):
        raise ConfigError(f"data.eval_fraction={cfg.data.eval_fraction} leaves no training sample "
                          f"out of {len(samples)}")
    held_out = [samples[i] for i in order[:num_eval]]
    train = [samples[i] for i in order[num_eval:]]
    stats.update(train_samples=len(train), eval_samples=len(held_out))

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def source(subset):
        return MicroBatchSource(subset, micro_batch_size=cfg.train.micro_batch_size, seed=cfg.run.seed,
                                pad_token_id=pad_id, length_multiple=cfg.data.length_multiple,
                                fixed_length=cfg.data.fixed_length)
    return source(train), (source(held_out) if held_out else None), stats
