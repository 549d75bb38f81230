"""Compose the run config from conf/ with hydra's compose API, identically on every rank."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(os.environ.get("DFLASH_CONF_DIR", Path(__file__).resolve().parent.parent / "conf"))


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the value."""


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    # compose() rather than @hydra.main: no per-rank output dirs, no chdir, no ${now:} per rank.
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="dflash"):
        cfg = compose(config_name=config_name, overrides=overrides)
    OmegaConf.resolve(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


def config_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)


def config_hash(cfg: DictConfig) -> str:
    return hashlib.sha256(config_yaml(cfg).encode()).hexdigest()[:16]


def require(cfg: DictConfig, ok: bool, key: str, why: str) -> None:
    """Raise a ConfigError naming `key` and its value unless `ok`."""
    if not ok:
        raise ConfigError(f"{key}={OmegaConf.select(cfg, key)!r}: {why}")


def resolve_device(setting: str, key: str, local_rank: int = 0):
    """`auto` | `cpu` | `cuda` -> a torch.device (this local rank's GPU, shared round-robin when
    there are fewer GPUs than ranks); `cuda` without a visible GPU is an error naming `key`."""
    import torch
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}={setting!r}: no CUDA device is visible")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def validate(cfg: DictConfig) -> None:
    """Checks that need no model: they run before any process group or weights exist."""
    def need(ok: bool, key: str, why: str) -> None:
        require(cfg, ok, key, why)

    need(cfg.train.steps >= 1, "train.steps", "must be >= 1")
    need(cfg.train.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    need(cfg.train.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    need(cfg.train.eval_every >= 0, "train.eval_every", "must be >= 0")
    need(cfg.drafter.block_size >= 2, "drafter.block_size", "must be >= 2 (slot 0 holds the anchor token)")
    need(cfg.drafter.num_anchors >= 1, "drafter.num_anchors", "must be >= 1")
    need(cfg.drafter.num_layers >= 1, "drafter.num_layers", "must be >= 1")
    need(cfg.drafter.loss in ("dflash", "dpace"), "drafter.loss", "must be dflash or dpace")
    need(cfg.drafter.backend in ("auto", "flex", "sdpa"), "drafter.backend", "must be auto, flex or sdpa")
    need(cfg.drafter.compile in ("auto", True, False), "drafter.compile", "must be auto, true or false")
    need(cfg.data.on_bad_line in ("fail", "skip"), "data.on_bad_line", "must be fail or skip")
    need(0.0 <= cfg.data.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
    need(cfg.data.max_length >= 4, "data.max_length", "must be >= 4")
    need(cfg.optim.schedule in ("cosine", "wsd", "constant"), "optim.schedule", "must be cosine, wsd or constant")
    need(cfg.channel.max_in_flight >= 1, "channel.max_in_flight", "must be >= 1")
    need(cfg.run.timeout_s > 0, "run.timeout_s", "must be > 0")
    need(cfg.run.device in ("auto", "cpu", "cuda"), "run.device", "must be auto, cpu or cuda")
    need(cfg.target.parallel in ("replicate", "tensor"), "target.parallel", "must be replicate or tensor")
    need(cfg.target.tp_size >= 1, "target.tp_size", "must be >= 1")
    need(cfg.target.parallel == "tensor" or cfg.target.tp_size == 1, "target.tp_size",
         "must be 1 with target.parallel=replicate (set target.parallel=tensor to shard the target)")
    need(cfg.fault.kind in ("kill", "raise"), "fault.kind", "must be kill or raise")
    need(cfg.run.warm_up in ("auto", True, False), "run.warm_up", "must be auto, true or false")
    need(cfg.run.warm_up is not True or cfg.data.fixed_length is not None, "run.warm_up",
         "true needs data.fixed_length (the one shape to compile for)")
