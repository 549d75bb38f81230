"""The run's samples from its `data.*` and `target.*` settings: the one call `launcher.train`'s target
ranks and `launcher.prepare` both make, so the same overrides prepare and train."""
from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from dflash_core.data import load_samples, load_tokenizer
from dflash_core.data.parallel import default_num_proc
from launcher.resolve import dataset_paths, tokenizer_dir


def load_run_samples(cfg: DictConfig, tokenizer=None, progress: Callable[[int, int | None], None] | None = None):
    """(tokenizer, samples, stats) for cfg: from the token stores under data.cache_dir when they are
    there (prepared), else tokenised with data.num_proc processes and stored there."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(tokenizer_dir(cfg))
    samples, stats = load_samples(
        dataset_paths(cfg.data.paths, "data.paths"), tokenizer, max_length=cfg.data.max_length,
        last_turn_only=cfg.data.last_turn_only, on_bad_line=cfg.data.on_bad_line, cache_dir=cfg.data.cache_dir,
        chat_template_kwargs=OmegaConf.to_container(cfg.data.chat_template_kwargs),
        drop_duplicates=cfg.data.drop_duplicates, num_proc=cfg.data.num_proc or default_num_proc(),
        progress=progress)
    return tokenizer, samples, stats
