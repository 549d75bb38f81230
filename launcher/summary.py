"""The end-of-run summary: one table on the console and summary.json in the run dir."""
from __future__ import annotations

import json

from launcher.context import Context
from launcher.rundir import log


def write_summary(ctx: Context, per_rank: list[dict]) -> dict:
    drafters = [s for s in per_rank if s["role"] == "drafter"]
    targets = [s for s in per_rank if s["role"] == "target"]
    lead = next(s for s in drafters if s["rank"] == ctx.topo.lead_drafter)
    wall = max(s["wall_s"] for s in per_rank)
    summary = {
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
        "compiles": {s["rank"]: s["compiles"] for s in drafters},
        "compile_s": {s["rank"]: s["compile_s"] for s in drafters},
        "target_idle_fraction": _mean(s["send_wait_s"] / s["wall_s"] for s in targets),
        "drafter_idle_fraction": _mean(s["recv_wait_s"] / s["wall_s"] for s in drafters),
        "channel_gb_per_s": sum(s["bytes_sent"] for s in targets) / wall / 1e9 if wall > 0 else 0.0,
        "data": targets[0]["data"],
        "ranks": per_rank,
    }
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _to_tensorboard(ctx.run_dir, summary, targets)
    rows = [("rank", "role", "items", "busy s", "waiting s", "wall s", "compiles", "compile s")]
    for s in sorted(per_rank, key=lambda s: s["rank"]):
        busy = s.get("forward_s", s.get("step_s", 0.0))
        waiting = s.get("send_wait_s", s.get("recv_wait_s", 0.0))
        rows.append((s["rank"], s["role"], s["items"], f"{busy:.2f}", f"{waiting:.2f}", f"{s['wall_s']:.2f}",
                     s.get("compiles", "-"), _seconds(s.get("compile_s"))))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(str(v).rjust(w) for v, w in zip(r, widths)) for r in rows)
    log.info("run summary (%s)\n%s\nsteps %d  tokens %d  wall %.1fs  %.0f tokens/s (%.0f steady)  loss (mean of 10 steps) %.4f -> %.4f  "
             "idle: targets %.0f%%, drafters %.0f%%  channel %.3f GB/s\nrun dir: %s",
             summary["topology"], table, summary["steps"], summary["tokens"], wall, summary["tokens_per_s"], summary["steady_tokens_per_s"],
             summary["first_loss"] or float("nan"), summary["last_loss"] or float("nan"),
             100 * summary["target_idle_fraction"], 100 * summary["drafter_idle_fraction"],
             summary["channel_gb_per_s"], ctx.run_dir)
    return summary


def _to_tensorboard(run_dir, summary: dict, targets: list[dict]) -> None:
    """Stage throughput and idle fractions of the whole run, beside the per-step curves."""
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter(str(run_dir / "tensorboard")) as writer:
        for key in ("tokens_per_s", "steady_tokens_per_s", "target_idle_fraction", "drafter_idle_fraction",
                    "channel_gb_per_s"):
            writer.add_scalar(f"summary/{key}", summary[key], summary["steps"])
        for stats in targets:
            writer.add_scalar(f"summary/target{stats['rank']}_tokens_per_s", stats["tokens_per_s"], summary["steps"])


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
