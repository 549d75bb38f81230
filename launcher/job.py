"""The typed settings a process's roles receive: the `Job`, built once by launcher/resolve.py.

Roles read these and never the raw config: each section is the schema's own dataclass
(launcher/config/schema.py: the config keys are its field names), the derived plans are below.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash_core.drafter.model import DrafterConfig
from dflash_core.loss.settings import StepSettings
from dflash_core.target.families import text_config
from launcher.config.schema import (
    ChannelSettings,
    DataSettings,
    FaultSettings,
    OptimSettings,
    RunSettings,
    TrainSettings,
)
from launcher.distributed.schedule import Schedule
from launcher.distributed.topology import Topology


@dataclass(frozen=True)
class TargetPlan:
    path: Path
    hf_config: object            # the full target's Hugging Face config
    layer_ids: list[int]         # captured layers (HF numbering)
    dtype: torch.dtype           # compute dtype on this process's device
    parallel: str                # replicate | tensor
    tp_size: int
    random_weights: bool
    attention: str | None        # transformers attn_implementation (None: its default)

    @property
    def feature_width(self) -> int:
        return text_config(self.hf_config).hidden_size * len(self.layer_ids)


@dataclass(frozen=True)
class CompilePlan:
    compiled: bool                                # drafter layers and head loss through torch.compile
    warm_up_shape: tuple[int, int] | None         # (rows, length) compiled before the stream starts
    target_compiled: bool                         # the target's decoder layers through torch.compile


@dataclass(frozen=True)
class WarmStart:
    """drafter.init_from, checked against the configured drafter: the export the weights come from."""
    path: Path
    weights_sha256: str          # of its model.safetensors

    def record(self) -> dict:
        return {"path": str(self.path), "weights_sha256": self.weights_sha256}


@dataclass(frozen=True)
class Job:
    topology: Topology
    device: torch.device
    target: TargetPlan
    drafter: DrafterConfig
    step: StepSettings           # the drafter step's settings, handed whole to the objective
    compile: CompilePlan
    schedule: Schedule
    tokenizer_dir: Path
    packing: bool                # several whole conversations per fixed-length training row
    # data.paths resolved when called (each dataset source once, directories listed): only the ranks that
    # read the data call it, so a rank without the data mounted, or the bench before it writes them, need not.
    data_sources: Callable[[], list[Path]]
    run: RunSettings             # the config's sections, typed
    train: TrainSettings
    optim: OptimSettings
    data: DataSettings
    channel: ChannelSettings
    fault: FaultSettings
    cfg: DictConfig              # the whole composed config, only for what records it (checkpoints' meta.json)
    init_from: WarmStart | None = None   # the export the drafter's weights start from (none: random)
    start_from_target: bool = False      # drafter.init=target: its layers start as the target's last ones

    def start_record(self) -> dict | None:
        """Where the drafter's weights start, as provenance and the model card record it (None: random)."""
        if self.init_from is not None:
            return self.init_from.record()
        if self.start_from_target:
            from dflash_core.drafter.from_target import copied_layers
            return {"target_layers": copied_layers(self.drafter)}
        return None
