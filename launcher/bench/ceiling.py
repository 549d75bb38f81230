"""The matmul ceilings (report.Row.CEILING, the MFU denominator; report.Row.FP8_CEILING, the FP8 rows')
and the check that keeps them honest.

A ceiling is only used when it is physically possible: it must not exceed the device's plausible
peak (the spec sheet's dense bf16 rate). An implausible ceiling is measured once more with five
times the products; if it is still above the peak the row is an error row, the ceiling is not
used and every MFU prints as '-'. The first 8-GPU run printed an impossible ceiling on an H200
(docs/perf_notes.md, "How to measure", "The ceiling cannot lie") because its CUDA events were
recorded on another GPU's stream (the current device had been set to the
drafter's GPU): here the time is wall clock between synchronisations of the device that runs the
products, for a loop of back-to-back products, and the rate is total FLOPs / total time.
"""
from __future__ import annotations

import re
import time

import torch

# Dense bf16 tensor-core peaks from the vendors' spec sheets, TFLOP/s (no sparsity). Keys are
# whole words of torch.cuda.get_device_name(), e.g. "NVIDIA H200", "NVIDIA A100-SXM4-80GB".
PLAUSIBLE_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "GH200": 989.0,
                         "A100": 312.0, "A800": 312.0, "B200": 2250.0}
REMEASURE_FACTOR = 5
FP8_PEAK_FACTOR = 2       # dense FP8 tensor-core rate / dense bf16 rate on the spec sheets (Ada, Hopper, Blackwell)
H200_HBM_TB_PER_S = 4.8   # the spec sheet's HBM bandwidth: the floor of a memory-bound pass


def plausible_peak(device_name: str) -> float | None:
    """The spec-sheet dense bf16 peak of a device by name, or None for a device not in the table."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    return next((peak for key, peak in PLAUSIBLE_PEAK_TFLOPS.items() if key in words), None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loop_rate(product, flops_per_product: float, device, reps: int, clock) -> tuple[float, float]:
    """(TFLOP/s, seconds) of `reps` back-to-back calls of product(), synchronised before and after."""
    for _ in range(3):
        product()
    sync(device)
    start = clock()
    for _ in range(reps):
        product()
    sync(device)
    seconds = clock() - start
    flops = reps * flops_per_product
    return (flops / seconds / 1e12 if seconds > 0 else float("inf")), seconds


def matmul_ceiling(device: torch.device, *, tiny: bool, reps: int = 20, peak: float | None = None,
                   peak_source: str = "", size: int | None = None, clock=time.perf_counter) -> dict:
    """Row 1: bf16 8192^3 products on a GPU (fp32 1024^3 on the CPU or with --tiny; `size` overrides
    the edge), checked against `peak` (TFLOP/s; None: unchecked, `peak_source` says why). The row has
    "error" when the ceiling is implausible: callers must then not use it (see `usable_ceiling`)."""
    n, dtype = (1024, torch.float32) if device.type == "cpu" or tiny else (8192, torch.bfloat16)
    n = size or n
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return _checked_row("matmul ceiling", f"{n}^3 {str(dtype).removeprefix('torch.')}",
                        lambda: torch.mm(a, b, out=out), 2 * n ** 3, device, reps, peak, peak_source, clock)


def fp8_matmul_ceiling(device: torch.device, *, reps: int = 20, peak: float | None = None, peak_source: str = "",
                       size: int = 8192, clock=time.perf_counter) -> dict:
    """The FP8 ceiling row (report.Row.FP8_CEILING), the FP8 rows' MFU denominator: e4m3 size^3 products
    with row-wise fp32 scales and a bf16 result, as drafter.matmul_precision=fp8 runs them
    (dflash_core/kernels/fp8.py), checked against `peak` (fp8_peak: twice the bf16 one) like row 1."""
    from dflash_core.kernels.fp8 import quantise_rows, scaled_product
    gen = torch.Generator(device=device).manual_seed(0)
    a_q, a_scale = quantise_rows(torch.randn(size, size, device=device, generator=gen))
    b_q, b_scale = quantise_rows(torch.randn(size, size, device=device, generator=gen))
    b_q_t, b_scale_t = b_q.t(), b_scale.t()
    return _checked_row("fp8 matmul ceiling", f"{size}^3 e4m3 row-wise scaled",
                        lambda: scaled_product(a_q, a_scale, b_q_t, b_scale_t), 2 * size ** 3, device, reps, peak,
                        peak_source, clock)


def fp8_peak(bf16_peak: float | None) -> float | None:
    """The dense FP8 tensor-core peak: twice the dense bf16 one on every device of the table (the spec
    sheets' FP8 rate without sparsity)."""
    return None if bf16_peak is None else FP8_PEAK_FACTOR * bf16_peak


def _checked_row(name: str, shape: str, product, flops: float, device, reps: int, peak: float | None,
                 peak_source: str, clock) -> dict:
    """A ceiling row: the rate of back-to-back products, re-measured with REMEASURE_FACTOR times the
    products when above `peak`, and an error row (no usable ceiling) when still above it."""
    rate, seconds = _loop_rate(product, flops, device, reps, clock)
    row = {"row": name, "shape": shape, "reps": reps, "ms_per_step": 1e3 * seconds / reps,
           "tflops": rate, "plausible_peak_tflops": peak, "remeasured": False}
    if peak is None:
        row.update(mfu=1.0, notes=f"{shape}, {reps} back-to-back products; {peak_source or 'no plausible peak'}: "
                                  f"not checked")
        return row
    if rate > peak:
        first = rate
        reps *= REMEASURE_FACTOR
        rate, seconds = _loop_rate(product, flops, device, reps, clock)
        row.update(reps=reps, ms_per_step=1e3 * seconds / reps, tflops=rate, remeasured=True, first_tflops=first)
    checked = f"{shape}, {reps} back-to-back products, below the plausible peak {peak:.0f} ({peak_source})"
    if rate <= peak:
        row.update(mfu=1.0, notes=checked + (" after a re-measurement" if row["remeasured"] else ""))
        return row
    error = (f"implausible {name}: {rate:.1f} TFLOP/s (first {row['first_tflops']:.1f}, re-measured with "
             f"{reps} products) exceeds the plausible peak {peak:.0f} TFLOP/s of {peak_source}; the timing is wrong, "
             f"so the ceiling is not used and MFU is not reported")
    row.update(mfu=None, error=error, notes=f"ERROR: {error}")
    return row


def usable_ceiling(row: dict) -> float | None:
    """The MFU denominator of a ceiling row, or None when the row is an error (never a bad ceiling)."""
    return None if "error" in row else row["tflops"]


def rate_fields(flops_per_step: float, step_s: float, ceiling: float | None) -> dict:
    """ms/step, FLOPs, TFLOP/s and MFU of a measured row, all from the same two numbers, so the MFU
    column is exactly flops_per_step / step_s / ceiling (None without a usable ceiling)."""
    tflops = flops_per_step / step_s / 1e12
    return {"ms_per_step": 1e3 * step_s, "flops_per_step": flops_per_step, "tflops": tflops,
            "mfu": tflops / ceiling if ceiling else None}
