"""Rows built from measurements: end to end (from a launcher run's summary.json), the stage balance,
the thread baseline, error and skip rows; and the stage rates the pipeline efficiency is judged by."""
from __future__ import annotations

import json
from pathlib import Path

from launcher.bench.counts import balance_advice
from launcher.bench.report import Row, fmt
from launcher.bench.stages import progress


def error_row(n: int, name: str, exc: BaseException) -> dict:
    progress(f"{name} FAILED: {type(exc).__name__}: {exc}")
    return {"n": n, "row": name, "error": f"{type(exc).__name__}: {exc}",
            "notes": f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}


def measured(rows: list[dict], n: int, name: str, measure, *args, skipped: str | None = None):
    """Row n's measurement: None, with a note row, when `skipped` says why; None, with an error row,
    when it raises (a failed row must not cost the others); else what `measure(*args)` returns."""
    if skipped:
        rows.append({"n": n, "row": name, "notes": skipped})
        return None
    try:
        return measure(*args)
    except Exception as exc:  # noqa: BLE001
        rows.append(error_row(n, name, exc))
        return None


# ------------------------------------------------------------------------------ stage rates
def stage_rates(rows: list[dict]) -> dict:
    """{(stage, mode, seq_len): real tokens/s per GPU over a whole epoch} of the stage-alone rows,
    plus {("blocks_per_token", mode, seq_len): supervised blocks per real token} of the drafter rows."""
    rates = {}
    for r in rows:
        if r.get("stage") in ("target", "drafter") and r.get("epoch_tokens_per_s"):
            rates[(r["stage"], r["mode"], r["seq_len"])] = r["epoch_tokens_per_s"]
            if r["stage"] == "drafter":
                rates[("blocks_per_token", r["mode"], r["seq_len"])] = (r["epoch_supervised_blocks_per_s"]
                                                                        / r["epoch_tokens_per_s"])
    return rates


def load_stage_rates(path: Path) -> dict:
    """stage_rates of an earlier bench JSON (--stage-rates), for end-to-end rows run on their own."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--stage-rates {path}: not a readable bench JSON ({type(exc).__name__}: {exc})") from None
    rates = stage_rates(rows)
    if not rates:
        raise ValueError(f"--stage-rates {path}: no target or drafter stage rows in it")
    return rates


def _stage_bound(rates: dict, mode: str, seq_len: int, topology) -> float | None:
    target = rates.get(("target", mode, seq_len))
    drafter = rates.get(("drafter", mode, seq_len))
    if target is None or drafter is None:
        return None
    return min(target * topology.num_targets, drafter * topology.num_drafters)


# ------------------------------------------------------------------------------ end to end
def e2e_row(n: int, summary: dict, seq_len: int, mode: str, rates: dict, topology) -> dict:
    """Row n from a launcher run's summary.json. Rates are real (non-padding) tokens/s; supervised
    blocks/s is the steady token rate times the run's valid anchors per real token."""
    t, d = topology.num_targets, topology.num_drafters
    steady = summary["steady_tokens_per_s"]
    bound = _stage_bound(rates, mode, seq_len, topology)
    efficiency = steady / bound if bound else None
    drafter = next(r for r in summary["ranks"] if r["role"] == "drafter")   # counts are all-reduced: any rank
    targets = [r for r in summary["ranks"] if r["role"] == "target"]
    blocks = steady * drafter["valid_anchors"] / drafter["tokens"] / d if drafter["tokens"] else None
    forward_rate = sum(r["tokens"] for r in targets) / max(sum(r["forward_s"] for r in targets), 1e-9)
    compiles = summary.get("compiles", {})
    label = "full rows" if mode == "full" else f"{mode} mix"
    # Real tokens per micro-batch (drafter token counts are all-reduced, items per rank) -> time per step.
    per_step = drafter["tokens"] / (drafter["items"] * d) if drafter["items"] else None
    row = {"n": n, "row": f"end to end {topology.spec}, {label}", "mode": mode, "seq_len": seq_len,
           "tokens_per_s": steady, "ms_per_step": 1e3 * per_step * d / steady if steady and per_step else None,
           "supervised_blocks_per_s": blocks, "target_tokens_per_s_per_gpu": steady / t,   # blocks: per drafter GPU
           "target_forward_tokens_per_s_per_gpu": forward_rate,
           "anchor_fill": summary.get("anchor_fill"), "padding_fraction": summary.get("target_padding_fraction"),
           "pipeline_efficiency": efficiency, "stage_bound_tokens_per_s": bound,
           "target_idle_fraction": summary["target_idle_fraction"],
           "drafter_idle_fraction": summary["drafter_idle_fraction"],
           "channel_gb_per_s": summary["channel_gb_per_s"], "compiles_per_drafter": compiles,
           "compile_s_per_drafter": summary.get("compile_s", {}), "compile_report": summary.get("compile_report"),
           "overall_tokens_per_s": summary["tokens_per_s"], "steps": summary["steps"], "wall_s": summary["wall_s"],
           "first_loss": summary.get("first_loss"), "last_loss": summary.get("last_loss"), "summary": summary}
    row["notes"] = (f"efficiency {fmt(efficiency, '.2f')}, {fmt(blocks, '.0f')} blocks/s per drafter GPU, "
                    f"target {steady / t:.0f} real tok/s per GPU (busy rate {forward_rate:.0f}), idle target "
                    f"{summary['target_idle_fraction']:.0%} drafter {summary['drafter_idle_fraction']:.0%}, channel "
                    f"{summary['channel_gb_per_s']:.2f} GB/s, compiles {dict(compiles)}, compile s "
                    f"{ {r: round(v, 1) for r, v in summary.get('compile_s', {}).items() if v is not None} }")
    return row


