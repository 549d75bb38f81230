"""End-of-run curves: loss, acceptance (tau) and throughput against the step, from metrics.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def plot_run(run_dir: Path) -> Path | None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        return None
    import matplotlib
    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, (loss_ax, tau_ax, speed_ax) = plt.subplots(1, 3, figsize=(15, 4))
    loss_ax.plot(steps, [r["loss"] for r in train], label="train")
    if evals:
        loss_ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out")
    loss_ax.set(title="loss", xlabel="step")
    tau_ax.plot(steps, [r["tau"] for r in train], label="train batch, per anchor")
    if evals:
        tau_ax.plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", label="held-out, per anchor")
        tau_ax.plot([r["step"] for r in evals], [r["decode_tau"] for r in evals], "s-", label="held-out, decoding")
        if "unary_decode_tau" in evals[0]:   # a DFlash 2: its selector walk above, its unary top-1 walk here
            tau_ax.plot([r["step"] for r in evals], [r["unary_decode_tau"] for r in evals], "^--",
                        label="held-out, decoding, unary top-1 walk")
    tau_ax.set(title="simulated acceptance length tau", xlabel="step")
    speed_ax.plot(steps, [r["tokens_per_s"] for r in train])
    speed_ax.set(title="drafter tokens/s (all ranks)", xlabel="step")
    for ax in (loss_ax, tau_ax):
        ax.legend()
    for ax in (loss_ax, tau_ax, speed_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
