"""Rank -> role mapping and the process groups every rank creates in the same order."""
from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from launcher.config import ConfigError

_PATTERN = re.compile(r"^t(\d+)d(\d+)$")


@dataclass(frozen=True)
class Topology:
    """Ranks [0, T) are targets (U units of tp_size ranks), ranks [T, T + D) are drafters."""
    num_targets: int
    num_drafters: int
    tp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.num_targets + self.num_drafters

    @property
    def spec(self) -> str:
        """The `topology=` value naming this split (tp_size is configured apart)."""
        return f"t{self.num_targets}d{self.num_drafters}"

    @property
    def num_units(self) -> int:
        return self.num_targets // self.tp_size

    def role(self, rank: int) -> str:
        return "target" if rank < self.num_targets else "drafter"

    def unit_of(self, rank: int) -> int:
        return rank // self.tp_size

    def unit_leader(self, unit: int) -> int:
        return unit * self.tp_size

    def drafter_rank(self, drafter: int) -> int:
        return self.num_targets + drafter

    def drafter_index(self, rank: int) -> int:
        return rank - self.num_targets

    @property
    def lead_drafter(self) -> int:
        return self.num_targets


def parse_topology(spec: str, world_size: int | None, tp_size: int = 1) -> Topology:
    """`t<T>d<D>` or `auto`; a spec that does not fit the world is an error before anything loads.
    world_size None: the spec's own (the bench's launches on fewer GPUs than ranks)."""
    spec = str(spec)
    if spec == "auto":
        if world_size is None or world_size < 2:
            raise ConfigError(f"topology=auto needs WORLD_SIZE >= 2 (one target, one drafter), got {world_size}")
        topo = Topology(tp_size, world_size - tp_size, tp_size)
    else:
        match = _PATTERN.match(spec)
        if not match:
            raise ConfigError(f"topology={spec!r}: expected t<T>d<D> (e.g. t1d2, t5d3) or auto")
        topo = Topology(int(match[1]), int(match[2]), tp_size)
        if topo.num_targets < 1 or topo.num_drafters < 1:
            raise ConfigError(f"topology={spec}: needs at least one target and one drafter rank")
        if world_size is not None and topo.world_size != world_size:
            raise ConfigError(
                f"topology={spec} needs {topo.world_size} processes ({topo.num_targets} target + "
                f"{topo.num_drafters} drafter) but WORLD_SIZE={world_size}: run torchrun with "
                f"--nproc-per-node/--nnodes giving {topo.world_size} ranks, or pick a topology that fits")
    if topo.num_drafters < 1:
        raise ConfigError(f"topology={spec} with tp_size={tp_size} leaves no drafter rank in WORLD_SIZE={world_size}")
    if tp_size < 1 or topo.num_targets % tp_size:
        raise ConfigError(f"target.tp_size={tp_size} must divide the {topo.num_targets} target ranks of "
                          f"topology={spec}")
    return topo


@dataclass
class Groups:
    control: dist.ProcessGroup          # gloo over the world: objects, config hash, summaries
    targets: dist.ProcessGroup
    drafters: dist.ProcessGroup
    unit: dist.ProcessGroup | None      # this rank's tensor-parallel target unit (None on drafters)
    # gloo over the drafter ranks, for the checkpoints' writes alone: they run in a background thread,
    # and collectives of two threads on one group could interleave in another order on each rank.
    checkpoints: dist.ProcessGroup


def build_groups(topo: Topology, rank: int, timeout_s: float) -> Groups:
    """Every rank calls new_group for every group, in this one order, as torch.distributed requires.
    (Start-up waits, bounded by run.startup_timeout_s, go through launcher/distributed/heartbeat.py.)"""
    timeout = timedelta(seconds=timeout_s)
    control = dist.new_group(backend="gloo", timeout=timeout)
    targets = dist.new_group(list(range(topo.num_targets)), timeout=timeout)
    drafter_ranks = list(range(topo.num_targets, topo.world_size))
    drafters = dist.new_group(drafter_ranks, timeout=timeout)
    checkpoints = dist.new_group(drafter_ranks, timeout=timeout, backend="gloo")
    unit = None
    for u in range(topo.num_units):
        ranks = list(range(topo.unit_leader(u), topo.unit_leader(u) + topo.tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            unit = group
    return Groups(control, targets, drafters, unit, checkpoints)
