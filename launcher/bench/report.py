"""The benchmark's table: one line per row, the same columns for every row."""
from __future__ import annotations

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
        lines.append((str(r.get("n", "")), r["row"], *(fmt(r.get(key), spec) for _, key, spec in COLUMNS),
                      r.get("notes", "")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines)
