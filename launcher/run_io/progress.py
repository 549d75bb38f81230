"""The progress bar of the commands that work through prompts (synthesize, regenerate, evaluate): on stderr, so
a command's report on stdout stays clean, refreshed at most once a second."""
from __future__ import annotations

import sys


def prompt_progress(what: str, prompts=None, *, total: int | None = None, leave: bool = True):
    """A bar that says `what` is done to prompts: over the iterable `prompts`, or counting to `total` by
    `update` (a bar fed from worker threads)."""
    from tqdm import tqdm

    return tqdm(prompts, total=total, desc=what, unit=" prompts", file=sys.stderr, mininterval=1.0,
                dynamic_ncols=True, leave=leave)
