"""Answer a dataset's prompts with the target itself: `torchrun ... -m launcher.regenerate key=value ...`
(`python -m launcher.regenerate ...` without torchrun: one process).

Drafters trained on the target's own answers accept more of its tokens, so the usual recipe is
to regenerate the assistant turns of a chat set with the target before training. The engine
(regenerate.engine) answers: `hf`, the target here (dflash_core.target.decode's loop, or HF
`generate`), every rank a full target replica (launcher/regeneration/hf.py; it needs nothing but
the project), or a serving engine
(launcher/regeneration/served.py): `vllm`, servers started here, or `openai`, the servers of
regenerate.endpoints. Answers are written to part files as they finish, so a rerun with the
same settings answers only what is missing; the parts are merged in input order into the
output JSONL (temp file, then rename; launcher/regeneration/parts.py says the records' form).
One run writes an output at a time (`<output>.lock`; a second is refused naming the first).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig

from launcher.config import compose_config, require
from launcher.regeneration.parts import check_output, claim_output
from launcher.run_io.rundir import setup_logging

USAGE = """\
Usage: torchrun --standalone --nproc-per-node N -m launcher.regenerate regenerate.output=FILE [key=value ...]
       python -m launcher.regenerate regenerate.output=FILE [key=value ...]      # one process
       python -m launcher.regenerate regenerate.engine=vllm|openai regenerate.output=FILE [key=value ...]
Examples:
  torchrun --standalone --nproc-per-node 8 -m launcher.regenerate target=qwen3_8b target.path=/models/Qwen3-8B \\
      regenerate.input=/data/prompts.jsonl regenerate.output=/data/qwen3-8b-regen.jsonl
  python -m launcher.regenerate regenerate.engine=vllm target=qwen3_8b target.path=/models/Qwen3-8B \\
      regenerate.input=/data/prompts.jsonl regenerate.output=/data/qwen3-8b-regen.jsonl
  python -m launcher.regenerate regenerate.engine=openai 'regenerate.endpoints=[http://10.0.0.5:8000]' \\
      regenerate.tokenizer=/models/Qwen3-8B regenerate.input=/data/prompts.jsonl regenerate.output=/data/out.jsonl"""


def validate(cfg: DictConfig) -> None:
    r = cfg.regenerate
    require(cfg, Path(r.output).suffix == ".jsonl", "regenerate.output", "must be a .jsonl file")
    require(cfg, not r.endpoints or r.engine == "openai", "regenerate.endpoints",
            f"servers of the user are read with regenerate.engine=openai, not {r.engine}")


def run(overrides: list[str]) -> int:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    setup_logging(f"regen{rank}", logging.INFO if rank == 0 else logging.WARNING)
    cfg = compose_config(overrides, config_name="regenerate")
    validate(cfg)
    check_output(cfg)   # on every rank, before any work
    from launcher.cli import stop_on_signals
    # Every engine: SIGTERM too stops the servers, releases the output and says what is kept (parts.py).
    with stop_on_signals():
        if cfg.regenerate.engine == "hf":
            from launcher.regeneration.hf import run_hf
            return run_hf(cfg, rank, world)   # rank 0 claims the output once the ranks can hear its refusal
        from launcher.regeneration.served import run_served
        with claim_output(cfg):
            return run_served(cfg)


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "regenerate", USAGE)


if __name__ == "__main__":
    main()
