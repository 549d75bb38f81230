"""One function per measured row of `python -m launcher.bench` (the CLI is launcher/bench/__main__.py),
and the timing and subprocess helpers they share."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from launcher.bench.ceiling import rate_fields, sync
from launcher.bench.counts import documents_of, drafter_step_flops, target_forward_flops
from launcher.bench.profiling import profile_steps
from launcher.bench.report import fmt
from launcher.parent_death import die_with_parent_preexec

REPO = Path(__file__).resolve().parents[2]
_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[bench +{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------ workloads
@dataclass
class Workload:
    """The micro-batches one measured row feeds a stage, one per step, cycled through."""
    row: str                          # the row's name
    seq_len: int
    input_ids: list[torch.Tensor]     # [1, S] each
    loss_masks: list[torch.Tensor]    # [1, S]
    position_ids: list[torch.Tensor]  # [1, S]: restarting at every document of a packed row
    real_tokens: list[int]            # non-padding tokens per micro-batch
    packed: bool                      # the target captures per document (the launcher passes positions)
    extra: dict = field(default_factory=dict)   # copied into the row: mode, epoch padding and anchor fill
    profile: str | None = None        # --profile: two more drafter steps under torch.profiler, trace path

    def __len__(self) -> int:
        return len(self.input_ids)


def full_row_workload(seq_len: int, id_limit: int, num_anchors: int, *, seed: int = 0) -> Workload:
    """Two synthetic full rows: every token real and supervised (the benchmark's original rows)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, id_limit, (1, seq_len), generator=gen) for _ in range(2)]
    return Workload("full rows", seq_len, ids, [torch.ones_like(i) for i in ids],
                    [torch.arange(seq_len).unsqueeze(0)] * 2, [seq_len] * 2, packed=False,
                    extra={"mode": "full", "epoch_padding_fraction": 0.0,
                           "epoch_anchor_fill": min(seq_len - 1, num_anchors) / num_anchors})


def mix_workload(rows, seq_len: int) -> Workload:
    """The micro-batches of a launcher.bench.mix.MixRows (micro-batch 1)."""
    return Workload(f"{rows.mode} mix", seq_len, [b.input_ids for b in rows.batches],
                    [b.loss_mask for b in rows.batches], [b.position_ids for b in rows.batches],
                    list(rows.real_tokens), packed=rows.mode == "packed",
                    extra={"mode": rows.mode, "epoch_padding_fraction": rows.padding_fraction,
                           "epoch_anchor_fill": rows.epoch_anchor_fill})


def _measured_steps(step, num_batches: int, device, *, warmup: int, steps: int, clock) -> list[tuple]:
    """(seconds, micro-batch k, what step(k) returned) of each timed step; step(k) runs micro-batch k
    of num_batches, cycled. Each step is timed between synchronisations of `device` (wall clock:
    right whatever the current device is, unlike events recorded on the current stream)."""
    for i in range(warmup):
        step(i % num_batches)
    timed = []
    for i in range(warmup, warmup + steps):
        k = i % num_batches
        sync(device)
        start = clock()
        out = step(k)
        sync(device)
        timed.append((clock() - start, k, out))
    return timed


def _throughput(stage: str, workload: Workload, timed: list[tuple], flops: list[float], ceiling) -> dict:
    """The fields every stage row shares: mean step time, FLOPs, MFU, real tokens/s and padding over
    the timed steps, and the real tokens/s of a whole epoch of such rows at that step time."""
    seconds = sum(t for t, _, _ in timed)
    real = sum(workload.real_tokens[k] for _, k, _ in timed)
    step_s = seconds / len(timed)
    return {"row": f"{stage} alone, {workload.row}", "stage": stage, "seq_len": workload.seq_len, "steps": len(timed),
            **rate_fields(sum(flops) / len(flops), step_s, ceiling),
            "tokens_per_s": real / seconds, "padding_fraction": 1 - real / (workload.seq_len * len(timed)),
            **workload.extra,
            "epoch_tokens_per_s": (1 - workload.extra["epoch_padding_fraction"]) * workload.seq_len / step_s}


# ------------------------------------------------------------------------------ the target rows
def target_stage(hf_config, layer_ids, device, dtype, workloads: list[Workload], *, warmup: int, reps: int,
                 ceiling: float | None, compiled: bool = False, attention: str | None = None,
                 full_forward: bool = True, clock=time.perf_counter) -> list[dict]:
    """The frozen target's capture() on one device as the launcher runs it (`compiled`: its layers
    through torch.compile, job.compile.target_compiled; `attention`: job.target.attention, the
    variable-length kernel for packed rows on GPU), one row per workload: real (non-padding)
    tokens/s, the padding share it forwarded, compiles, and where the family runs slow fallbacks
    (families.kernel_notes, printed and kept in the row)."""
    from dflash_core.target.capture import random_target
    from dflash_core.target.families import kernel_notes

    t0 = time.perf_counter()
    target = random_target(hf_config, layer_ids=layer_ids, device=device, dtype=dtype, seed=0, compiled=compiled,
                           attn_implementation=attention)
    notes = kernel_notes(target.decoder.config)
    progress(f"target built in {time.perf_counter() - t0:.1f}s ({target.num_kept_layers} layers kept, captures "
             f"{layer_ids}, {'compiled' if compiled else 'eager'}, attention {attention or 'default'})"
             + "".join(f"\n  kernel note: {n}" for n in notes))
    rows = [_target_row(target, hf_config, workload, device, warmup=warmup, reps=reps, ceiling=ceiling,
                        notes=notes, clock=clock) for workload in workloads]
    del target
    if full_forward:
        _compare_full_forward(hf_config, device, dtype, [r for r in rows if r["mode"] == "full"],
                              warmup=warmup, reps=reps, clock=clock)
    return rows


def _target_row(target, hf_config, workload: Workload, device, *, warmup: int, reps: int, ceiling, notes, clock):
    from dflash_core.drafter.compile import compile_count

    ids = [i.to(device) for i in workload.input_ids]
    positions = [p.to(device) for p in workload.position_ids] if workload.packed else [None] * len(ids)
    before = compile_count("target_layer")
    timed = _measured_steps(lambda k: target.capture(ids[k], position_ids=positions[k]), len(ids), device,
                            warmup=warmup, steps=reps, clock=clock)
    flops = [target_forward_flops(hf_config, target.num_kept_layers, workload.seq_len,
                                  documents=documents_of(workload.position_ids[k][0]) if workload.packed else None)
             for _, k, _ in timed]
    row = {**_throughput("target", workload, timed, flops, ceiling),
           "kept_layers": target.num_kept_layers, "compiles_before": before,
           "compiles_after_timed": compile_count("target_layer"), "kernel_notes": notes}
    row["notes"] = (f"{target.num_kept_layers} layers, {device.type}, compiles {before}->"
                    f"{row['compiles_after_timed']}" + ("; kernel notes: " + "; ".join(n.split(":")[0] for n in notes)
                                                        if notes else ""))
    progress(f"{row['row']} S={workload.seq_len}: {row['ms_per_step']:.1f} ms, {row['tokens_per_s']:.0f} real "
             f"tokens/s, {row['tflops']:.1f} TFLOP/s, padding {row['padding_fraction']:.0%}")
    return row


def _compare_full_forward(hf_config, device, dtype, rows: list[dict], *, warmup: int, reps: int, clock) -> None:
    """Time the whole model with output_hidden_states (what capture would cost without truncation)
    beside each full-row row, so the saving is measured, not assumed."""
    from transformers import AutoModelForCausalLM

    from dflash_core.target.families import text_config

    torch.manual_seed(0)
    with torch.device(device):
        full = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    for row in rows:
        ids = torch.randint(0, min(text_config(hf_config).vocab_size, 1024), (1, row["seq_len"]), generator=gen)
        ids = ids.to(device)

        def forward(_):
            with torch.inference_mode():
                full(input_ids=ids, output_hidden_states=True, use_cache=False)
        timed = _measured_steps(forward, 1, device, warmup=warmup, steps=reps, clock=clock)
        row["full_forward_ms"] = 1e3 * sum(t for t, _, _ in timed) / len(timed)
        ratio = row["full_forward_ms"] / row["ms_per_step"]
        row["notes"] += f"; full eager forward {row['full_forward_ms']:.1f} ms ({ratio:.2f}x)"
        progress(f"full forward S={row['seq_len']}: {row['full_forward_ms']:.1f} ms")


# ------------------------------------------------------------------------------ the drafter rows
def drafter_stage(job, workloads: list[Workload], *, work: Path, warmup: int, steps: int, ceiling: float | None,
                  clock=time.perf_counter) -> list[dict]:
    """The real training step (launcher.roles.trainer.DrafterTrainer.train_step) of one drafter rank on
    job.device, fed each workload's micro-batches from memory (random target features), one row per
    workload: supervised blocks/s (valid anchors per second), anchor_fill, real tokens/s, compiles
    before and after the timed steps and dflash_core.drafter.compile.report(). A workload marked `profile`
    runs two more steps under torch.profiler (launcher.bench.profiling): the kernel table, time per
    kernel category and gaps, and dynamo's compile times land in its row, the trace beside it."""
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.roles.trainer import DrafterTrainer

    device = job.device
    store_path = work / "pg_store"
    store_path.unlink(missing_ok=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(store_path), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=job.run.timeout_s),
                            device_id=device if backend == "nccl" else None)
    try:
        # What earlier stages of this process still hold (a compiled graph keeps its module's weights
        # alive): each row's peak is booked above it, so a later row's peak is its own.
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        t0 = time.perf_counter()
        with torch.device(device):  # initialise on the GPU: a 1B-parameter CPU init takes seconds
            trainer = DrafterTrainer(job, dist.group.WORLD)
        params = sum(p.numel() for p in trainer.drafter.parameters())
        progress(f"drafter built in {time.perf_counter() - t0:.1f}s ({params / 1e6:.1f}M params, "
                 f"backend {job.step.backend}, {job.step.num_anchors} anchors x {job.drafter.block_size})")
        gen = torch.Generator(device=device).manual_seed(0)
        stepper = _Stepper(trainer)
        rows = [_drafter_workload(stepper, job, workload, gen, warmup=warmup, steps=steps, ceiling=ceiling,
                                  params=params, clock=clock, resident=resident) for workload in workloads]
        del trainer, stepper
    finally:
        dist.destroy_process_group()
    return rows


