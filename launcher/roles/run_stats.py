"""What the drafter loop counts while it trains, and the DrafterStats it reports at the end (the
summary, launcher/run_io/summary.py, formats them)."""
from __future__ import annotations

import time

from launcher.roles.trainer import StepResult
from launcher.run_io.summary import DrafterStats


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

    def result(self, *, items: int, compiles: int, compile_s: float | None, recompiles: int | None,
               compile_report: dict, held_out: dict | None) -> DrafterStats:
        """The loop's totals, with what the loop knows of its stream and its compilation."""
        wall = time.perf_counter() - self.started
        head, tail = self.losses[:self.LOSS_WINDOW], self.losses[-self.LOSS_WINDOW:]
        return DrafterStats(wall_s=wall, tokens=self.tokens, tokens_per_s=self.tokens / wall if wall > 0 else 0.0,
                            steady_tokens_per_s=self.steady_rate(), recv_wait_s=self.wait_s, step_s=self.busy_s,
                            anchor_fill=self.valid_anchors / self.anchor_slots if self.anchor_slots else None,
                            valid_anchors=self.valid_anchors, skipped_steps=self.skipped,
                            first_loss=sum(head) / len(head) if head else None,
                            last_loss=sum(tail) / len(tail) if tail else None, items=items, compiles=compiles,
                            compile_s=compile_s, recompiles=recompiles, compile_report=compile_report,
                            held_out=held_out)
