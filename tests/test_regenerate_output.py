"""`launcher.regenerate` never destroys data: output = input is refused, an existing output is
replaced only with regenerate.overwrite=true (issue 17)."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_core.target.tiny import BUNDLED_DATASET
from launcher.config import ConfigError, compose_config
from launcher.regeneration.parts import check_output

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _regenerate(tiny_target_dir, data, output, *overrides, limit=4, torchrun_env=True):
    """`python -m launcher.regenerate` on the tiny target, as one rank torchrun would start (without the
    agent's start-up cost), or with torchrun_env=False as a user starts it without torchrun."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if torchrun_env:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return subprocess.run([sys.executable, "-m", "launcher.regenerate", f"target.path={tiny_target_dir}",
                           f"regenerate.input={data}", f"regenerate.output={output}", f"regenerate.limit={limit}",
                           "regenerate.max_new_tokens=4", "regenerate.device=cpu", *overrides],
                          cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
                          check=False)


def test_output_equal_to_the_input_is_refused_and_the_dataset_kept(tmp_path, tiny_target_dir):
    """Issue 17: with output = input, 4 answers replaced a 60-record dataset."""
    data = tmp_path / "chats.jsonl"
    shutil.copy(BUNDLED_DATASET, data)
    before = data.read_bytes()
    proc = _regenerate(tiny_target_dir, data, tmp_path / "." / "chats.jsonl")
    assert proc.returncode == 1
    assert "is the input file" in proc.stderr and "choose another output" in proc.stderr
    assert data.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]


def test_regeneration_on_cpu_runs_the_target_in_bf16_by_default(tmp_path, tiny_target_dir):
    """target.dtype=auto: bf16 for regeneration on CPU (2.5x fp32's new tokens/s, issue 44); fp32 when asked."""
    proc = _regenerate(tiny_target_dir, BUNDLED_DATASET, tmp_path / "out.jsonl", limit=1)
    assert proc.returncode == 0 and "in torch.bfloat16 on cpu (target.dtype=auto)" in proc.stderr, proc.stderr[-3000:]
    proc = _regenerate(tiny_target_dir, BUNDLED_DATASET, tmp_path / "fp32.jsonl", "target.dtype=fp32", limit=1)
    assert proc.returncode == 0 and "in torch.float32 on cpu (target.dtype=fp32)" in proc.stderr, proc.stderr[-3000:]


def _cfg(tmp_path, output, *overrides):
    data = tmp_path / "chats.jsonl"
    if not data.exists():
        shutil.copy(BUNDLED_DATASET, data)
    return compose_config([f"regenerate.input={data}", f"regenerate.output={output}", *overrides],
                          config_name="regenerate")


def test_a_link_to_the_input_is_the_input(tmp_path):
    cfg = _cfg(tmp_path, tmp_path / "link.jsonl")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "chats.jsonl")
    with pytest.raises(ConfigError, match="is the input file"):
        check_output(cfg)
    os.link(tmp_path / "chats.jsonl", tmp_path / "hard.jsonl")
    with pytest.raises(ConfigError, match="is the input file"):
        check_output(_cfg(tmp_path, tmp_path / "hard.jsonl", "regenerate.overwrite=true"))


def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path):
    output = tmp_path / "answers.jsonl"
    check_output(_cfg(tmp_path, output))  # absent: fine
    output.write_text('{"id": 1}\n')
    with pytest.raises(ConfigError, match=r"answers.jsonl' already exists; set regenerate.overwrite=true"):
        check_output(_cfg(tmp_path, output))
    check_output(_cfg(tmp_path, output, "regenerate.overwrite=true"))
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        check_output(_cfg(tmp_path, tmp_path / "dir.jsonl", "regenerate.overwrite=true"))


def test_every_prompt_skipped_is_an_error_and_leaves_no_output(tmp_path, tiny_target_dir):
    """Issue 33: regenerate.max_prompt_length=2 exited 0 with an empty output file and one INFO line."""
    output = tmp_path / "answers.jsonl"
    proc = _regenerate(tiny_target_dir, BUNDLED_DATASET, output, "regenerate.max_prompt_length=2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "every prompt was skipped, none is left to answer (4 prompts read: 4 longer than " \
           "regenerate.max_prompt_length=2 tokens; records skipped: 1 with no turns (preformatted text)); " \
           "no output was written; raise regenerate.max_prompt_length" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []   # neither the output nor its .parts directory


def test_runs_as_one_process_without_torchrun(tmp_path, tiny_target_dir):
    """Issue 33: `python -m launcher.regenerate` outside torchrun said `environment variable RANK expected`."""
    output = tmp_path / "answers.jsonl"
    proc = _regenerate(tiny_target_dir, BUNDLED_DATASET, output, limit=2, torchrun_env=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 2 and all(r["conversations"][-1]["role"] == "assistant" for r in records)