# ------------------------------------------------------------------------------ balance
def balance_rows(n: int, rates: dict, node_gpus: int, shape: str) -> list[dict]:
    """One balance row per (mode, S) with both stage rates: the T:D split of this node and of an
    8-GPU node that keeps both stages busy, and what it trains (real tokens/s, supervised blocks/s)."""
    rows = []
    for stage, mode, seq_len in sorted((k for k in rates if k[0] == "target"), key=lambda k: (k[2], k[1] != "padded")):
        target, drafter = rates[(stage, mode, seq_len)], rates.get(("drafter", mode, seq_len))
        if drafter is None:
            continue
        here, eight = balance_advice(target, drafter, node_gpus), balance_advice(target, drafter, 8)
        per_token = rates.get(("blocks_per_token", mode, seq_len))
        label = "full rows" if mode == "full" else f"{mode} mix"
        rows.append({"n": n, "row": f"balance, {label}", "mode": mode, "seq_len": seq_len, "shape": shape,
                     "tokens_per_s": here[2], "advice": {str(node_gpus): f"t{here[0]}d{here[1]}",
                                                         "8": f"t{eight[0]}d{eight[1]}"},
                     "tokens_per_s_8_gpus": eight[2],
                     "supervised_blocks_per_s_8_gpus": eight[2] * per_token if per_token else None,
                     "notes": f"{shape}: {node_gpus} GPUs t{here[0]}d{here[1]} ({here[2]:.0f} tok/s); 8 GPUs "
                              f"t{eight[0]}d{eight[1]} ({eight[2]:.0f} tok/s"
                              + (f", {eight[2] * per_token:.0f} blocks/s" if per_token else "")
                              + f"); target:drafter per-GPU rate {target / drafter:.2f}"})
    return rows


# ------------------------------------------------------------------------------ thread baseline
def baseline_row(result: dict, e2e: dict | None) -> dict:
    kinds = "; ".join(f"{n}x {k[:90]}" for k, n in list(result["failure_kinds"].items())[:3])
    versus = ""
    if e2e and e2e.get("tokens_per_s"):
        versus = f", process design {e2e['tokens_per_s']:.0f} tok/s"
    note = (f"{result['threads']} threads on {','.join(sorted(set(result['drafter_devices'])))}, {result['backend']}"
            f"{', fx-noise' if result['fx_noise'] else ''}: "
            f"{result['steps_done']}/{result['steps_attempted']} steps ok, "
            f"{result['failures']} failed, {result['target_failures']} target forwards failed{versus}"
            + (f" [{kinds}]" if kinds else "")
            + (" (sdpa, no FX noise: nothing compiled, 0 failures expected)"
               if result["backend"] == "sdpa" and not result["fx_noise"] else ""))
    return {"n": Row.BASELINE, "row": "thread baseline", "seq_len": result["seq_len"],
            "tokens_per_s": result["steady_tokens_per_s"],
            **{k: result[k] for k in ("threads", "steps_done", "steps_attempted", "failures", "failure_kinds",
                                      "target_failures", "target_failure_kinds", "hung_threads", "fx_traces",
                                      "wall_s", "backend", "fx_noise", "per_thread")},
            "overall_tokens_per_s": result["tokens_per_s"], "notes": note}
