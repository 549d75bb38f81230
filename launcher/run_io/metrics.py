"""What the lead drafter reports while training: metrics.jsonl (always), the trackers named in
`metrics.trackers` (TensorBoard by default; MLflow and Weights & Biases as optional extras), the
and the progress bar.

Only the lead drafter logs: every value it logs is already reduced over all drafter ranks.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from launcher.config import flat_config


def flatten(record: dict) -> dict[str, float]:
    """Scalars of a record; a list (e.g. per-slot accuracy acc_k) becomes key/slot1, key/slot2, ..."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, (list, tuple)):
            flat.update({f"{key}/slot{k}": float(v) for k, v in enumerate(value, start=1)})
        elif isinstance(value, (int, float)) and value is not None:
            flat[key] = float(value)
    return flat


class TensorBoardTracker:
    def __init__(self, run_dir: Path, cfg: DictConfig):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """A local file store in the run dir (no server, no database) unless MLFLOW_TRACKING_URI points
    elsewhere. MLflow 3 keeps that store only behind an explicit opt-in, given here."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        import mlflow
        self.mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(cfg.metrics.project)
        mlflow.start_run(run_name=run_dir.name)
        mlflow.log_params({key: json.dumps(value)[:500] for key, value in flat_config(cfg).items()})

    def log(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics({f"{kind}/{key}": value for key, value in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbTracker:
    """Offline by default (no network; `wandb sync <run dir>/wandb/offline-run-*` uploads later);
    WANDB_MODE=online logs live."""

    def __init__(self, run_dir: Path, cfg: DictConfig):
        import wandb
        self.run = wandb.init(project=cfg.metrics.project, name=run_dir.name, dir=str(run_dir),
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              config=OmegaConf.to_container(cfg, resolve=True))

    def log(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        self.run.log({f"{kind}/{key}": value for key, value in scalars.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def held_out_line(record: dict) -> str:
    """A held-out evaluation in one line (the progress bar's and the end summary's); a DFlash 2's with its
    selector walk's lift over its own unary-only walk, the oracle walk, recall@K and the selector's accuracy."""
    line = f"decoding tau {record['decode_tau']:.3f} (per anchor {record['tau']:.3f})  acc {record['acc']:.3f}"
    if "unary_decode_tau" not in record:
        return line
    return (f"{line}  [selector walk; unary-only walk {record['unary_decode_tau']:.3f}, oracle walk "
            f"{record['oracle_decode_tau']:.3f}, recall@K {record['recall_at_k']:.3f}, selector acc "
            f"{record['selector_acc']:.3f}]")


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}


class MetricsSink:
    """metrics.jsonl + trackers + progress bar, on the lead drafter."""

    def __init__(self, run_dir: Path, cfg: DictConfig, start_step: int):
        self.run_dir, self.log_every, self.last_step = run_dir, cfg.run.log_every, cfg.train.steps
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.trackers = [TRACKERS[name](run_dir, cfg) for name in cfg.metrics.trackers]
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not cfg.run.progress, dynamic_ncols=True,
                        desc="train", unit="step")

    def step(self, step: int, record: dict, window_rates: Callable[[], dict]) -> None:
        """One step's record; on a logged step with `window_rates()` (the rates since the last logged step)."""
        self.bar.update(1)
        selector = {"sel_acc": f"{record['selector_acc']:.3f}"} if "selector_acc" in record else {}
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}", tau=f"{record['tau']:.2f}",
                             **selector, refresh=False)
        if step % self.log_every == 0 or step == self.last_step:
            self.write("train", step, {**record, **window_rates()})

    def eval(self, step: int, record: dict) -> None:
        self.write("eval", step, record)
        self.bar.write(f"eval @ step {step}: {held_out_line(record)}")

    def write(self, kind: str, step: int, record: dict) -> None:
        self.jsonl.write(json.dumps({"kind": kind, "step": step, **record}) + "\n")
        scalars = flatten(record)
        for tracker in self.trackers:
            tracker.log(kind, step, scalars)

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        for tracker in self.trackers:
            tracker.close()
