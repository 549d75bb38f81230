"""The end-of-run summary: one table on the console, summary.json, and the trackers."""
from __future__ import annotations

import json

from launcher.context import Context
from launcher.run_io.metrics import MetricsSink
from launcher.run_io.rundir import log

# Run-level figures the trackers get beside the per-step curves.
TRACKED = ("tokens_per_s", "steady_tokens_per_s", "target_idle_fraction", "drafter_idle_fraction",
           "channel_gb_per_s", "anchor_fill", "target_padding_fraction")


def summarise(ctx: Context, per_rank: list[dict]) -> dict:
    drafters = [s for s in per_rank if s["role"] == "drafter"]
    targets = [s for s in per_rank if s["role"] == "target"]
    lead = next(s for s in drafters if s["rank"] == ctx.topo.lead_drafter)
    wall = max(s["wall_s"] for s in per_rank)
    slots = sum(s["token_slots"] for s in targets)
    return {
        "steps": ctx.cfg.train.steps,
        "start_step": ctx.start_step,
        "topology": ctx.topo.spec,
        "tokens": lead["tokens"],
        "wall_s": wall,
        "tokens_per_s": lead["tokens"] / wall if wall > 0 else 0.0,
        # Every drafter reports the same global token count (all-reduced); its own rate is over the late steps.
        "steady_tokens_per_s": lead["steady_tokens_per_s"],
        "first_loss": lead["first_loss"],
        "last_loss": lead["last_loss"],
        "skipped_steps": lead["skipped_steps"],
        # Valid anchor slots / all anchor slots computed, and padding / all tokens the targets forwarded.
        "anchor_fill": lead["anchor_fill"],
        "target_padding_fraction": 1 - sum(s["tokens"] for s in targets) / slots if slots else None,
        "compiles": {s["rank"]: s["compiles"] for s in drafters},
        "compile_s": {s["rank"]: s["compile_s"] for s in drafters},
        # Graphs compiled after the warm-up, in the stream: a static-shape run keeps this at 0.
        "recompiles": {s["rank"]: s["recompiles"] for s in drafters},
        "compile_report": lead["compile_report"],
        "attention_backend": ctx.job.step.backend,   # drafter.backend resolved (auto: flex on a GPU)
        "target_idle_fraction": _mean(s["send_wait_s"] / s["wall_s"] for s in targets),
        # The share of a drafter's time its device ran no step. Not its waits for data: the loop queues the
        # next step before it reads the last, so it waits for data while its GPU may still be busy.
        "drafter_idle_fraction": _mean(max(0.0, 1 - s["step_s"] / s["wall_s"]) for s in drafters),
        "channel_gb_per_s": sum(s["bytes_sent"] for s in targets) / wall / 1e9 if wall > 0 else 0.0,
        "data": targets[0]["data"],
        "ranks": per_rank,
    }


def write_summary(ctx: Context, per_rank: list[dict], sink: MetricsSink) -> dict:
    summary = summarise(ctx, per_rank)
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    sink.write("summary", summary["steps"], {key: summary[key] for key in TRACKED if summary[key] is not None}
               | {f"target{s['rank']}_tokens_per_s": s["tokens_per_s"] for s in per_rank if s["role"] == "target"})
    log.info("run summary (%s)\n%s\n%s\nrun dir: %s", summary["topology"], _rank_table(per_rank), _totals(summary),
             ctx.run_dir)
    return summary


def _rank_table(per_rank: list[dict]) -> str:
    rows = [("rank", "role", "items", "busy s", "waiting s", "wall s", "compiles", "compile s")]
    for s in sorted(per_rank, key=lambda s: s["rank"]):
        busy = s.get("forward_s", s.get("step_s", 0.0))
        waiting = s.get("send_wait_s", s.get("recv_wait_s", 0.0))
        rows.append((s["rank"], s["role"], s["items"], f"{busy:.2f}", f"{waiting:.2f}", f"{s['wall_s']:.2f}",
                     s.get("compiles", "-"), _seconds(s.get("compile_s"))))
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
            + (f"  skipped steps {summary['skipped_steps']}" if summary["skipped_steps"] else ""))


def _fraction(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
