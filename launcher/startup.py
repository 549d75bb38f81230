"""Process start-up under torchrun: device, process groups, the run dir, isolation, the resolved job
and the resume point, in one fixed order on every rank (launcher.train runs it, then the rank's role)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launcher.cli import exit_failed
from launcher.config import config_hash, config_yaml
from launcher.context import Context
from launcher.distributed import flight_recorder
from launcher.distributed.heartbeat import Heartbeat, collective_timeout_s
from launcher.distributed.isolation import check_own_gpu, isolate, own_gpu
from launcher.distributed.topology import Topology, build_groups
from launcher.job import Job
from launcher.resolve import ensure_embedded_target, resolve, resolve_device
from launcher.roles.fault import maybe_fail_at_stage
from launcher.roles.memory import check_memory
from launcher.run_io.lock import RunLock
from launcher.run_io.provenance import provenance, this_rank, write_provenance
from launcher.run_io.resume import Launch, ResumeError, choose
from launcher.run_io.rundir import default_run_dir, prepare_run_dir, setup_logging

log = logging.getLogger("dflash")


@dataclass(frozen=True)
class ProcessEnv:
    """What torchrun tells a worker about its place."""
    rank: int
    world: int
    local_rank: int
    local_world: int
    restart: int     # torchrun's attempt number (TORCHELASTIC_RESTART_COUNT)

    @classmethod
    def from_environ(cls) -> "ProcessEnv":
        def get(name: str, default: int) -> int:
            return int(os.environ.get(name, default))
        return cls(get("RANK", 0), get("WORLD_SIZE", 1), get("LOCAL_RANK", 0), get("LOCAL_WORLD_SIZE", 1),
                   get("TORCHELASTIC_RESTART_COUNT", 0))


def _backend_for(device: torch.device, host_gpus: int, env: ProcessEnv) -> str:
    # NCCL cannot put two ranks on one GPU: share GPUs over gloo (payloads travel through host memory).
    return "nccl" if device.type == "cuda" and host_gpus >= env.local_world else "gloo"


def _agree_on_run_dir(cfg: DictConfig, env: ProcessEnv, control) -> Path:
    """Rank 0 decides and creates the run dir once and takes its lock (one job per run dir); every rank
    gets the path or rank 0's error."""
    box = [None, None]
    if env.rank == 0:
        try:
            if cfg.run.dir is None and env.restart > 0:
                raise OSError("run.dir=None: a restarted job must find its checkpoints; pass a fixed run.dir")
            box[0] = str(prepare_run_dir(cfg.run.dir or default_run_dir()))
            RunLock.acquire(Path(box[0]))
        except OSError as exc:
            box[1] = str(exc)
    dist.broadcast_object_list(box, src=0, group=control)
    if box[1] is not None:
        raise OSError(box[1])
    # Ranks on other nodes may not share rank 0's filesystem: each makes the dir where it runs.
    return prepare_run_dir(box[0])


def _check_same_config(cfg: DictConfig, control) -> None:
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, config_hash(cfg), group=control)
    if len(set(hashes)) != 1:
        differing = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise RuntimeError(f"ranks {differing} composed a config different from rank 0's "
                           f"(hashes {hashes}): launch every rank with the same overrides and conf/")


def _resume_point(job: Job, env: ProcessEnv, lead: int, run_dir: Path, control,
                  progress: Heartbeat) -> tuple[Job, int, Path | None]:
    """The lead drafter picks the checkpoint to resume from (launcher/run_io/resume.py); every rank starts
    its stream at its step and at the first micro-batch the checkpoint did not train (the job's schedule
    says which), or, when the checkpoint already reached train.steps, every rank exits 0."""
    box: list = [None, None]
    if env.rank == lead:
        try:
            box[0] = choose(job, run_dir, Launch(os.environ.get("TORCHELASTIC_RUN_ID", ""), env.restart))
        except ResumeError as exc:
            box[1] = str(exc)
        except (OSError, ValueError, RuntimeError) as exc:
            box[1] = f"run.resume={job.run.resume!r}: cannot load the checkpoint: {exc}"
    dist.broadcast_object_list(box, src=lead, group=control)
    if box[1]:
        raise ResumeError(box[1])
    point = box[0]
    if point.finished:
        log.log(logging.WARNING if env.rank == lead else logging.INFO, "%s", point.finished)
        progress.finish()
        dist.destroy_process_group()
        raise SystemExit(0)
    if not point.path:
        return job, 0, None
    job = replace(job, schedule=job.schedule.resumed_at(point.step, point.trained))
    return job, point.step, Path(point.path)


