"""Entry point: `torchrun ... -m launcher.train key=value ...` (one process per GPU or CPU slot)."""
from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from launcher.config import compose_config, config_hash, config_yaml, resolve_device, validate
from launcher.rundir import default_run_dir, log, prepare_run_dir, setup_logging
from launcher.topology import parse_topology


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


PRE_GROUP_ERROR_GRACE_S = 8


def _process_group_exists() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def restart_count() -> int:
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def _backend_for(device, local_world: int) -> str:
    import torch
    # NCCL cannot put two ranks on one GPU: share GPUs over gloo (payloads travel through host memory).
    return "nccl" if device.type == "cuda" and torch.cuda.device_count() >= local_world else "gloo"


def _agree_on_run_dir(cfg, rank: int, control) -> Path:
    """Rank 0 decides and creates the run dir once; every rank gets the path or rank 0's error."""
    import torch.distributed as dist
    box = [None, None]
    if rank == 0:
        try:
            if cfg.run.dir is None and restart_count() > 0:
                raise OSError("run.dir=None: a restarted job must find its checkpoints; pass a fixed run.dir")
            box[0] = str(prepare_run_dir(cfg.run.dir or default_run_dir()))
        except OSError as exc:
            box[1] = str(exc)
    dist.broadcast_object_list(box, src=0, group=control)
    if box[1] is not None:
        raise OSError(box[1])
    # Ranks on other nodes may not share rank 0's filesystem: each makes the dir where it runs.
    return prepare_run_dir(box[0])


def _check_same_config(cfg, control) -> None:
    import torch.distributed as dist
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, config_hash(cfg), group=control)
    if len(set(hashes)) != 1:
        differing = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise RuntimeError(f"ranks {differing} composed a config different from rank 0's "
                           f"(hashes {hashes}): launch every rank with the same overrides and conf/")


def _resume_point(cfg, rank: int, lead: int, run_dir: Path, control) -> tuple[int, Path | None]:
    """The lead drafter picks the checkpoint to resume from; every rank starts its stream at its step."""
    import torch.distributed as dist
    from launcher import checkpoint
    box: list = [0, None, None]
    if rank == lead and cfg.run.resume != "never":
        try:
            if cfg.run.resume == "auto":
                found = checkpoint.load_latest(run_dir / "checkpoints")
                if found:
                    box[:2] = found[1], str(found[0])
            else:
                box[:2] = checkpoint.load(Path(cfg.run.resume))[0], str(cfg.run.resume)
        except (OSError, ValueError, RuntimeError) as exc:
            box[2] = f"run.resume={cfg.run.resume!r}: cannot load the checkpoint: {exc}"
    dist.broadcast_object_list(box, src=lead, group=control)
    if box[2]:
        raise ValueError(box[2])
    return box[0], (Path(box[1]) if box[1] else None)


def run(overrides: list[str]) -> int:
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    setup_logging(f"rank{rank}", logging.WARNING)
    cfg = compose_config(overrides)
    validate(cfg)
    topo = parse_topology(cfg.topology, world, cfg.target.get("tp_size", 1))
    role = topo.role(rank)
    tag = f"{role}{rank}"
    setup_logging(tag, logging.WARNING)

    import torch
    import torch.distributed as dist
    from launcher.context import Context, schedule_from
    from launcher.isolation import isolate
    from launcher.setup_models import ensure_embedded_target
    from launcher.topology import build_groups

    if world == local_world:
        # One host: gloo (the control plane, and the channel on CPU) must not pick an interface
        # by hostname lookup, which in some VMs resolves to an address the host cannot reach.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    device = resolve_device(cfg.run.device, "run.device", local_rank)
    backend = _backend_for(device, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.run.timeout_s),
                            device_id=device if backend == "nccl" else None)
    groups = build_groups(topo, rank, cfg.run.timeout_s, cfg.run.startup_timeout_s)
    run_dir = _agree_on_run_dir(cfg, rank, groups.control)
    lead = rank == topo.lead_drafter
    setup_logging(tag, logging.INFO if lead else logging.WARNING, run_dir / "logs" / f"{tag}.log")
    _check_same_config(cfg, groups.control)
    if rank == 0:
        (run_dir / "config.yaml").write_text(config_yaml(cfg))
    iso = isolate(role, rank, local_world, Path(cfg.isolation.cache_root or run_dir / "compile_cache"), device,
                  cfg.isolation.recompile_limit, cfg.isolation.compile_threads)
    log.info("pid %d role %s rank %d/%d device %s backend %s threads %d compile cache %s", iso.pid, role, rank,
             world, device, backend, iso.threads, iso.cache_dir)
    # One builder per node (nodes need not share a filesystem); the build is atomic and idempotent.
    if local_rank == 0:
        ensure_embedded_target(cfg, cfg.run.seed)
    dist.barrier(group=groups.startup)

    start_step, resume_from = _resume_point(cfg, rank, topo.lead_drafter, run_dir, groups.control)
    ctx = Context(cfg, topo, rank, groups, device, device if backend == "nccl" else torch.device("cpu"),
                  run_dir, schedule_from(cfg, topo), start_step, resume_from, iso)
    if resume_from:
        log.warning("resuming at step %d from %s", start_step, resume_from)
    started = time.perf_counter()
    if role == "target":
        from launcher.target_role import run_target
        stats = run_target(ctx)
    else:
        from launcher.drafter_role import run_drafter
        stats = run_drafter(ctx)
    stats.update(rank=rank, role=role, pid=iso.pid, cache_dir=str(iso.cache_dir), total_s=time.perf_counter() - started)
    gathered = [None] * world
    dist.all_gather_object(gathered, stats, group=groups.control)
    if lead:
        from launcher.summary import write_summary
        write_summary(ctx, gathered)
    dist.barrier(group=groups.control)
    dist.destroy_process_group()
    return 0


def main() -> None:
    try:
        code = run(sys.argv[1:])
    except BaseException as exc:  # every rank reports its own failure, then exits non-zero at once
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        log.error("failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, (ValueError, OSError)))
        logging.shutdown()
        sys.stderr.flush()
        if not _process_group_exists() and _env_int("WORLD_SIZE", 1) > 1:
            # A config error hits every rank, but torchrun kills the others as soon as one exits:
            # give slower ranks a moment to report it too.
            time.sleep(PRE_GROUP_ERROR_GRACE_S)
        # os._exit: a process group may still be alive, and its teardown can block.
        os._exit(1)
    logging.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
