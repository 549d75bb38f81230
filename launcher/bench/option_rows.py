"""The rows of `python -m launcher.bench` for the step's opt-in speed options (issue 29): the row-wise
scaled e4m3 matmul ceiling (report.Row.FP8_CEILING), and the drafter-alone full rows again with
drafter.matmul_precision=fp8 (Row.FP8_DRAFTER, MFU against that ceiling) and with drafter.cuda_graph
(Row.GRAPH_DRAFTER), each with its speed-up over Row.DRAFTER and the advice that follows. Skipped, with
the reason, where the device cannot run the option (the CPU, --tiny, FP8 before CUDA capability 8.9)
or with --skip-fp8 / --skip-graph."""
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
GRAPH_OVERRIDE = "drafter.cuda_graph=true"
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


def graph_skipped(bench: Bench) -> str | None:
    """Why the CUDA-graph row is not measured in this run, or None."""
    if bench.args.skip_graph:
        return "skipped (--skip-graph)"
    return None if bench.cuda else f"skipped: {bench.device.type} has no CUDA graphs"


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
    _measure_option(bench, full, Row.FP8_DRAFTER, "fp8", FP8_OVERRIDE, ceiling, fp8_skipped(bench))


def measure_graph_drafter(bench: Bench, full: list[Workload], ceiling: float | None) -> None:
    """The drafter-alone full rows with drafter.cuda_graph=true (cudagraph trees replay each compiled
    graph), MFU against the bf16 ceiling; with --profile, its kernel breakdown and gaps beside row 3's."""
    _measure_option(bench, full, Row.GRAPH_DRAFTER, "graph", GRAPH_OVERRIDE, ceiling, graph_skipped(bench))


def _measure_option(bench: Bench, full: list[Workload], n: Row, tag: str, override: str, ceiling: float | None,
                    skipped: str | None) -> None:
    skipped = skipped or (None if full else "skipped: no full rows (--mix-only)")
    bench.rows += measured(bench.rows, n, f"drafter alone {tag}", _option_rows, bench, full, n, tag, override,
                           ceiling, skipped=skipped) or []


def _option_rows(bench: Bench, full: list[Workload], n: Row, tag: str, override: str,
                 ceiling: float | None) -> list[dict]:
    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve

    args = bench.args
    cfg = compose_config(bench.overrides(bench.data_path, max(args.seqs), args.warmup + args.steps, override))
    job = resolve(cfg, Topology(num_targets=0, num_drafters=1), bench.device)
    progress(f"row {n:d}: drafter alone, {override}")
    # --profile: this step's kernel breakdown too, its trace beside the bf16 one.
    workloads = [dataclasses.replace(w, profile=w.profile and w.profile.replace(".trace.", f".{tag}.trace."))
                 for w in full]
    rows = drafter_stage(job, workloads, work=bench.work, warmup=args.warmup, steps=args.steps, ceiling=ceiling)
    if bench.cuda:
        torch.cuda.empty_cache()
    return [against_bf16({**row, "n": n, "row": row["row"].replace("drafter alone", f"drafter alone {tag}"),
                          "option": override}, bench.rows, override) for row in rows]


def against_bf16(row: dict, rows: list[dict], override: str) -> dict:
    """An option's drafter row with its speed-up over the plain row of the same length (Row.DRAFTER)
    and the advice that follows from it (on only from WORTHWHILE_SPEEDUP), first in its notes."""
    plain = next((r for r in rows if r.get("n") == Row.DRAFTER and r.get("seq_len") == row.get("seq_len")
                  and r.get("ms_per_step")), None)
    if plain is None or not row.get("ms_per_step"):
        return row
    speedup = plain["ms_per_step"] / row["ms_per_step"]
    advice = (f"train with {override}" if speedup >= WORTHWHILE_SPEEDUP
              else f"leave {override.split('=')[0]} at its default here")
    return {**row, "speedup_vs_bf16": speedup,
            "notes": f"{speedup:.2f}x the step of row {Row.DRAFTER:d}: {advice}; {row.get('notes', '')}"}
