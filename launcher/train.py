"""Train a DFlash drafter: `torchrun --nproc-per-node N -m launcher.train key=value ...` (one process
per GPU or CPU slot; `dflash-train` is the same command)."""
from __future__ import annotations

import logging
import os

USAGE = """\
Usage: torchrun --standalone --nproc-per-node N -m launcher.train [key=value ...]
       dflash-train [--nproc-per-node=N] [key=value ...]   (starts torchrun itself: N from topology=t<T>d<D>)
Examples:
  torchrun --standalone --nproc-per-node 3 -m launcher.train topology=t1d2            # the embedded default (CPU)
  torchrun --standalone --nproc-per-node 8 -m launcher.train recipe=qwen3_8b \\
      target.path=/models/Qwen3-8B data.paths='[/data/qwen3-8b-regen.jsonl]'   # a recipe: t3d5, lengths, steps
  python -m launcher.train --cfg job train.steps=5                                   # print the config"""


def run(overrides: list[str]) -> int:
    from launcher.config import compose_config
    from launcher.distributed.topology import parse_topology
    from launcher.resolve import check_combinations
    from launcher.run_io.rundir import setup_logging
    from launcher.startup import ProcessEnv

    setup_logging(f"rank{os.environ.get('RANK', 0)}", logging.WARNING)
    cfg = compose_config(overrides)
    env = ProcessEnv.from_environ()
    check_combinations(cfg)
    topo = parse_topology(cfg.topology, env.world, cfg.target.tp_size)
    setup_logging(f"{topo.role(env.rank)}{env.rank}", logging.WARNING)

    import torch.distributed as dist

    from launcher.run_io.metrics import MetricsSink
    from launcher.run_io.summary import RankStats
    from launcher.startup import start_process
    ctx = start_process(cfg, overrides, topo, env)
    sink = MetricsSink(ctx.run_dir, cfg, ctx.start_step) if env.rank == topo.lead_drafter else None
    if topo.role(env.rank) == "target":
        from launcher.roles.target import run_target
        work = run_target(ctx)
    else:
        from launcher.roles.drafter import run_drafter
        work = run_drafter(ctx, sink)
    stats = RankStats(rank=env.rank, role=topo.role(env.rank), pid=ctx.isolation.pid,
                      cache_dir=str(ctx.isolation.cache_dir), work=work)
    gathered = [None] * env.world
    dist.all_gather_object(gathered, stats, group=ctx.groups.control)
    if sink is not None:
        from launcher.run_io.summary import write_summary
        write_summary(ctx, gathered, sink)
        sink.close()
    # Said while every rank still waits here (and under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 still
    # hosts the store): this rank's silence from now on is its end, not a stall.
    ctx.progress.finish()
    dist.barrier(group=ctx.groups.control)
    dist.destroy_process_group()
    return 0


def main() -> None:
    import sys

    from launcher.cli import launch_under_torchrun, run_main
    flags = {"-h", "--help", "--cfg", "--info", "-m", "--multirun"}
    if "LOCAL_RANK" not in os.environ and not flags & set(sys.argv[1:]):
        launch_under_torchrun("launcher.train", sys.argv[1:])
    run_main(run, "config", USAGE)


if __name__ == "__main__":
    main()
