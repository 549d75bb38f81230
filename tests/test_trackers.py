"""Trackers of the lead drafter on CPU, without network: TensorBoard, MLflow (local file store) and
Weights & Biases (offline mode) each write the records MetricsSink gives them."""
import json

import pytest

from launcher.config import compose_config
from launcher.run_io.metrics import MetricsSink


def _sink(tmp_path, trackers):
    cfg = compose_config([f"metrics.trackers=[{','.join(trackers)}]", "run.progress=false", "train.steps=2",
                          "run.log_every=1"])
    return MetricsSink(tmp_path, cfg, start_step=0)


def _log_two_steps(sink):
    for step in (1, 2):
        sink.write("train", step, {"loss": 1.0 / step, "tau": 1.5, "acc_k": [0.5, 0.25]})
    sink.write("eval", 2, {"loss": 0.7, "tau": 2.0})
    sink.close()


def test_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _log_two_steps(_sink(tmp_path, ["tensorboard"]))
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in lines] == [("train", 1), ("train", 2), ("eval", 2)]
    events = next((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    scalars = EventAccumulator(str(events)).Reload()
    assert {"train/loss", "train/acc_k/slot2", "eval/tau"} <= set(scalars.Tags()["scalars"])
    assert [e.value for e in scalars.Scalars("train/loss")] == pytest.approx([1.0, 0.5])


def test_mlflow_local_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _log_two_steps(_sink(tmp_path, ["mlflow"]))
    import mlflow
    mlflow.set_tracking_uri((tmp_path / "mlruns").resolve().as_uri())
    runs = mlflow.search_runs(experiment_names=["dflash"], output_format="list")
    assert len(runs) == 1 and runs[0].info.run_name == tmp_path.name
    history = mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5)]
    assert runs[0].data.params["train.steps"] == "2"


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_two_steps(_sink(tmp_path, ["wandb"]))
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = list(runs[0].glob("run-*.wandb"))
    assert records and records[0].stat().st_size > 0
