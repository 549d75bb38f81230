"""Whether the drafter's step fits its device, checked on every rank before anything loads.

A shape too large for the memory used to end in the kernel's OOM kill of a drafter at its first step,
seen by the user only as its peers' `ChannelError: ... Connection closed by peer` and torchrun's exit
code -9 (issue 44). Here each drafter's need at the run's shape (dflash_core/drafter/memory.py: weights,
optimiser, activations at rows x anchors x block over the longest row) is set against the memory it
shares: on CPU the host's available RAM, with the other drafters and the targets on that host (a
target's weights: its checkpoint's size); on a GPU that GPU's free memory, with the ranks given the same
GPU. A shape that does not fit is a ConfigError naming its settings and, one at a time, the smaller
anchors, micro-batch or block that would fit.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from dflash_core.drafter.memory import GIB, StepMemory, parameter_count, step_memory
from dflash_core.target.families import text_config
from launcher.config import ConfigError
from launcher.job import Job

log = logging.getLogger("dflash")
# What a smaller step may change, in the order offered: fewer anchors or rows keep the drafter as it is
# (a step trains on fewer blocks), a shorter block changes what it drafts.
_SMALLER = (("drafter.num_anchors", "num_anchors", 1), ("train.micro_batch_size", "rows", 1),
            ("drafter.block_size", "block_size", 2))


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    num_anchors: int
    block_size: int


def longest_row(job: Job) -> int:
    """The most tokens a training row holds: data.fixed_length, else data.max_length (resolved)."""
    return job.data.fixed_length or job.data.max_length


def estimate(job: Job, shape: Shape) -> StepMemory:
    """One drafter rank's StepMemory for the job's drafter at `shape`."""
    config = dataclasses.replace(job.drafter, block_size=shape.block_size)
    return step_memory(config, parameters=parameter_count(config), rows=shape.rows, seq_len=longest_row(job),
                       num_anchors=shape.num_anchors, chunk_blocks=job.step.chunk_blocks, backend=job.step.backend,
                       compute_bytes=job.step.compute_dtype.itemsize, drafters=job.topology.num_drafters,
                       grad_accum=job.train.grad_accum,
                       tied_head=bool(getattr(text_config(job.target.hf_config), "tie_word_embeddings", False)),
                       head_in_place=job.step.compiled and job.device.type == "cuda" and not job.step.with_teacher,
                       teacher=job.step.with_teacher)


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors: the GPU's free memory, or the host's MemAvailable (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return None
    return int(fields["MemAvailable"].split()[0]) * 1024 if "MemAvailable" in fields else None


def target_bytes(job: Job) -> int:
    """A target rank's weights as loaded: its checkpoint's safetensors files, taken as 16-bit, in the
    compute dtype and split over its tensor-parallel ranks (the whole checkpoint: a truncated load holds less)."""
    stored = sum(f.stat().st_size for f in Path(job.target.path).glob("*.safetensors"))
    return stored * job.target.dtype.itemsize // 2 // job.target.tp_size


def check_memory(job: Job, layout: list[dict], rank: int, available: int | None = None) -> None:
    """Refuse a drafter shape the memory this rank shares cannot hold. layout: every rank's {"rank", "role",
    "host", "gpu"} (launcher/run_io/provenance.py this_rank); available: bytes (None: this device's)."""
    me = next(r for r in layout if r["rank"] == rank)
    on_gpu = job.device.type == "cuda"
    sharing = [r for r in layout if r["host"] == me["host"] and (not on_gpu or r["gpu"] == me["gpu"])]
    drafters = sum(r["role"] == "drafter" for r in sharing)
    available = available_memory(job.device) if drafters and available is None else available
    if not drafters or available is None:
        return
    targets = sum(r["role"] == "target" for r in sharing)
    held = targets * target_bytes(job)

    def need(shape: Shape) -> int:
        return drafters * estimate(job, shape).total + held

    shape = Shape(job.train.micro_batch_size, job.step.num_anchors, job.drafter.block_size)
    where = (f"{drafters} drafter(s) and {targets} target(s) on this {'GPU' if on_gpu else 'host'} need "
             f"{need(shape) / GIB:.2f} GiB (the targets' weights {held / GIB:.2f}) of its {available / GIB:.2f} GiB "
             f"{'free' if on_gpu else 'of available RAM'}")
    if need(shape) <= available:
        log.info("memory: a drafter step needs %s; %s", estimate(job, shape).describe(), where)
        return
    fits = []
    for key, field, floor in _SMALLER:
        smaller = shape
        while getattr(smaller, field) > floor and need(smaller) > available:
            smaller = dataclasses.replace(smaller, **{field: max(floor, getattr(smaller, field) // 2)})
        if need(smaller) <= available:
            fits.append(f"{key}={getattr(smaller, field)} ({estimate(job, smaller).total / GIB:.2f} GiB a drafter)")
    remedy = ("settings that fit, each alone: " + ", or ".join(fits) if fits else
              f"no smaller anchors, micro-batch or block fits (the weights and frozen head alone need "
              f"{estimate(job, Shape(1, 1, 2)).weights / GIB:.2f} GiB a drafter): fewer drafter ranks on this "
              f"{'GPU' if on_gpu else 'host'}, or more memory")
    rows = (f"data.fixed_length={job.data.fixed_length}" if job.data.fixed_length else
            f"data.max_length={job.data.max_length}, the longest a row may be; data.max_length or data.fixed_length "
            f"at your data's longest estimates for that")
    raise ConfigError(f"drafter.num_anchors={shape.num_anchors} drafter.block_size={shape.block_size} "
                      f"train.micro_batch_size={shape.rows}: a drafter step at this shape, over rows of "
                      f"{longest_row(job)} tokens ({rows}), needs about {estimate(job, shape).describe()}; {where}: "
                      f"it would be killed for memory; {remedy}")
