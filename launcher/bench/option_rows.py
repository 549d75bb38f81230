"""The rows of `python -m launcher.bench` for the step's opt-in speed option, FP8 (issue 29): the row-wise
scaled e4m3 matmul ceiling (report.Row.FP8_CEILING), and the drafter-alone full rows again with
drafter.matmul_precision=fp8 (Row.FP8_DRAFTER, MFU against that ceiling), with their speed-up over
Row.DRAFTER and the advice that follows. Skipped, with the reason, where the device cannot run FP8 (the
CPU, --tiny, CUDA capability below 8.9) or with --skip-fp8."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from launcher.bench.ceiling import fp8_matmul_ceiling, fp8_peak, usable_ceiling
from launcher.bench.report import Row
from launcher.bench.rows import measured
from launcher.bench.stages import drafter_stage, progress

if TYPE_CHECKING:
    from launcher.bench.session import Bench
    from launcher.bench.stages import Workload

FP8_OVERRIDE = "drafter.matmul_precision=fp8"
# An option is advised only when it is this much faster: the same step timed twice on one machine
# differs by up to ~0.6% (docs/perf_notes.md, "FP8, third pass"), so a smaller gain may be noise.
WORTHWHILE_SPEEDUP = 1.02


def fp8_skipped(bench: Bench) -> str | None:
    """Why the FP8 rows are not measured in this run, or None."""
    from dflash_core.kernels.fp8 import unsupported_reason
    if bench.args.skip_fp8:
        return "skipped (--skip-fp8)"
    reason = unsupported_reason(bench.device)   # --tiny runs on the CPU
    return f"skipped: {reason}" if reason else None


def measure_fp8_ceiling(bench: Bench, peak: float | None, peak_source: str) -> float | None:
    """The FP8 ceiling row, checked against twice the bf16 plausible peak; its MFU denominator, or None."""
    skipped = fp8_skipped(bench)
    row = bench.record(Row.FP8_CEILING, "fp8 matmul ceiling", _ceiling_row, bench, peak, peak_source,
                       skipped=skipped)
    return usable_ceiling(row) if row else None


def _ceiling_row(bench: Bench, peak: float | None, peak_source: str) -> dict:
    progress(f"row {Row.FP8_CEILING:d}: fp8 matmul ceiling")
    row = {"n": Row.FP8_CEILING, **fp8_matmul_ceiling(bench.device, peak=fp8_peak(peak),
                                                      peak_source=f"2x bf16 of {peak_source}")}
    progress(f"fp8 matmul ceiling {row['tflops']:.1f} TFLOP/s: {row['notes']}")
    return row


def measure_fp8_drafter(bench: Bench, full: list[Workload], ceiling: float | None) -> None:
    """The drafter-alone full rows with drafter.matmul_precision=fp8 (the same data, shapes and timing as
    Row.DRAFTER), MFU against the FP8 ceiling; with --profile, its kernel breakdown beside row 3's."""
    skipped = fp8_skipped(bench) or (None if full else "skipped: no full rows (--mix-only)")
    bench.rows += measured(bench.rows, Row.FP8_DRAFTER, "drafter alone fp8", _fp8_drafter_rows, bench, full,
                           ceiling, skipped=skipped) or []


def _fp8_drafter_rows(bench: Bench, full: list[Workload], ceiling: float | None) -> list[dict]:
    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve

    args = bench.args
    cfg = compose_config(bench.overrides(bench.data_path, max(args.seqs), args.warmup + args.steps, FP8_OVERRIDE))
    job = resolve(cfg, Topology(num_targets=0, num_drafters=1), bench.device)
    progress(f"row {Row.FP8_DRAFTER:d}: drafter alone, {FP8_OVERRIDE}")
    # --profile: this step's kernel breakdown too, its trace beside the bf16 one.
    workloads = [dataclasses.replace(w, profile=w.profile and w.profile.replace(".trace.", ".fp8.trace."))
                 for w in full]
    rows = drafter_stage(job, workloads, work=bench.work, warmup=args.warmup, steps=args.steps, ceiling=ceiling)
    if bench.cuda:
        torch.cuda.empty_cache()
    return [against_bf16({**row, "n": Row.FP8_DRAFTER, "option": FP8_OVERRIDE,
                          "row": row["row"].replace("drafter alone", "drafter alone fp8")}, bench.rows)
            for row in rows]


def against_bf16(row: dict, rows: list[dict]) -> dict:
    """An FP8 drafter row with its speed-up over the plain row of the same length (Row.DRAFTER) and
    the advice that follows from it (on only from WORTHWHILE_SPEEDUP), first in its notes."""
    plain = next((r for r in rows if r.get("n") == Row.DRAFTER and r.get("seq_len") == row.get("seq_len")
                  and r.get("ms_per_step")), None)
    if plain is None or not row.get("ms_per_step"):
        return row
    speedup = plain["ms_per_step"] / row["ms_per_step"]
    advice = (f"train with {FP8_OVERRIDE}" if speedup >= WORTHWHILE_SPEEDUP
              else f"leave {FP8_OVERRIDE.split('=')[0]} at its default here")
    return {**row, "speedup_vs_bf16": speedup,
            "notes": f"{speedup:.2f}x the step of row {Row.DRAFTER:d}: {advice}; {row.get('notes', '')}"}
