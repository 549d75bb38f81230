"""Target role: data -> frozen target forward -> captured layers -> send to the scheduled drafter."""
from __future__ import annotations

import logging
import random
import time

import torch

from dflash_core.data import MicroBatchSource, load_tokenizer
from dflash_core.target.capture import CapturingTarget, load_target, random_target
from launcher.config import ConfigError
from launcher.context import Context
from launcher.dataset import data_report, load_run_samples
from launcher.distributed.channel import HIDDEN_DTYPE, Sender
from launcher.distributed.schedule import TRAIN
from launcher.job import Job
from launcher.roles.fault import maybe_fail
from launcher.run_io.rundir import SeqLog
from launcher.run_io.summary import TargetStats

log = logging.getLogger("dflash")


def build_sources(job: Job, progress=None) -> tuple[MicroBatchSource, MicroBatchSource | None, dict]:
    """The train and held-out micro-batch sources every target unit serves (identical on every rank).
    progress(done, total) is called while records are tokenised (not when the stores are prepared)."""
    data, seed = job.data, job.run.seed
    tokenizer = load_tokenizer(job.tokenizer_dir)
    samples, stats = load_run_samples(job.data_sources(), data, tokenizer, progress)
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    num_eval = 0
    if job.schedule.eval_batches > 0:
        num_eval = max(1, round(len(samples) * data.eval_fraction))
    if num_eval >= len(samples):
        raise ConfigError(f"data.eval_fraction={data.eval_fraction} leaves no training sample "
                          f"out of {len(samples)}")
    held_out, train = samples.subset(order[:num_eval]), samples.subset(order[num_eval:])
    stats.update(train_samples=len(train), eval_samples=len(held_out))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def source(subset, packing):
        return MicroBatchSource(subset, micro_batch_size=job.train.micro_batch_size, seed=seed,
                                pad_token_id=pad_id, length_multiple=data.length_multiple,
                                fixed_length=data.fixed_length, packing=packing)
    # Held-out evaluation stays per conversation (unpacked), so its tau is comparable across settings.
    return source(train, job.packing), (source(held_out, False) if held_out else None), stats


def _tokenising_note(ctx: Context):
    """Tokenising progress into this rank's heartbeat: peers wait past run.startup_timeout_s while it moves."""
    def note(done: int, total: int | None) -> None:
        ctx.progress.note(f"tokenised {done}" + (f" of {total}" if total else "") + " records")
    return note


def load_capturing_target(ctx: Context) -> CapturingTarget:
    plan, compiled, started = ctx.job.target, ctx.job.compile.target_compiled, time.perf_counter()
    # Tensor mode loads on CPU first: shard_target moves only this rank's slices to the device.
    load_device = "cpu" if plan.parallel == "tensor" else ctx.device
    if plan.random_weights:
        target = random_target(plan.hf_config, layer_ids=plan.layer_ids, device=load_device, dtype=plan.dtype,
                               seed=ctx.job.run.seed, attn_implementation=plan.attention, compiled=compiled)
    else:
        target = load_target(plan.path, layer_ids=plan.layer_ids, device=load_device, dtype=plan.dtype,
                             attn_implementation=plan.attention, compiled=compiled)
    if plan.parallel == "tensor":
        from launcher.distributed.tensor_parallel import shard_target
        shard_target(target, ctx.groups.unit, ctx.device)
    log.info("target loaded in %.1fs: layers %s captured, width %d", time.perf_counter() - started, plan.layer_ids,
             plan.feature_width)
    if compiled:
        _warm_up(ctx, target)
    return target


def _warm_up(ctx: Context, target: CapturingTarget) -> None:
    """Compile the capture for the run's static rows before the stream starts (under the start-up
    timeout, like the drafters): packed training rows carry a block-diagonal mask, unpacked rows none."""
    started = time.perf_counter()
    rows, length = ctx.job.train.micro_batch_size, ctx.job.data.fixed_length
    ids = torch.zeros(rows, length, dtype=torch.long, device=ctx.device)
    # Inputs of the stream's own kinds, strides included (compiled code guards on them): two
    # documents per packed training row, a contiguous [rows, length] tensor like the channel's.
    half = (torch.arange(length, device=ctx.device) % max(1, length // 2)).repeat(rows, 1)
    for positions in ([None, half] if ctx.job.packing else [None]):
        target.capture(ids, position_ids=positions)
    log.info("target warm-up compiled the capture for [%d, %d] in %.1fs", rows, length, time.perf_counter() - started)


def _sync(device: torch.device) -> None:
    # Only the compute stream: a full device sync would also wait for sends in flight.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_target(ctx: Context) -> TargetStats:
    job, topo = ctx.job, ctx.topo
    unit = topo.unit_of(ctx.rank)
    is_leader = ctx.rank == topo.unit_leader(unit)
    # Rank 0 tokenises first so the other target ranks read its cache instead of racing to write it.
    ctx.progress.stage("tokenising")
    if ctx.rank != 0:
        ctx.progress.wait_for("data_cached", [0])
    train_source, eval_source, data_stats = build_sources(job, progress=_tokenising_note(ctx))
    if ctx.rank == 0:
        ctx.progress.arrive("data_cached")
    log.info("data: %s", data_stats)
    if ctx.rank == 0:   # once per job (on the console when something was dropped or truncated)
        level, line = data_report(data_stats, job.data)
        log.log(level, "data: %s", line)
    ctx.progress.stage("loading_target")
    target = load_capturing_target(ctx)

    # Drafters may still be compiling: wait for them here, under the long start-up timeout,
    # rather than in a send bounded by run.timeout_s.
    ctx.progress.meet("stream")
    ctx.progress.stage("streaming")
    sender = Sender(ctx.comm_device, job.channel.max_in_flight)
    width = job.target.feature_width
    forward_s = data_s = 0.0
    tokens = slots = items = 0
    seq_log = SeqLog(ctx.run_dir, ctx.rank)
    started = time.perf_counter()
    for item in job.schedule.items_for_unit(unit, ctx.start_step):
        maybe_fail(job.fault, ctx.rank, item.step)
        t0 = time.perf_counter()
        batch = (train_source if item.kind == TRAIN else eval_source).batch(item.index)
        dst = topo.drafter_rank(item.drafter)
        if is_leader:
            sender.announce(dst, item, batch.input_ids, width, HIDDEN_DTYPE, batch.num_tokens)
        t1 = time.perf_counter()
        positions = batch.position_ids.to(ctx.device) if job.packing and item.kind == TRAIN else None
        hidden = target.capture(batch.input_ids.to(ctx.device), position_ids=positions).to(HIDDEN_DTYPE)
        _sync(ctx.device)
        t2 = time.perf_counter()
        if is_leader:
            sender.send(dst, item, batch.input_ids, batch.loss_mask, batch.position_ids, hidden)
            seq_log.write("sent", item)
        data_s += t1 - t0
        forward_s += t2 - t1
        tokens += batch.num_tokens
        slots += batch.input_ids.numel()
        items += 1
    if is_leader:
        sender.close([topo.drafter_rank(d) for d in range(topo.num_drafters)])
    seq_log.close()
    wall = time.perf_counter() - started
    return TargetStats(items=items, tokens=tokens, token_slots=slots, wall_s=wall, forward_s=forward_s, data_s=data_s,
                       send_wait_s=sender.wait_s, bytes_sent=sender.bytes_sent, data=data_stats,
                       tokens_per_s=tokens / wall if wall > 0 else 0.0)
