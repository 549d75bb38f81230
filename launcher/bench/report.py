"""The benchmark's rows by number, and its table: one line per row, the same columns for every row."""
from __future__ import annotations

from enum import IntEnum


class Row(IntEnum):
    """Every row of `python -m launcher.bench`, by the number the table's first column (and the
    JSON's "n") gives it. Full rows: every token real and supervised, one per sequence length.
    Length-mix rows: the mix's real micro-batches (launcher/bench/mix.py), padded and packed."""
    CEILING = 1       # back-to-back matmuls, checked against the device's plausible peak: the MFU denominator
    TARGET = 2        # full rows: the frozen target's capture() on one GPU, with its family's kernel notes
    DRAFTER = 3       # full rows: the real step (DrafterTrainer.train_step) fed from memory
    E2E = 4           # full rows: the real launcher under torchrun, from its summary.json
    BALANCE = 5       # full rows: the T:D split that keeps both stages busy (this node and 8 GPUs)
    BASELINE = 6      # the old one-process, thread-per-drafter design (thread_baseline.py)
    MIX_TARGET = 7    # the same capture on the mix: real tokens/s, padding
    MIX_DRAFTER = 8   # supervised blocks/s (valid anchors per second), anchor_fill, compiles
    MIX_E2E = 9       # the launcher on a conversation file realising the mix (its own tokenisation and
    #                   packing): blocks/s per drafter GPU, real target tokens/s per GPU, pipeline efficiency
    MIX_BALANCE = 10  # the split advice from MIX_TARGET and MIX_DRAFTER
    FP8_CEILING = 11  # row-wise scaled e4m3 matmuls (drafter.matmul_precision=fp8's products): the FP8 MFU denominator
    FP8_DRAFTER = 12  # full rows: DRAFTER's step with drafter.matmul_precision=fp8, MFU against FP8_CEILING

# (header, row key, format): tokens/s are real (non-padding) tokens; blocks/s are supervised blocks
# (valid anchors) per second per drafter GPU; fill is anchor_fill; pad the padding share forwarded.
COLUMNS = (("S", "seq_len", "d"), ("ms/step", "ms_per_step", ".1f"), ("tokens/s", "tokens_per_s", ".0f"),
           ("blocks/s", "supervised_blocks_per_s", ".0f"), ("fill", "anchor_fill", ".2f"),
           ("pad", "padding_fraction", ".2f"), ("TFLOP/s", "tflops", ".2f"), ("MFU", "mfu", ".3f"))


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = ("#", "row", *(name for name, _, _ in COLUMNS), "notes")
    lines = [header]
    for r in rows:
        number = format(r["n"], "d") if "n" in r else ""
        lines.append((number, r["row"], *(fmt(r.get(key), spec) for _, key, spec in COLUMNS), r.get("notes", "")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines)
