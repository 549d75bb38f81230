"""What a role knows about its process: the resolved job, its place in the topology, its groups,
where it writes, and where in the stream it starts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from launcher.distributed.heartbeat import Heartbeat
from launcher.distributed.isolation import Isolation
from launcher.distributed.topology import Groups
from launcher.job import Job


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
    progress: Heartbeat         # stages reported to the peers, meeting points, and the watch naming a stalled peer

    @property
    def topo(self):
        return self.job.topology

    @property
    def device(self) -> torch.device:
        return self.job.device

    @property
    def tag(self) -> str:
        return f"{self.topo.role(self.rank)}{self.rank}"
