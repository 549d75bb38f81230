"""Two torchrun agents on one host (--nnodes 2, c10d rendezvous on 127.0.0.1) behave like one agent."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from launcher.run_io import checkpoint
from tests.launching import REPO, tiny_overrides, torchrun

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node_rank: int, port: int, overrides: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node_rank}",
           "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twoagents",
           "-m", "launcher.train", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _weights(run_dir):
    return checkpoint.load_weights(run_dir / "checkpoints" / "step_00000006")[2]


def test_two_agents_match_one_agent(tmp_path, tiny_target_dir):
    common = ["topology=t2d2", "train.steps=6", "train.eval_every=0", "run.export=false",
              *tiny_overrides(tmp_path, tiny_target_dir)]
    port = _free_port()
    agents = [_agent(rank, port, [*common, f"run.dir={tmp_path / 'two'}"]) for rank in (0, 1)]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-3000:]
    single = torchrun(4, *common, f"run.dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]

    two, one = _weights(tmp_path / "two"), _weights(tmp_path / "one")
    assert two.keys() == one.keys()
    for key in one:
        assert torch.equal(two[key], one[key]), key
