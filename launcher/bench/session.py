"""Bench: what every row of one `python -m launcher.bench` run shares (the rows' modules take it)."""
from __future__ import annotations

import argparse
import dataclasses
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflash_core.target.shapes import SHAPES
from launcher.bench.inputs import run_overrides
from launcher.bench.report import Row
from launcher.bench.rows import measured

if TYPE_CHECKING:
    from launcher.distributed.topology import Topology


@dataclasses.dataclass
class Bench:
    """What every row of one run shares: the options, the device, the scratch dir, the bench target
    with the full rows' data, and the rows so far."""
    args: argparse.Namespace
    device: torch.device
    device_name: str
    num_gpus: int
    work: Path
    target_dir: Path
    data_path: Path
    data_info: dict | None
    rows: list[dict] = dataclasses.field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def processes(self) -> int:
        """Processes of the end-to-end runs: one per GPU, or two on the CPU."""
        return self.num_gpus if self.cuda else 2

    @property
    def shape_name(self) -> str:
        return "tiny" if self.args.tiny else self.args.shape

    @cached_property
    def e2e_topology(self) -> Topology:
        from launcher.distributed.topology import parse_topology

        spec, procs = self.args.e2e_topology, self.processes
        return parse_topology(spec or f"t1d{max(procs - 1, 1)}", None if spec and procs < 2 else max(procs, 2), 1)

    def overrides(self, data_path: Path, seq_len: int, steps: int, *more: str) -> list[str]:
        """The training overrides of the drafter-alone and end-to-end rows, so both train the same
        drafter: run_overrides, then `more`, then --set's (which win)."""
        args = self.args
        shared = run_overrides(target_dir=self.target_dir, data_path=data_path, seq_len=seq_len, steps=steps,
                               tiny=args.tiny, anchors=args.anchors, work=self.work,
                               mask_token_id=SHAPES[args.shape].mask_token_id or "auto")
        on_cpu = [] if self.cuda else ["run.device=cpu"]   # --tiny on a GPU stays on the CPU
        return shared + list(more) + on_cpu + list(args.overrides)

    def record(self, n: Row, name: str, measure, *args, skipped: str | None = None) -> dict | None:
        """Row n, measured by measure(*args) (see rows.measured), kept; None when skipped or failed."""
        row = measured(self.rows, n, name, measure, *args, skipped=skipped)
        if row:
            self.rows.append(row)
        return row