class _Stepper:
    """Training steps on fixed micro-batches, each with a new micro-batch index (new anchors, as in
    training); returns the launched step (trainer.LaunchedStep: queued, not waited for)."""

    def __init__(self, trainer):
        self.trainer, self.index, self.batches = trainer, 0, []

    def __call__(self, k: int):
        launched = self.trainer.train_step([dataclasses.replace(self.batches[k], index=self.index)])
        self.index += 1
        return launched


def _pipelined_steps(stepper: _Stepper, num_batches: int, device, *, steps: int, clock) -> list[tuple]:
    """(seconds, micro-batch k, StepCounts) of `steps` steps run as the drafter loop runs them: step
    i + 1 is queued before step i is read, so the host prepares a step while the device finishes
    the last. Timed as one stretch between two synchronisations; each step is booked an equal share
    (the steps overlap, so no single one has a time of its own)."""
    sync(device)
    start = clock()
    results, previous = [], None
    for i in range(steps):
        launched = stepper(i % num_batches)
        if previous is not None:
            results.append(previous.result())
        previous = launched
    results.append(previous.result())
    sync(device)
    share = (clock() - start) / steps
    return [(share, i % num_batches, result.counts) for i, result in enumerate(results)]


def _drafter_workload(stepper: _Stepper, job, workload: Workload, gen, *, warmup: int, steps: int, ceiling,
                      params: int, clock, resident: int) -> dict:
    from dflash_core.drafter.compile import compile_count, report
    from launcher.distributed.channel import HIDDEN_DTYPE, FeatureBatch

    device = job.device
    hidden = torch.randn(1, workload.seq_len, job.target.feature_width, device=device, dtype=HIDDEN_DTYPE,
                         generator=gen)
    stepper.batches = [FeatureBatch(0, workload.input_ids[k].to(device), workload.loss_masks[k].to(device),
                                    workload.position_ids[k].to(device), hidden, workload.real_tokens[k])
                       for k in range(len(workload))]
    before = compile_count()
    t1 = time.perf_counter()
    for k in range(warmup):
        stepper(k % len(workload)).result()
    warm_s = time.perf_counter() - t1
    warm = compile_count()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = _pipelined_steps(stepper, len(workload), device, steps=steps, clock=clock)
    row = _drafter_row(job, workload, timed, ceiling, params=params, warm_s=warm_s,
                       compiles=(before, warm, compile_count()), report=report(), resident=resident)
    if workload.profile:
        row["profile"] = profile_steps(lambda: stepper(0), device, sync, step_ms=row["ms_per_step"],
                                       trace=workload.profile)
    return row


