"""The benchmark's table: one line per row, the same columns for every row."""
from __future__ import annotations


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    header = ("#", "row", "S", "ms/step", "tokens/s", "TFLOP/s", "MFU", "notes")
    lines = [header]
    for r in rows:
        lines.append((str(r.get("n", "")), r["row"], fmt(r.get("seq_len"), "d"), fmt(r.get("ms_per_step"), ".1f"),
                      fmt(r.get("tokens_per_s"), ".0f"), fmt(r.get("tflops"), ".2f"), fmt(r.get("mfu"), ".3f"),
                      r.get("notes", "")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line[:-1], widths)) + "  " + line[-1] for line in lines)
