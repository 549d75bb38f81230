"""`python -m launcher.export <checkpoint dir> [--out DIR] [--overwrite]`: the HF drafter directory
from a checkpoint. It never replaces anything but a previous export, and that only with --overwrite."""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from dflash_core.export import export_drafter
from dflash_core.model import DFlashDrafter, DrafterConfig
from launcher.run_io import checkpoint


def export_checkpoint(path: Path, out: Path, *, overwrite: bool = False, card: dict | None = None) -> Path:
    step, state = checkpoint.load(path)
    drafter = DFlashDrafter(DrafterConfig(**state["drafter_config"]))
    drafter.load_state_dict(state["model"])
    card = {**run_facts(path), "steps": step, "checkpoint": str(Path(path).resolve()), **(card or {})}
    return export_drafter(drafter, out, overwrite=overwrite, card=card)


def run_facts(checkpoint_path: Path) -> dict:
    """The model card's facts that the checkpoint's run dir records: target and data (config.yaml),
    and the versions this export is written with."""
    import torch
    import transformers
    from omegaconf import OmegaConf

    facts = {"provenance": {"torch (export)": torch.__version__, "transformers (export)": transformers.__version__}}
    config = Path(checkpoint_path).resolve().parent.parent / "config.yaml"
    if config.is_file():
        cfg = OmegaConf.load(config)
        facts["target"] = OmegaConf.select(cfg, "target.path")
        data = OmegaConf.select(cfg, "data.paths")
        facts["data"] = OmegaConf.to_container(data) if OmegaConf.is_config(data) else data
    return facts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_XXXXXXXX directory of a run")
    parser.add_argument("--out", type=Path, help="output directory (default: <run dir>/export_step_XXXXXXXX)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --out if it holds a previous export (anything else there is never replaced)")
    args = parser.parse_args(argv)
    out = args.out or args.checkpoint.parent.parent / f"export_{args.checkpoint.name}"
    command = shlex.join(["python", "-m", "launcher.export", *(sys.argv[1:] if argv is None else argv)])
    try:
        print(export_checkpoint(args.checkpoint, out, overwrite=args.overwrite, card={"command": command}))
    except (ValueError, OSError) as exc:  # refused output, bad checkpoint, non-finite weights: the message says what
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
