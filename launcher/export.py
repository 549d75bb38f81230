"""`python -m launcher.export export.checkpoint=DIR [export.out=DIR] [export.overwrite=true]`: the HF
drafter directory of a checkpoint. It never replaces anything but a previous export, and that only
with export.overwrite=true."""
from __future__ import annotations

import shlex
from pathlib import Path

from dflash_core.drafter.dflash2 import build_drafter, config_from_fields
from dflash_core.serving.export import export_drafter
from dflash_core.serving.model_card import TARGET_IDENTITY, target_identity
from launcher.config import ConfigError, compose_config
from launcher.run_io import checkpoint

USAGE = """\
Usage: python -m launcher.export export.checkpoint=DIR [export.out=DIR] [export.overwrite=true]
Example:
  python -m launcher.export export.checkpoint=runs/qwen3-8b/checkpoints/step_00020000 export.out=/models/drafter"""


def drafter_from_checkpoint(path: Path):
    """(step, the drafter, DFlash or DFlash 2 as the checkpoint records it, with its weights)."""
    step, config, weights = checkpoint.load_weights(path)
    drafter = build_drafter(config_from_fields(config))
    drafter.load_state_dict(weights)
    return step, drafter


def export_checkpoint(path: Path, out: Path, *, overwrite: bool = False, card: dict | None = None) -> Path:
    step, drafter = drafter_from_checkpoint(path)
    card = {**run_facts(path), "steps": step, "checkpoint": str(Path(path).resolve()), **(card or {})}
    return export_drafter(drafter, out, overwrite=overwrite, card=card)


def run_facts(checkpoint_path: Path) -> dict:
    """The model card's facts that the checkpoint's run dir records: target (config.yaml, and the
    target's identity when its directory is found here) and data, and the versions this export is
    written with."""
    import torch
    import transformers
    from omegaconf import OmegaConf

    facts = {"provenance": {"torch (export)": torch.__version__, "transformers (export)": transformers.__version__}}
    config = Path(checkpoint_path).resolve().parent.parent / "config.yaml"
    if config.is_file():
        cfg = OmegaConf.load(config)
        facts["target"] = OmegaConf.select(cfg, "target.path")
        if facts["target"] and (Path(facts["target"]) / "config.json").is_file():
            facts[TARGET_IDENTITY] = target_identity(facts["target"])
        data = OmegaConf.select(cfg, "data.paths")
        facts["data"] = OmegaConf.to_container(data) if OmegaConf.is_config(data) else data
    return facts


def run(overrides: list[str]) -> int:
    cfg = compose_config(overrides, config_name="export")
    checkpoint_dir = Path(cfg.export.checkpoint)
    problem = checkpoint.why_incomplete(checkpoint_dir)
    if problem:
        raise ConfigError(f"export.checkpoint={str(checkpoint_dir)!r}: {problem}")
    out = Path(cfg.export.out) if cfg.export.out else checkpoint_dir.parent.parent / f"export_{checkpoint_dir.name}"
    command = shlex.join(["python", "-m", "launcher.export", *overrides])
    print(export_checkpoint(checkpoint_dir, out, overwrite=cfg.export.overwrite, card={"command": command}))
    return 0


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "export", USAGE)


if __name__ == "__main__":
    main()
