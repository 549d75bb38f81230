"""Where a step's time goes: the profiler's kernel table, and the same kernels summed into a few
named categories per step, with the host gaps (wall time no kernel covers) as their own line.
The categories are what docs/perf_notes.md reasons about: GEMMs at the matmul ceiling, the flex
attention kernels, the optimiser, the compiled (Triton) glue, everything else."""

import re

import torch

# First match wins: flex kernels are Triton too, and must not land in "compiled glue"; flash-attn-4's
# are CuTe (CUTLASS) kernels, and must not land in "gemm".
KERNEL_CATEGORIES = (
    ("flash_backward", re.compile(r"flash_attn.*(bwd|backward)", re.I)),
    ("flash_forward", re.compile(r"flash_attn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|sm90_", re.I)),
    ("flex_backward", re.compile(r"flex_attention_backward", re.I)),
    ("flex_forward", re.compile(r"flex_attention", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam", re.I)),
    ("head_loss", re.compile(r"^(row_stats|gradient)_kernel$")),   # dflash_core/kernels/head_loss.py
    ("compiled_glue", re.compile(r"^triton_", re.I)),
    ("copy_fill", re.compile(r"memcpy|memset|copy|fill", re.I)),
)


# Kernels listed per category: enough to see which casts and reductions the compiled glue is made of.
TOP_PER_CATEGORY = 15


def kernel_category(name: str) -> str:
    for category, pattern in KERNEL_CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


def kernel_breakdown(kernels: list[tuple[str, float]], step_ms: float, steps: int) -> dict:
    """kernels: (name, device milliseconds) per kernel event of `steps` steps; step_ms: one step's
    wall time timed without the profiler (whose own host overhead would read as gaps) -> ms per
    step by category, the kernel sum, the gaps (step - kernels, never negative: kernels of two
    streams may overlap), the ten costliest kernels, and per category its costliest ones with their
    launches per step."""
    per_category: dict[str, float] = {}
    per_kernel: dict[str, list] = {}   # name -> [category, ms per step, launches per step]
    for name, ms in kernels:
        category = kernel_category(name)
        per_category[category] = per_category.get(category, 0.0) + ms / steps
        entry = per_kernel.setdefault(name, [category, 0.0, 0.0])
        entry[1] += ms / steps
        entry[2] += 1 / steps
    kernel_ms = sum(per_category.values())
    if kernel_ms > 1.05 * step_ms:  # one stream cannot run more kernel time than wall time
        print(f"profile: kernels sum to {kernel_ms:.1f} ms per step, more than the step's {step_ms:.1f} ms: "
              "kernels overlapped on several streams, or events were counted twice", flush=True)
    costliest = sorted(per_kernel.items(), key=lambda item: -item[1][1])
    by_category: dict[str, list] = {category: [] for category in per_category}
    for name, (category, ms, launches) in costliest:
        if len(by_category[category]) < TOP_PER_CATEGORY:
            by_category[category].append({"name": name[:160], "ms_per_step": ms, "launches_per_step": launches})
    return {"wall_ms_per_step": step_ms, "kernel_ms_per_step": kernel_ms,
            "gap_ms_per_step": max(step_ms - kernel_ms, 0.0),
            "ms_per_step": dict(sorted(per_category.items(), key=lambda item: -item[1])),
            "top_kernels": [{"name": name[:120], "ms_per_step": ms} for name, (_, ms, _) in costliest[:10]],
            "top_kernels_by_category": by_category}


def _device_kernels(prof) -> list[tuple[str, float]]:
    """(name, device ms) of every kernel, memcpy and memset: device events, less the ranges that
    record_function annotations (optimizer.step, DDP.forward, compiled regions) also draw on the
    device timeline, which would count their kernels twice."""
    return [(event.name, event.device_time_total / 1e3) for event in prof.events()
            if event.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(event, "is_user_annotation", False)]


def profile_steps(step, device: torch.device, sync, step_ms: float, steps: int = 2,
                  trace: str | None = None) -> dict:
    """Profile `steps` calls of step() (step_ms: its unprofiled wall time): the op table, the
    kernel breakdown (CUDA) and dynamo's compile times, and a Chrome trace at `trace` (gzipped
    when the name ends in .gz) for the timeline. Prints the breakdown so a log alone says where
    the time went."""
    from torch._dynamo.utils import compile_times
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    sort = "cuda_time_total" if on_cuda else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    result = {"steps": steps, "table": table, "compile_times": compile_times(repr="str", aggregate=True)}
    if trace:
        prof.export_chrome_trace(trace)
        result["trace"] = trace
    if on_cuda:
        result["breakdown"] = kernel_breakdown(_device_kernels(prof), step_ms, steps)
    print(f"profile of {steps} drafter steps (sorted by {sort}):\n{table}\n"
          f"breakdown per step: {format_breakdown(result.get('breakdown'))}\n"
          f"{format_top_kernels(result.get('breakdown'))}"
          f"compile times:\n{result['compile_times']}", flush=True)
    return result


def format_breakdown(breakdown: dict | None) -> str:
    if not breakdown:
        return "- (kernel times need a CUDA device)"
    parts = [f"{name} {ms:.1f}" for name, ms in breakdown["ms_per_step"].items()]
    return (f"wall {breakdown['wall_ms_per_step']:.1f} ms = kernels {breakdown['kernel_ms_per_step']:.1f} "
            f"({', '.join(parts)}) + gaps {breakdown['gap_ms_per_step']:.1f}")


def format_top_kernels(breakdown: dict | None) -> str:
    """Each category's costliest kernels, one line each: ms and launches per step, name."""
    lines = []
    for category, top in (breakdown or {}).get("top_kernels_by_category", {}).items():
        lines.append(f"{category}:")
        lines += [f"  {k['ms_per_step']:7.3f} ms {k['launches_per_step']:6.1f}x  {k['name']}" for k in top]
    return "\n".join(lines) + ("\n" if lines else "")