def _drafter_row(job, workload: Workload, timed, ceiling, *, params: int, warm_s: float, compiles: tuple,
                 report: dict, resident: int) -> dict:
    device = job.device
    flops = drafter_step_flops(job.drafter, workload.seq_len, job.step.num_anchors)
    seconds = sum(t for t, _, _ in timed)
    valid = sum(float(counts.tau_count) for _, _, counts in timed)
    slots = sum(float(counts.anchor_slots) for _, _, counts in timed)
    peak = (torch.cuda.max_memory_allocated(device) - resident) / 2**30 if device.type == "cuda" else None
    before, warm, after = compiles
    row = {**_throughput("drafter", workload, timed, [flops], ceiling),
           "samples_per_s": len(timed) / seconds, "supervised_blocks_per_s": valid / seconds,
           "epoch_supervised_blocks_per_s": workload.extra["epoch_anchor_fill"] * job.step.num_anchors
           * len(timed) / seconds,
           "anchor_fill": valid / slots if slots else None, "peak_memory_gib": peak,
           "resident_before_gib": resident / 2**30, "warmup_s": warm_s,
           "compiles_before": before, "compiles_after_warmup": warm, "compiles_after_timed": after,
           "compiles_stable": after == warm, "compile_report": report, "params_m": params / 1e6}
    row["notes"] = (f"epoch: {row['epoch_supervised_blocks_per_s']:.0f} blocks/s, fill "
                    f"{row['epoch_anchor_fill']:.2f}, {row['epoch_tokens_per_s']:.0f} real tok/s; "
                    + (f"peak {peak:.1f} GiB, " if peak is not None else "")
                    + (f"above {resident / 2**30:.1f} GiB earlier rows held, " if resident >= 2**30 else "")
                    + f"compiles {before}->{warm}->{after}, warmup {warm_s:.0f}s")
    progress(f"{row['row']} S={workload.seq_len}: {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} real "
             f"tokens/s, {row['tflops']:.1f} TFLOP/s, MFU {fmt(row['mfu'], '.2f')}, {row['notes']}")
    return row


