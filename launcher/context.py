"""What a role needs to know about its process: config, place in the topology, groups, run dir."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from launcher.isolation import Isolation
from launcher.schedule import Schedule
from launcher.topology import Groups, Topology


@dataclass
class Context:
    cfg: DictConfig
    topo: Topology
    rank: int
    groups: Groups
    device: torch.device        # where this rank computes
    comm_device: torch.device   # where channel tensors live (the GPU for NCCL, CPU for gloo)
    run_dir: Path
    schedule: Schedule
    start_step: int             # first optimiser step this run executes
    resume_from: Path | None    # checkpoint it restores, if any
    isolation: Isolation

    @property
    def tag(self) -> str:
        return f"{self.topo.role(self.rank)}{self.rank}"


def schedule_from(cfg: DictConfig, topo: Topology) -> Schedule:
    evaluates = cfg.data.eval_fraction > 0 and cfg.train.eval_batches > 0
    return Schedule(steps=cfg.train.steps, num_units=topo.num_units, num_drafters=topo.num_drafters,
                    grad_accum=cfg.train.grad_accum, eval_every=cfg.train.eval_every,
                    eval_batches=cfg.train.eval_batches if evaluates else 0)
