"""What the lead drafter reports while training: metrics.jsonl (always), the trackers named in
`metrics.trackers` (TensorBoard by default; MLflow and Weights & Biases as optional extras), the
progress bar, and the loop's running statistics.

Only the lead drafter logs: every value it logs is already reduced over all drafter ranks.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from launcher.roles.trainer import StepResult


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
        params = flatten_config(cfg)
        mlflow.log_params({key: value[:500] for key, value in params.items()})

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


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}


def flatten_config(cfg: DictConfig) -> dict[str, str]:
    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", json.dumps(value)
    return dict(walk(OmegaConf.to_container(cfg, resolve=True), ""))


class MetricsSink:
    """metrics.jsonl + trackers + progress bar, on the lead drafter."""

    def __init__(self, run_dir: Path, cfg: DictConfig, start_step: int):
        self.run_dir, self.log_every, self.last_step = run_dir, cfg.run.log_every, cfg.train.steps
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.trackers = [TRACKERS[name](run_dir, cfg) for name in cfg.metrics.trackers]
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not cfg.run.progress, dynamic_ncols=True,
                        desc="train", unit="step")

    def step(self, step: int, record: dict, stats: "RunStats") -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}", tau=f"{record['tau']:.2f}",
                             refresh=False)
        if step % self.log_every == 0 or step == self.last_step:
            self.write("train", step, {**record, **stats.window_rates()})

    def eval(self, step: int, record: dict) -> None:
        self.write("eval", step, record)
        self.bar.write(f"eval @ step {step}: decoding tau {record['decode_tau']:.3f} (per anchor {record['tau']:.3f})  "
                       f"acc {record['acc']:.3f}")

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


class RunStats:
    """The drafter loop's bookkeeping: losses, tokens, waiting, anchor fill, skipped steps, in total
    and per log window."""

    LOSS_WINDOW = 10  # steps averaged for the start and end loss of the summary

    def __init__(self):
        self.started = time.perf_counter()
        self.losses: list[float] = []
        self.tokens = self.valid_anchors = self.anchor_slots = 0.0
        self.wait_s = self.busy_s = 0.0
        self.skipped = 0
        self.progress = [(self.started, 0.0)]  # (time, tokens so far) after each step
        self._window = (self.started, 0.0, 0.0)  # (start, tokens, seconds of steps) since the last log line

    def add_step(self, result: StepResult, *, waited: float) -> dict:
        """Record one step; returns its summary (loss, tau, acc, acc_k, eal, anchor_fill)."""
        summary = result.counts.summary()
        tokens = result.counts.tokens.item()
        self.skipped += result.skipped
        if not result.skipped:
            self.losses.append(summary["loss"])
        self.tokens += tokens
        self.valid_anchors += result.counts.tau_count.item()
        self.anchor_slots += result.counts.anchor_slots.item()
        self.wait_s += waited
        self.busy_s += result.busy_s
        self.progress.append((time.perf_counter(), self.tokens))
        start, window_tokens, window_busy = self._window
        self._window = (start, window_tokens + tokens, window_busy + result.busy_s)
        return summary

    def window_rates(self) -> dict:
        """Tokens/s and idle fraction (the share of the time the device ran no step) since the last call."""
        now = time.perf_counter()
        start, tokens, busy = self._window
        elapsed = max(now - start, 1e-9)
        self._window = (now, 0.0, 0.0)
        return {"tokens_per_s": tokens / elapsed, "idle_fraction": max(0.0, 1 - busy / elapsed)}

    def steady_rate(self) -> float:
        """Tokens/s over the second half of the steps: compilation and pipeline fill stay out of it."""
        (t0, n0), (t1, n1) = self.progress[len(self.progress) // 2], self.progress[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def result(self) -> dict:
        wall = time.perf_counter() - self.started
        head, tail = self.losses[:self.LOSS_WINDOW], self.losses[-self.LOSS_WINDOW:]
        return {"wall_s": wall, "tokens": self.tokens, "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
                "steady_tokens_per_s": self.steady_rate(), "recv_wait_s": self.wait_s, "step_s": self.busy_s,
                "anchor_fill": self.valid_anchors / self.anchor_slots if self.anchor_slots else None,
                "valid_anchors": self.valid_anchors, "skipped_steps": self.skipped,
                "first_loss": sum(head) / len(head) if head else None,
                "last_loss": sum(tail) / len(tail) if tail else None}
