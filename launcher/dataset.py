"""The run's samples from its `data.*` and `target.*` settings: the one call `launcher.train`'s target
ranks and `launcher.prepare` both make, so the same overrides prepare and train."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from dflash_core.data import describe_drops, drop_warning, load_samples
from dflash_core.data.parallel import default_num_proc
from launcher.config.schema import DataSettings


def load_run_samples(sources: list[Path], data: DataSettings, tokenizer,
                     progress: Callable[[int, int | None], None] | None = None):
    """(samples, stats) of the dataset `sources` (data.paths resolved: launcher/resolve.py dataset_paths)
    with the `data` section's settings: from the token stores under data.cache_dir when they are
    there (prepared), else tokenised with data.num_proc processes and stored there."""
    return load_samples(sources, tokenizer, max_length=data.max_length, last_turn_only=data.last_turn_only,
                        on_bad_line=data.on_bad_line, cache_dir=data.cache_dir,
                        chat_template_kwargs=data.chat_template_kwargs, drop_duplicates=data.drop_duplicates,
                        num_proc=data.num_proc or default_num_proc(), progress=progress)


def data_report(stats: dict, data: DataSettings) -> tuple[int, str]:
    """(level, line) of what tokenising kept: a WARNING when records were dropped or truncated, the
    truncated ones counted with the setting that keeps them whole; INFO when every record was kept whole."""
    truncated_to = f"data.max_length={data.max_length} tokens (raise data.max_length to keep them whole)"
    line = drop_warning(stats, truncated_to=truncated_to) or describe_drops(stats, truncated_to)
    changed = stats.get("kept", 0) < stats.get("read", 0) or stats.get("truncated", 0) > 0
    return (logging.WARNING if changed else logging.INFO), line
