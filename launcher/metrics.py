"""Metrics sinks of the lead drafter: metrics.jsonl, TensorBoard, the progress bar."""
from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from launcher.rundir import JsonlWriter


class MetricsSink:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress: bool):
        from torch.utils.tensorboard import SummaryWriter
        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl")
        self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        self.bar = tqdm(total=total_steps, initial=start_step, disable=not progress, dynamic_ncols=True,
                        desc="train", unit="step")

    def step(self, record: dict, write: bool) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", acc=f"{record['acc']:.3f}", tau=f"{record['tau']:.2f}",
                             tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
        if write:
            self._write("train", record)

    def eval(self, record: dict) -> None:
        self._write("eval", record)
        self.bar.write(f"eval @ step {record['step']}: tau {record['tau']:.3f}  acc {record['acc']:.3f}")

    def _write(self, kind: str, record: dict) -> None:
        self.jsonl.write({"kind": kind, **record})
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, list):
                for k, v in enumerate(value, start=1):
                    self.tensorboard.add_scalar(f"{kind}/{key}/slot{k}", v, record["step"])
            else:
                self.tensorboard.add_scalar(f"{kind}/{key}", value, record["step"])

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        self.tensorboard.close()
