"""`python -m launcher.export <checkpoint dir> [--out DIR]`: the HF drafter directory from a checkpoint."""
from __future__ import annotations

import argparse
from pathlib import Path

from dflash_core.export import export_drafter
from dflash_core.model import DFlashDrafter, DrafterConfig
from launcher.run_io import checkpoint


def export_checkpoint(path: Path, out: Path) -> Path:
    _, state = checkpoint.load(path)
    drafter = DFlashDrafter(DrafterConfig(**state["drafter_config"]))
    drafter.load_state_dict(state["model"])
    export_drafter(drafter, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_XXXXXXXX directory of a run")
    parser.add_argument("--out", type=Path, help="output directory (default: <run dir>/export_step_XXXXXXXX)")
    args = parser.parse_args()
    out = args.out or args.checkpoint.parent.parent / f"export_{args.checkpoint.name}"
    print(export_checkpoint(args.checkpoint, out))


if __name__ == "__main__":
    main()
