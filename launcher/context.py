"""What a role knows about its process: the resolved job, its place in the topology, its groups,
where it writes, and where in the stream it starts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from launcher.distributed.heartbeat import StartupProgress
from launcher.distributed.isolation import Isolation
from launcher.distributed.topology import Groups
from launcher.resolve import Job


@dataclass
class Context:
    job: Job
    rank: int
    groups: Groups
    comm_device: torch.device   # where channel tensors live (the GPU for NCCL, CPU for gloo)
    run_dir: Path
    start_step: int             # first optimiser step this run executes
    resume_from: Path | None    # checkpoint it restores, if any
    isolation: Isolation
    provenance: dict            # command, code and library versions, hosts, rank layout
    progress: StartupProgress   # start-up stages reported to the peers, and meeting points that name a stalled one

    @property
    def cfg(self):
        return self.job.cfg

    @property
    def topo(self):
        return self.job.topology

    @property
    def device(self) -> torch.device:
        return self.job.device

    @property
    def tag(self) -> str:
        return f"{self.topo.role(self.rank)}{self.rank}"
