"""The end-of-run summary: one table on the console, summary.json, and the trackers; and the
statistics each rank's role reports for it."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from launcher.context import Context
from launcher.run_io.metrics import MetricsSink, held_out_line
from launcher.run_io.rundir import log

# Run-level figures the trackers get beside the per-step curves.
TRACKED = ("tokens_per_s", "steady_tokens_per_s", "target_idle_fraction", "drafter_idle_fraction",
           "channel_gb_per_s", "anchor_fill", "target_padding_fraction")


@dataclass(frozen=True)
class TargetStats:
    """A target rank's stream: what the target role reports."""
    items: int            # schedule items captured
    tokens: int           # non-padding tokens forwarded
    token_slots: int      # all token slots forwarded, padding included
    wall_s: float
    forward_s: float      # capturing (the compute stream synchronised)
    data_s: float         # building micro-batches and announcing them
    send_wait_s: float    # waiting for a send slot (the drafters' backpressure)
    bytes_sent: int
    data: dict            # the data's statistics (conversations, drops by reason, ...)
    tokens_per_s: float


@dataclass(frozen=True)
class DrafterStats:
    """A drafter rank's loop: what the drafter role reports (its running statistics' totals)."""
    wall_s: float
    tokens: float                  # context tokens trained on by every drafter rank (all-reduced)
    tokens_per_s: float
    steady_tokens_per_s: float     # over the second half of the steps
    recv_wait_s: float             # waiting for micro-batches
    step_s: float                  # the steps' own device time
    anchor_fill: float | None      # valid anchor slots / all anchor slots
    valid_anchors: float
    skipped_steps: int
    first_loss: float | None       # mean loss of the first steps (10: the console's "mean of 10 steps")
    last_loss: float | None        # ... and of the last
    items: int                     # micro-batches received
    compiles: int                  # graphs compiled
    compile_s: float | None        # seconds the warm-up (or the first step) compiled
    recompiles: int | None         # graphs compiled in the stream (static shapes: 0; None: no warm-up)
    compile_report: dict
    held_out: dict | None          # the last held-out evaluation (StepCounts.summary()), None without one


@dataclass(frozen=True)
class RankStats:
    rank: int
    role: str
    pid: int
    cache_dir: str
    work: TargetStats | DrafterStats

    def record(self) -> dict:
        """The rank's entry of summary.json's `ranks`."""
        return {**asdict(self.work), "rank": self.rank, "role": self.role, "pid": self.pid, "cache_dir": self.cache_dir}


def summarise(ctx: Context, per_rank: list[RankStats]) -> dict:
    drafters = [s for s in per_rank if s.role == "drafter"]
    targets = [s.work for s in per_rank if s.role == "target"]
    lead = next(s.work for s in per_rank if s.rank == ctx.topo.lead_drafter)
    wall = max(s.work.wall_s for s in per_rank)
    slots = sum(s.token_slots for s in targets)
    return {
        "steps": ctx.job.train.steps,
        "start_step": ctx.start_step,
        "topology": ctx.topo.spec,
        "tokens": lead.tokens,
        "wall_s": wall,
        "tokens_per_s": lead.tokens / wall if wall > 0 else 0.0,
        # Every drafter reports the same global token count (all-reduced); its own rate is over the late steps.
        "steady_tokens_per_s": lead.steady_tokens_per_s,
        "first_loss": lead.first_loss,
        "last_loss": lead.last_loss,
        "skipped_steps": lead.skipped_steps,
        # The last held-out evaluation: decode_tau is the walk serving drafts (a DFlash 2's selector walk, with
        # its unary-only and oracle walks, recall_at_k and selector_acc beside it).
        "held_out": lead.held_out,
        # Valid anchor slots / all anchor slots computed, and padding / all tokens the targets forwarded.
        "anchor_fill": lead.anchor_fill,
        "target_padding_fraction": 1 - sum(s.tokens for s in targets) / slots if slots else None,
        "compiles": {s.rank: s.work.compiles for s in drafters},
        "compile_s": {s.rank: s.work.compile_s for s in drafters},
        # Graphs compiled after the warm-up, in the stream: a static-shape run keeps this at 0.
        "recompiles": {s.rank: s.work.recompiles for s in drafters},
        "compile_report": lead.compile_report,
        "attention_backend": ctx.job.step.backend,   # drafter.backend resolved (auto: flex on a GPU)
        "target_idle_fraction": _mean(s.send_wait_s / s.wall_s for s in targets),
        # The share of a drafter's time its device ran no step. Not its waits for data: the loop queues the
        # next step before it reads the last, so it waits for data while its GPU may still be busy.
        "drafter_idle_fraction": _mean(max(0.0, 1 - s.work.step_s / s.work.wall_s) for s in drafters),
        "channel_gb_per_s": sum(s.bytes_sent for s in targets) / wall / 1e9 if wall > 0 else 0.0,
        "data": targets[0].data,
        "ranks": [s.record() for s in per_rank],
    }


def write_summary(ctx: Context, per_rank: list[RankStats], sink: MetricsSink) -> dict:
    summary = summarise(ctx, per_rank)
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    sink.write("summary", summary["steps"], {key: summary[key] for key in TRACKED if summary[key] is not None}
               | {f"target{s.rank}_tokens_per_s": s.work.tokens_per_s for s in per_rank if s.role == "target"})
    log.info("run summary (%s)\n%s\n%s\nrun dir: %s", summary["topology"], _rank_table(per_rank), _totals(summary),
             ctx.run_dir)
    return summary


def _rank_table(per_rank: list[RankStats]) -> str:
    rows = [("rank", "role", "items", "busy s", "waiting s", "wall s", "compiles", "compile s")]
    for s in sorted(per_rank, key=lambda s: s.rank):
        work = s.work
        # Busy: a drafter's steps on its device, a target's capturing; waiting: for micro-batches, for a send slot.
        if isinstance(work, DrafterStats):
            busy_s, waiting_s, compiles, compile_s = work.step_s, work.recv_wait_s, work.compiles, work.compile_s
        else:
            busy_s, waiting_s, compiles, compile_s = work.forward_s, work.send_wait_s, "-", None
        rows.append((s.rank, s.role, work.items, f"{busy_s:.2f}", f"{waiting_s:.2f}", f"{work.wall_s:.2f}", compiles,
                     _seconds(compile_s)))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in rows)


def _totals(summary: dict) -> str:
    nan = float("nan")
    return (f"steps {summary['steps']}  tokens {summary['tokens']:.0f}  wall {summary['wall_s']:.1f}s  "
            f"{summary['tokens_per_s']:.0f} tokens/s ({summary['steady_tokens_per_s']:.0f} steady)  "
            f"loss (mean of 10 steps) {summary['first_loss'] or nan:.4f} -> {summary['last_loss'] or nan:.4f}\n"
            f"anchor_fill {_fraction(summary['anchor_fill'])}  target_padding_fraction "
            f"{_fraction(summary['target_padding_fraction'])}  "
            f"idle: targets {100 * summary['target_idle_fraction']:.0f}%, "
            f"drafters {100 * summary['drafter_idle_fraction']:.0f}%  channel {summary['channel_gb_per_s']:.3f} GB/s"
            + (f"  skipped steps {summary['skipped_steps']}" if summary["skipped_steps"] else "")
            + (f"\nheld-out: {held_out_line(summary['held_out'])}" if summary["held_out"] else ""))


def _fraction(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
