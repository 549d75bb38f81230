"""Where a run starts (launcher/run_io/resume.py): checked resumes, one training history per run dir."""
import dataclasses

import pytest
import torch

from launcher.config import compose_config
from launcher.distributed.schedule import TRAIN
from launcher.distributed.topology import Topology
from launcher.resolve import resolve
from launcher.run_io import checkpoint, resume
from launcher.run_io.resume import Launch, ResumeError


@pytest.fixture
def make_job(tiny_target_dir, tmp_path):
    def make(*overrides, drafters=2):
        cfg = compose_config([f"target.path={tiny_target_dir}", f"data.cache_dir={tmp_path / 'tok'}", "train.steps=40",
                              *overrides])
        return resolve(cfg, Topology(1, drafters), torch.device("cpu"))
    return make


def _trained(job, run_dir, step):
    """What the drafters write after `step` steps (the state itself does not matter here)."""
    return checkpoint.save(run_dir / "checkpoints", step, [checkpoint.Piece.whole("model.w", torch.zeros(1))],
                           {"step": step}, keep=2, record=resume.record(job, step))


def _train_indices(job, start, stop):
    return [it.index for it in job.schedule.items(start) if it.kind == TRAIN and it.step < stop]


def test_another_drafter_count_goes_on_at_the_first_untrained_micro_batch_said_once(make_job, tmp_path, caplog):
    t1d2, t1d3 = make_job(drafters=2), make_job(drafters=3)
    _trained(t1d2, tmp_path, 20)
    assert _train_indices(t1d2, 0, 20) == list(range(40))
    # The failure: resumed as t1d3 at step 20 the stream went on at micro-batch 60 (3 per step), so
    # 40-59 were never trained. Now it goes on at 40, 3 per step.
    with caplog.at_level("WARNING", logger="dflash"):
        point = resume.choose(t1d3, tmp_path)
    assert (point.step, point.trained) == (20, 40)
    resumed = dataclasses.replace(t1d3, schedule=t1d3.schedule.resumed_at(point.step, point.trained))
    assert _train_indices(resumed, 20, 22) == list(range(40, 46))
    assert [it.drafter for it in resumed.schedule.items(20) if it.kind == TRAIN][:3] == [0, 1, 2]
    said = [r.getMessage() for r in caplog.records if "where the checkpoint trained at" in r.getMessage()]
    assert len(said) == 1, said
    assert ("at drafter ranks x train.grad_accum = 3 x 1 where the checkpoint trained at 2 x 1: the stream goes on at "
            "micro-batch 40, every micro-batch still trained once and in order, but each optimiser step now averages "
            "3 of them, not 2 (the learning-rate schedule still counts steps)") in said[0]
    assert "held-out evaluations cover 3 x train.eval_batches micro-batches, not 2 x" in said[0]
    # Its own checkpoints record where the stream is, so a second resume at yet another count goes on from there.
    _trained(resumed, tmp_path / "second", 30)
    assert resume.choose(make_job(drafters=1), tmp_path / "second").trained == 40 + 10 * 3


def test_same_micro_batches_per_step_resume_and_other_changes_are_warned(make_job, tmp_path, caplog):
    _trained(make_job(drafters=2), tmp_path, 20)
    # t1d1 with grad_accum 2 consumes micro-batches [2k, 2k + 2) at step k, exactly as t1d2 did.
    with caplog.at_level("WARNING", logger="dflash"):
        point = resume.choose(make_job("train.grad_accum=2", "optim.lr=0.001", drafters=1), tmp_path)
    assert (point.step, point.finished) == (20, None) and point.path.endswith("step_00000020")
    assert "optim.lr: checkpoint 0.0006, now 0.001" in caplog.text


def test_a_checkpoint_recording_a_setting_removed_since_resumes_naming_it(make_job, tmp_path, caplog):
    import json
    # Runs trained before drafter.cuda_graph was removed (issue 42) recorded it in meta.json's config.
    meta_file = _trained(make_job(), tmp_path, 20) / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["drafter.cuda_graph"] = False
    meta_file.write_text(json.dumps(meta))
    with caplog.at_level("WARNING", logger="dflash"):
        assert resume.choose(make_job(), tmp_path).step == 20
    assert "changed settings: drafter.cuda_graph: checkpoint False, now no such setting" in caplog.text


