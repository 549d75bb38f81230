"""Real multi-process torchrun jobs on CPU (gloo): the whole launcher end to end."""
import json
from collections import Counter
from pathlib import Path

import pytest

from launcher.config.schema import RunSettings
from tests.launching import seq_lines, tiny_overrides, torchrun

pytestmark = pytest.mark.multiproc


def _seqs(run_dir: Path, verb: str) -> list[int]:
    return [line["seq"] for line in seq_lines(run_dir, verb)]


def test_t1d2_end_to_end(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    proc = torchrun(3, "topology=t1d2", f"run.dir={run_dir}", "train.steps=8", "train.eval_every=4", "run.log_every=2",
                    *tiny_overrides(tmp_path, tiny_target_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for name in ("config.yaml", "provenance.json", "metrics.jsonl", "summary.json", "logs/target0.log",
                 "logs/drafter1.log", "logs/drafter2.log", "checkpoints/latest", "export/config.json",
                 "export/model.safetensors"):
        assert (run_dir / name).exists(), name
    # Each drafter wrote its own shard of the checkpoint (DCP's __<rank>_0.distcp), the lead the rest.
    checkpoint = run_dir / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json",
                                                            "trainer.json"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = set()
    for events in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
        tags |= set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert {"train/loss", "train/tau", "train/lr", "train/tokens_per_s", "train/idle_fraction", "train/acc_k/slot1",
            "eval/tau", "summary/target_idle_fraction", "summary/drafter_idle_fraction",
            "summary/target0_tokens_per_s"} <= tags, tags
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    provenance = json.loads((run_dir / "provenance.json").read_text())
    assert provenance["overrides"][0] == "topology=t1d2" and "launcher.train" in provenance["command"]
    assert provenance["code"]["git_commit"] and provenance["versions"]["torch"]
    assert [r["role"] for r in provenance["ranks"]] == ["target", "drafter", "drafter"]
    card = (run_dir / "export" / "README.md").read_text()
    assert "held-out tau" in card.lower() and provenance["code"]["git_commit"][:7] in card

    # Every micro-batch a target produced was consumed exactly once, in order, by its scheduled drafter.
    sent = _seqs(run_dir, "sent")
    consumed = _seqs(run_dir, "trained") + _seqs(run_dir, "evaluated")
    assert len(sent) == len(set(sent)) and Counter(consumed) == Counter(sent)
    assert sorted(sent) == list(range(8 * 2 + 2 * 2 * 2))   # 8 steps x 2 drafters + 2 evals x 2 drafters x 2

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["tokens"] > 0
    assert summary["held_out"]["decode_tau"] >= 1 and "unary_decode_tau" not in summary["held_out"]   # a DFlash
    ranks = summary["ranks"]
    assert len({r["pid"] for r in ranks}) == 3 and len({r["cache_dir"] for r in ranks}) == 3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6, 8]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8] and all(r["loss"] > 0 and r["tau"] >= 1 for r in evals)


def test_topology_not_fitting_world_fails_fast_on_every_rank(tmp_path):
    # The hang this guards against is a rank waiting on a peer that already failed: the shortest such
    # wait is run.timeout_s. The job must end well inside it; a wall-clock bound tighter than that would
    # measure the host's load (two torch imports on two shared cores), not the launcher.
    shortest_wait_s = min(RunSettings.timeout_s, RunSettings.startup_timeout_s)
    proc = torchrun(2, "topology=t1d2", f"run.dir={tmp_path / 'run'}", timeout=shortest_wait_s / 2)
    assert proc.returncode != 0
    for rank in (0, 1):
        line = next(text for text in proc.stderr.splitlines() if f"[rank{rank}]" in text and "ERROR" in text)
        assert "topology=t1d2" in line and "WORLD_SIZE=2" in line, line