# ------------------------------------------------------------------------------ subprocesses
def stream(cmd: list[str], *, env: dict, timeout_s: float, prefix: str) -> tuple[int | None, str]:
    """Run cmd, echo its output as it comes (prefixed), return (exit code or None on timeout, tail).
    On timeout the whole process group (torchrun and every worker it started) is killed; if this
    process dies, the kernel kills cmd (and torchrun's workers follow torchrun)."""
    tail: deque[str] = deque(maxlen=60)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True, preexec_fn=die_with_parent_preexec())

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
    # NVLink multicast stays off on shared multi-GPU hosts; a value the environment already sets is kept.
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    if tiny:
        env["OMP_NUM_THREADS"] = "1"
    return {k: v for k, v in env.items() if v is not None}


# ------------------------------------------------------------------------------ the end-to-end rows
def e2e_stage(overrides: list[str], *, topology, work: Path, tiny: bool, timeout_s: float, name: str = "e2e") -> dict:
    """The real launcher under torchrun with `topology` (a launcher.distributed.topology.Topology), one process
    per rank, in run dir work/<name>; returns its summary.json."""
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={topology.world_size}",
           "-m", "launcher.train", f"topology={topology.spec}", *overrides, f"run.dir={run_dir}",
           f"isolation.cache_root={work / 'compile_cache'}"]
    progress("end to end: " + " ".join(cmd[1:]))
    code, tail = stream(cmd, env=child_env(tiny=tiny), timeout_s=timeout_s, prefix=name)
    # An 8B-class drafter's final checkpoint is large: fp32 weights and both AdamW moments, 12 bytes a weight.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        why = "timed out" if code is None else f"exit code {code}"
        raise RuntimeError(f"end-to-end run failed ({why}); last lines:\n{tail[-3000:]}")
    return json.loads(summary_path.read_text())


# ------------------------------------------------------------------------------ the thread baseline
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
