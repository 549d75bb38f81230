"""The deterministic stream of micro-batches: who produces item k, who consumes it.

The stream is a pure function of the config (and, for a run resumed at another number of
micro-batches per step, of where its checkpoint stopped: `resumed_at`), so every rank derives it alone
(no coordinator) and a resumed run restarts at the first item of its step.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

TRAIN, EVAL = 0, 1


@dataclass(frozen=True)
class Item:
    seq: int      # position in the global stream
    kind: int     # TRAIN or EVAL
    index: int    # micro-batch index in its source (train: global micro-batch index)
    step: int     # optimiser step the item belongs to (0-based)
    unit: int     # target unit that produces it
    drafter: int  # drafter (0-based among drafters) that consumes it


@dataclass(frozen=True)
class Schedule:
    steps: int
    num_units: int
    num_drafters: int
    grad_accum: int
    eval_every: int      # 0: evaluate only after the last step
    eval_batches: int    # per drafter per evaluation; 0 disables evaluation
    # Step origin_step trains from micro-batch origin_index on: (0, 0), or where a checkpoint trained at another
    # number of micro-batches per step stopped (resumed_at), so every micro-batch is still trained once.
    origin_step: int = 0
    origin_index: int = 0

    @property
    def train_per_step(self) -> int:
        return self.num_drafters * self.grad_accum

    def trained_before(self, step: int) -> int:
        """Training micro-batches consumed by the steps before `step` (0-based), over the whole lineage."""
        return self.origin_index + (step - self.origin_step) * self.train_per_step

    def resumed_at(self, step: int, trained: int) -> Schedule:
        """This schedule continuing a checkpoint of `step` steps that trained micro-batches [0, trained)."""
        return replace(self, origin_step=step, origin_index=trained)

    @property
    def eval_per_round(self) -> int:
        return self.num_drafters * self.eval_batches

    def evaluates_after(self, step: int) -> bool:
        if self.eval_batches == 0:
            return False
        last = step == self.steps - 1
        return last or (self.eval_every > 0 and (step + 1) % self.eval_every == 0)

    def _evals_before(self, step: int) -> int:
        # Only periodic rounds can precede a step that is run: the final round comes after the last one.
        if self.eval_batches == 0 or self.eval_every == 0:
            return 0
        return step // self.eval_every

    def first_seq(self, step: int) -> int:
        return step * self.train_per_step + self._evals_before(step) * self.eval_per_round

    def items(self, start_step: int = 0) -> Iterator[Item]:
        seq = self.first_seq(start_step)
        for step in range(start_step, self.steps):
            for j in range(self.train_per_step):
                yield Item(seq, TRAIN, self.trained_before(step) + j, step,
                           seq % self.num_units, j % self.num_drafters)
                seq += 1
            if self.evaluates_after(step):
                for j in range(self.eval_per_round):
                    yield Item(seq, EVAL, j, step, seq % self.num_units, j % self.num_drafters)
                    seq += 1

    def items_for_unit(self, unit: int, start_step: int = 0) -> Iterator[Item]:
        return (it for it in self.items(start_step) if it.unit == unit)

    def items_for_drafter(self, drafter: int, start_step: int = 0) -> Iterator[Item]:
        return (it for it in self.items(start_step) if it.drafter == drafter)