@pytest.mark.parametrize("override,named", [
    ("train.micro_batch_size=2", "train.micro_batch_size: checkpoint 4, now 2"),
    ("run.seed=1", "run.seed: checkpoint 0, now 1"),
])
def test_a_changed_data_order_is_refused(make_job, tmp_path, override, named):
    _trained(make_job(), tmp_path, 20)
    with pytest.raises(ResumeError, match=named + r".*would not continue its data order"):
        resume.choose(make_job(override), tmp_path)


def test_a_changed_drafter_shape_is_refused_naming_both_values(make_job, tmp_path):
    _trained(make_job(), tmp_path, 20)
    with pytest.raises(ResumeError, match=r"drafter.block_size: checkpoint 8, now 4"):
        resume.choose(make_job("drafter.block_size=4"), tmp_path)


def test_steps_at_or_below_the_checkpoint_finish_without_training(make_job, tmp_path):
    _trained(make_job(), tmp_path, 20)
    for steps in (20, 10):
        point = resume.choose(make_job(f"train.steps={steps}"), tmp_path)
        assert point.step == 20 and f"at step 20 and train.steps={steps}: nothing to train" in point.finished


def test_resume_never_over_existing_checkpoints_is_refused(make_job, tmp_path):
    # The issue: run.resume=never in a dir holding an older run's checkpoints mixed two histories.
    _trained(make_job(), tmp_path, 20)
    with pytest.raises(ResumeError, match=r"run.resume=never: .* already holds checkpoints \(step_00000020\); to "
                                          r"start fresh pick another run.dir, or move or delete .*checkpoints"):
        resume.choose(make_job("run.resume=never"), tmp_path)
    assert resume.choose(make_job("run.resume=never"), tmp_path / "fresh").step == 0


def test_resume_never_restarted_by_torchrun_continues_its_own_checkpoints(make_job, tmp_path):
    job = make_job("run.resume=never")
    assert resume.choose(job, tmp_path, Launch("job-1", 0)).step == 0
    _trained(job, tmp_path, 20)
    # --max-restarts relaunches the same command: the restart continues what its first attempt saved.
    assert resume.choose(job, tmp_path, Launch("job-1", 1)).step == 20
    with pytest.raises(ResumeError, match="run.resume=never"):   # another job with the same command
        resume.choose(job, tmp_path, Launch("job-2", 0))


def test_explicit_resume_starts_a_lineage_and_its_restart_continues_it(make_job, tmp_path):
    source = _trained(make_job(), tmp_path / "a", 20)
    job = make_job(f"run.resume={source}")
    assert resume.choose(job, tmp_path / "b").step == 20
    assert checkpoint.read_lineage(tmp_path / "b" / "checkpoints")["parent"] == str(source)
    _trained(job, tmp_path / "b", 30)
    # A torchrun restart of that job (same overrides) continues its own step 30, not the source again.
    assert resume.choose(job, tmp_path / "b").step == 30
    # Resuming another checkpoint into a dir holding this history would mix them.
    other = _trained(make_job(), tmp_path / "c", 25)
    with pytest.raises(ResumeError, match=r"already holds the checkpoints of another training history "
                                          r"\(latest step_00000030\)"):
        resume.choose(make_job(f"run.resume={other}"), tmp_path / "b")


def test_checkpoints_that_all_fail_to_load_are_not_silently_restarted(make_job, tmp_path):
    bad = _trained(make_job(), tmp_path, 20)
    (bad / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ResumeError, match="holds checkpoints but none of them loads"):
        resume.choose(make_job(), tmp_path)


def test_a_dataset_replaced_under_the_same_path_is_refused_naming_it(make_job, tmp_path):
    import json
    import re
    data = tmp_path / "chats.jsonl"

    def write(answer):
        data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": answer}]}) + "\n")
    write("hello there")
    _trained(make_job(f"data.paths=[{data}]"), tmp_path, 20)
    write("hello there")          # rewritten, same bytes: the same data, resumed
    assert resume.choose(make_job(f"data.paths=[{data}]"), tmp_path).step == 20
    write("hello where")          # same size, other bytes
    with pytest.raises(ResumeError, match=re.escape(f"the content of {data} changed since the checkpoint")):
        resume.choose(make_job(f"data.paths=[{data}]"), tmp_path)
