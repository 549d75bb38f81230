"""Target role: data -> frozen target forward -> captured layers -> send to the scheduled drafter."""
from __future__ import annotations

import logging
import time

import torch

from transformers import AutoConfig

from dflash_core.target import load_target, random_target
from launcher.channel import HIDDEN_DTYPE, Sender
from launcher.context import Context
from launcher.fault import maybe_fail
from launcher.data_setup import build_sources
from launcher.rundir import SeqLog
from launcher.schedule import TRAIN
from launcher.setup_models import compute_dtype, drafter_config, target_dir

log = logging.getLogger("dflash")


def _sync(device: torch.device) -> None:
    # Only the compute stream: a full device sync would also wait for sends in flight.
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def run_target(ctx: Context) -> dict:
    cfg, topo = ctx.cfg, ctx.topo
    unit = topo.unit_of(ctx.rank)
    is_leader = ctx.rank == topo.unit_leader(unit)
    layer_ids = drafter_config(cfg).target_layer_ids
    # Rank 0 tokenises first so the other target ranks read its cache instead of racing to write it.
    if ctx.rank != 0:
        torch.distributed.barrier(group=ctx.groups.targets)
    train_source, eval_source, data_stats = build_sources(cfg)
    if ctx.rank == 0:
        torch.distributed.barrier(group=ctx.groups.targets)
    log.info("data: %s", data_stats)

    start = time.perf_counter()
    tensor_parallel = cfg.target.parallel == "tensor"
    # Tensor mode loads on CPU first: shard_target moves only this rank's slices to the device.
    dtype = compute_dtype(cfg.target.dtype, ctx.device)
    load_device = "cpu" if tensor_parallel else ctx.device
    if cfg.target.random_weights:
        target = random_target(AutoConfig.from_pretrained(target_dir(cfg)), layer_ids=layer_ids, device=load_device,
                               dtype=dtype, seed=cfg.run.seed)
    else:
        target = load_target(target_dir(cfg), layer_ids=layer_ids, device=load_device, dtype=dtype)
    if tensor_parallel:
        from launcher.tensor_parallel import shard_target
        shard_target(target, ctx.groups.unit, ctx.device)
    log.info("target loaded in %.1fs: layers %s captured, width %d", time.perf_counter() - start, layer_ids,
             target.hidden_size * len(layer_ids))

    # Drafters may still be compiling: wait for them here, under the long start-up timeout,
    # rather than in a send bounded by run.timeout_s.
    torch.distributed.barrier(group=ctx.groups.startup)
    sender = Sender(ctx.comm_device, cfg.channel.max_in_flight)
    width = target.hidden_size * len(layer_ids)
    forward_s = data_s = 0.0
    tokens = items = 0
    seq_log = SeqLog(ctx.run_dir, ctx.rank)
    started = time.perf_counter()
    for item in ctx.schedule.items_for_unit(unit, ctx.start_step):
        maybe_fail(cfg.fault, ctx.rank, item.step)
        t0 = time.perf_counter()
        batch = (train_source if item.kind == TRAIN else eval_source).batch(item.index)
        num_tokens = int((batch.input_ids != train_source.pad_token_id).sum())
        dst = topo.drafter_rank(item.drafter)
        if is_leader:
            sender.announce(dst, item, batch.input_ids, width, HIDDEN_DTYPE, num_tokens)
        t1 = time.perf_counter()
        hidden = target.capture(batch.input_ids.to(ctx.device)).to(HIDDEN_DTYPE)
        _sync(ctx.device)
        t2 = time.perf_counter()
        if is_leader:
            sender.send(dst, item, batch.input_ids, batch.loss_mask, hidden)
            seq_log.write("sent", item)
        data_s += t1 - t0
        forward_s += t2 - t1
        tokens += num_tokens
        items += 1
    if is_leader:
        sender.close([topo.drafter_rank(d) for d in range(topo.num_drafters)])
    seq_log.close()
    wall = time.perf_counter() - started
    return {"items": items, "tokens": tokens, "wall_s": wall, "forward_s": forward_s, "data_s": data_s,
            "send_wait_s": sender.wait_s, "bytes_sent": sender.bytes_sent, "data": data_stats,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0}