def _heartbeat(cfg: DictConfig, topo: Topology, env: ProcessEnv) -> Heartbeat:
    """This rank's heartbeat and stage reports (and the test-only fault.stage injection on entering a
    stage); a peer that stops beating ends this process, naming it, wherever this rank waits."""
    roles = [topo.role(r) for r in range(env.world)]
    fault = OmegaConf.to_object(cfg.fault)

    def on_stall(stalled: BaseException) -> None:
        flight_recorder.dump_now(env.rank)
        exit_failed(stalled)
    return Heartbeat.connect(env.rank, roles, cfg.run.timeout_s, cfg.run.startup_timeout_s,
                             on_stage=partial(maybe_fail_at_stage, fault, env.rank), on_stall=on_stall)


def start_process(cfg: DictConfig, overrides: list[str], topo: Topology, env: ProcessEnv) -> Context:
    role, tag = topo.role(env.rank), f"{topo.role(env.rank)}{env.rank}"
    if env.world == env.local_world:
        # One host: gloo (the control plane, and the channel on CPU) must not pick an interface
        # by hostname lookup, which in some VMs resolves to an address the host cannot reach.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    gpu, host_gpus = own_gpu(env.local_rank, cfg.run.device)
    device = resolve_device(cfg.run.device, "run.device")
    backend = _backend_for(device, host_gpus, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        check_own_gpu(gpu)
    timeout_s = collective_timeout_s(cfg.run.timeout_s)   # the heartbeat names a stopped peer first
    if backend == "nccl":
        flight_recorder.set_unless_given(flight_recorder.recording_env())
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s),
                            device_id=device if backend == "nccl" else None)
    groups = build_groups(topo, env.rank, timeout_s)
    progress = _heartbeat(cfg, topo, env)
    run_dir = _agree_on_run_dir(cfg, env, groups.control)
    if backend == "nccl":
        flight_recorder.dump_into(run_dir)
    lead = env.rank == topo.lead_drafter
    setup_logging(tag, logging.INFO if lead else logging.WARNING, run_dir / "logs" / f"{tag}.log")
    _check_same_config(cfg, groups.control)
    layout = [None] * env.world
    dist.all_gather_object(layout, this_rank(env.rank, role, device, gpu), group=groups.control)
    iso = isolate(role, env.rank, env.local_world, Path(cfg.isolation.cache_root or run_dir / "compile_cache"),
                  device, cfg.isolation.recompile_limit, cfg.isolation.compile_threads)
    log.info("pid %d role %s rank %d/%d device %s (host GPU %s) backend %s threads %d compile cache %s", iso.pid,
             role, env.rank, env.world, device, gpu, backend, iso.threads, iso.cache_dir)
    # One builder per node (nodes need not share a filesystem); the build is atomic and idempotent.
    if env.local_rank == 0:
        progress.stage("preparing_target")
        ensure_embedded_target(cfg, cfg.run.seed)
    progress.meet("target_ready")
    progress.stage("resolving")
    job = resolve(cfg, topo, device)
    check_memory(job, layout, env.rank)   # before anything loads: a shape too large is refused, not OOM-killed
    record = provenance(overrides, layout, job.start_record())
    job, start_step, resume_from = _resume_point(job, env, topo.lead_drafter, run_dir, groups.control, progress)
    if env.rank == 0:   # only once the run may go on: a refused resume leaves the run's own record as it was
        (run_dir / "config.yaml").write_text(config_yaml(cfg))
        write_provenance(run_dir, record)
    if resume_from:
        log.warning("resuming at step %d from %s", start_step, resume_from)
    return Context(job, env.rank, groups, device if backend == "nccl" else torch.device("cpu"), run_dir,
                   start_step, resume_from, iso, record, progress)
