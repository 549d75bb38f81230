"""One function per measured row of `python -m launcher.bench` (the CLI is launcher/bench/__main__.py),
and the timing and subprocess helpers they share."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import torch

from launcher.bench.counts import drafter_step_flops, target_forward_flops

REPO = Path(__file__).resolve().parents[2]
_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[bench +{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------ timing helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_reps(fn, device: torch.device, *, warmup: int, reps: int) -> list[float]:
    """Seconds per call of fn, one value per timed rep (CUDA events on GPU, synchronised)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------------ row 1: matmul
def matmul_ceiling(device: torch.device, *, tiny: bool, reps: int = 20) -> dict:
    """Median TFLOP/s of a square matmul on random data: bf16 8192^3 on GPU, fp32 1024^3 on CPU."""
    n, dtype = (1024, torch.float32) if device.type == "cpu" or tiny else (8192, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    times = timed_reps(lambda: torch.mm(a, b), device, warmup=3, reps=max(reps, 10))
    median = statistics.median(times)
    return {"row": "matmul ceiling", "ms_per_step": 1e3 * median, "tflops": 2 * n ** 3 / median / 1e12,
            "mfu": 1.0, "shape": f"{n}^3 {str(dtype).removeprefix('torch.')}", "reps": len(times),
            "notes": f"{n}^3 {str(dtype).removeprefix('torch.')}, median of {len(times)}"}


# ------------------------------------------------------------------------------ row 2: target
def target_stage(hf_config, layer_ids, device, dtype, seqs, *, warmup: int, reps: int, ceiling: float) -> list[dict]:
    from dflash_core.target import random_target

    t0 = time.perf_counter()
    target = random_target(hf_config, layer_ids=layer_ids, device=device, dtype=dtype, seed=0)
    progress(f"target built in {time.perf_counter() - t0:.1f}s ({target.num_kept_layers} layers kept, "
             f"captures {layer_ids})")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for seq_len in seqs:
        ids = torch.randint(0, min(hf_config.vocab_size, 1024), (1, seq_len), generator=gen).to(device)
        times = timed_reps(lambda: target.capture(ids), device, warmup=warmup, reps=reps)
        step = statistics.median(times)
        flops = target_forward_flops(hf_config, target.num_kept_layers, seq_len)
        row = {"row": "target alone", "seq_len": seq_len, "ms_per_step": 1e3 * step,
               "tokens_per_s": seq_len / step, "tflops": flops / step / 1e12,
               "mfu": flops / step / 1e12 / ceiling, "flops_per_step": flops, "kept_layers": target.num_kept_layers,
               "notes": f"{target.num_kept_layers} layers, 1 GPU" if device.type == "cuda" else
               f"{target.num_kept_layers} layers, cpu"}
        rows.append(row)
        progress(f"target alone S={seq_len}: {row['ms_per_step']:.1f} ms, {row['tokens_per_s']:.0f} tokens/s, "
                 f"{row['tflops']:.1f} TFLOP/s")
    del target
    _compare_full_forward(hf_config, device, dtype, rows, warmup=warmup, reps=reps)
    return rows


def _compare_full_forward(hf_config, device, dtype, rows: list[dict], *, warmup: int, reps: int) -> None:
    """Time the whole model with output_hidden_states (what capture would cost without truncation)
    beside each truncated row, so the saving is measured, not assumed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        full = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    for row in rows:
        ids = torch.randint(0, min(hf_config.vocab_size, 1024), (1, row["seq_len"]), generator=gen).to(device)

        def forward():
            with torch.inference_mode():
                full(input_ids=ids, output_hidden_states=True, use_cache=False)
        row["full_forward_ms"] = 1e3 * statistics.median(timed_reps(forward, device, warmup=warmup, reps=reps))
        row["notes"] += f"; full forward {row['full_forward_ms']:.1f} ms ({row['full_forward_ms'] / row['ms_per_step']:.2f}x)"
        progress(f"full forward S={row['seq_len']}: {row['full_forward_ms']:.1f} ms")
    del full


# ------------------------------------------------------------------------------ row 3: drafter
def drafter_stage(job, seqs, *, work: Path, warmup: int, steps: int, ceiling: float,
                  profile: bool = False) -> list[dict]:
    """The real training step (launcher.roles.trainer.DrafterTrainer.train_step) of one drafter rank,
    fed from memory. profile: two more steps at the last length under torch.profiler; the kernel
    table is printed and kept in that row (with dynamo's compile times)."""
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_core.compile import compile_count
    from launcher.distributed.channel import FeatureBatch
    from launcher.roles.trainer import DrafterTrainer

    device = job.device
    store_path = work / "pg_store"
    store_path.unlink(missing_ok=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(store_path), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=job.cfg.run.timeout_s),
                            device_id=device if backend == "nccl" else None)
    rows = []
    try:
        t0 = time.perf_counter()
        with torch.device(device):  # initialise on the GPU: a 1B-parameter CPU init takes seconds
            trainer = DrafterTrainer(job, dist.group.WORLD)
        dcfg = job.drafter
        params = sum(p.numel() for p in trainer.drafter.parameters())
        progress(f"drafter built in {time.perf_counter() - t0:.1f}s ({params / 1e6:.1f}M params, "
                 f"backend {job.step.backend}, {job.step.num_anchors} anchors x {dcfg.block_size})")
        gen = torch.Generator(device=device).manual_seed(0)
        index = 0
        for seq_len in seqs:
            def random_batch():
                ids = torch.randint(0, min(dcfg.mask_token_id, 1024), (1, seq_len), device=device, generator=gen)
                hidden = torch.randn(1, seq_len, job.target.feature_width, device=device, dtype=torch.bfloat16,
                                     generator=gen)
                return FeatureBatch(0, ids, torch.ones_like(ids), torch.arange(seq_len, device=device).unsqueeze(0),
                                    hidden, seq_len)
            batches = [random_batch() for _ in range(2)]

            def step():
                nonlocal index
                # A new micro-batch index each step: new anchors, exactly as in training.
                batch = dataclasses.replace(batches[index % 2], index=index)
                index += 1
                trainer.train_step([batch])   # ends with .item() calls: synchronised

            t0 = time.perf_counter()
            for _ in range(warmup):
                step()
            warm_s = time.perf_counter() - t0
            compiles_warm = compile_count()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(steps):
                _sync(device)
                t1 = time.perf_counter()
                step()
                _sync(device)
                times.append(time.perf_counter() - t1)
            compiles_after = compile_count()
            step_s = statistics.median(times)
            flops = drafter_step_flops(dcfg, seq_len, job.step.num_anchors)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            row = {"row": "drafter alone", "seq_len": seq_len, "ms_per_step": 1e3 * step_s,
                   "tokens_per_s": seq_len / step_s, "samples_per_s": 1 / step_s,
                   "tflops": flops / step_s / 1e12, "mfu": flops / step_s / 1e12 / ceiling,
                   "flops_per_step": flops, "peak_memory_gib": peak, "warmup_s": warm_s,
                   "compiles_after_warmup": compiles_warm, "compiles_after_timed": compiles_after,
                   "compiles_stable": compiles_after == compiles_warm, "params_m": params / 1e6,
                   "notes": (f"peak {peak:.1f} GiB, " if peak is not None else "")
                   + f"compiles {compiles_warm}->{compiles_after}, warmup {warm_s:.0f}s"}
            if profile and seq_len == seqs[-1]:
                row["profile"] = _profile(step, device)
            rows.append(row)
            progress(f"drafter alone S={seq_len}: {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} "
                     f"tokens/s, {row['tflops']:.1f} TFLOP/s, MFU {row['mfu']:.2f}, {row['notes']}")
        del trainer
    finally:
        dist.destroy_process_group()
    return rows


def _profile(step, device: torch.device, steps: int = 2) -> dict:
    from torch._dynamo.utils import compile_times
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    times = compile_times(repr="str", aggregate=True)
    print(f"profile of {steps} drafter steps (sorted by {sort}):\n{table}\ncompile times:\n{times}", flush=True)
    return {"steps": steps, "table": table, "compile_times": times}


# ------------------------------------------------------------------------------ subprocesses
def stream(cmd: list[str], *, env: dict, timeout_s: float, prefix: str) -> tuple[int | None, str]:
    """Run cmd, echo its output as it comes (prefixed), return (exit code or None on timeout, tail).
    On timeout the whole process group (torchrun and every worker it started) is killed."""
    import signal
    import threading

    tail: deque[str] = deque(maxlen=60)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"  {prefix}| {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=10)
    return code, "\n".join(tail)


def child_env(*, tiny: bool, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    # NVLink multicast stays off on shared multi-GPU hosts (the device machines set these; keep them).
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    if tiny:
        env["OMP_NUM_THREADS"] = "1"
    return {k: v for k, v in env.items() if v is not None}


# ------------------------------------------------------------------------------ row 4: end to end
def e2e_stage(overrides: list[str], *, topology, work: Path, tiny: bool, timeout_s: float) -> dict:
    """The real launcher under torchrun with `topology` (a launcher.distributed.topology.Topology), one process
    per rank; returns its summary.json."""
    import shutil

    run_dir = work / "e2e"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={topology.world_size}",
           "-m", "launcher.train", f"topology={topology.spec}", *overrides, f"run.dir={run_dir}",
           f"isolation.cache_root={work / 'compile_cache'}"]
    progress("end to end: " + " ".join(cmd[1:]))
    code, tail = stream(cmd, env=child_env(tiny=tiny), timeout_s=timeout_s, prefix="e2e")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)   # the 8B drafter's final checkpoint is ~12 GB
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        why = "timed out" if code is None else f"exit code {code}"
        raise RuntimeError(f"end-to-end run failed ({why}); last lines:\n{tail[-3000:]}")
    return json.loads(summary_path.read_text())


# ------------------------------------------------------------------------------ row 6: baseline
def baseline_stage(spec: dict, *, work: Path, tiny: bool, timeout_s: float, cache_dir: Path | None) -> dict:
    """launcher.bench.thread_baseline in a fresh process (its own dynamo state, like the old trainer)."""
    spec_path, out_path = work / "baseline_spec.json", work / "baseline_result.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    out_path.unlink(missing_ok=True)
    extra = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)} if cache_dir is not None else {}
    cmd = [sys.executable, "-m", "launcher.bench.thread_baseline", "--spec", str(spec_path), "--out", str(out_path)]
    progress("thread baseline: " + " ".join(cmd[1:]))
    env = child_env(tiny=tiny)
    env.update(extra)
    code, tail = stream(cmd, env=env, timeout_s=timeout_s, prefix="threads")
    if not out_path.is_file():
        why = "timed out" if code is None else f"exit code {code}"
        raise RuntimeError(f"thread baseline wrote no result ({why}); last lines:\n{tail[-3000:]}")
    return json.loads(out_path.read_text())
