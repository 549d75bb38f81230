"""Crash safety on CPU: exact resume, torchrun restarts after a SIGKILL, fast failure propagation."""
import time

import pytest
import torch

from tests.launching import seq_lines, tiny_overrides, torchrun

pytestmark = pytest.mark.multiproc
STEPS = 6


def _final_weights(run_dir):
    return torch.load(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "state.pt", weights_only=False)["model"]


def test_killed_then_relaunched_run_matches_straight_run_bitwise(tmp_path, tiny_target_dir):
    # fixed_length: the drafters also run their pre-stream warm-up, which must not disturb any state.
    common = ["topology=t1d2", f"train.steps={STEPS}", "run.checkpoint_every=3", "train.eval_every=0",
              "data.fixed_length=192", *tiny_overrides(tmp_path, tiny_target_dir)]
    straight = tmp_path / "straight"
    assert torchrun(3, *common, f"run.dir={straight}").returncode == 0

    resumed = tmp_path / "resumed"
    crashed = torchrun(3, *common, f"run.dir={resumed}", "fault.rank=1", "fault.step=4")
    assert crashed.returncode != 0
    assert sorted(p.name for p in (resumed / "checkpoints").glob("step_*")) == ["step_00000003"]
    relaunched = torchrun(3, *common, f"run.dir={resumed}")
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert "resuming at step 3" in relaunched.stderr and "warm-up compiled the step for [4, 192]" in relaunched.stderr

    a, b = _final_weights(straight), _final_weights(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_sigkilled_drafter_recovers_under_max_restarts(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    proc = torchrun(3, "topology=t1d2", "train.steps=8", "run.checkpoint_every=2", "train.eval_every=0",
                    f"run.dir={run_dir}", "fault.rank=2", "fault.step=5", *tiny_overrides(tmp_path, tiny_target_dir),
                    torchrun_args=["--max-restarts=1"], env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_00000008").is_dir()
    # The restarted attempt resumed from the step-4 checkpoint and trained every later item exactly once.
    retrained = sorted(line["seq"] for line in seq_lines(run_dir, "trained") if line["attempt"] == 1)
    sent_after = sorted(line["seq"] for line in seq_lines(run_dir, "sent") if line["attempt"] == 1 and line["kind"] == 0)
    assert retrained == sent_after == list(range(4 * 2, 8 * 2))


@pytest.mark.parametrize("rank,role", [(0, "target"), (2, "drafter")])
def test_raising_rank_ends_the_job_quickly_and_is_named(tmp_path, tiny_target_dir, rank, role):
    start = time.monotonic()
    proc = torchrun(3, "topology=t1d2", "train.steps=50", f"run.dir={tmp_path / 'run'}", f"fault.rank={rank}",
                    "fault.step=3", "fault.kind=raise", *tiny_overrides(tmp_path, tiny_target_dir), timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    assert f"[{role}{rank}] ERROR failed: InjectedFault: fault injected on rank {rank} at step 3" in proc.stderr
