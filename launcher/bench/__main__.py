"""GPU benchmark harness: `python -m launcher.bench` (or `make bench ARGS=...`).

Rows, all measured in one run (random weights at the real shapes; speed does not depend on them):
  1. matmul ceiling     bf16 8192^3 (CPU: fp32 1024^3), median TFLOP/s: the MFU denominator
  2. target alone       the frozen target's capture() on one GPU, per sequence length
  3. drafter alone      the real step (DrafterTrainer.train_step) fed from memory, per length
  4. end to end         the real launcher under torchrun, t1d<G-1>, from its summary.json
  5. balance            the T:D split that keeps both stages busy, from rows 2 and 3
  6. thread baseline    the old one-process, thread-per-drafter design (launcher/thread_baseline.py)

Default: the Qwen3-8B shape (36 layers, hidden 4096, vocab 151936), drafter=dflash5 (5 layers,
block 16, layers [1, 9, 17, 25, 33]), 512 anchors, micro-batch 1, S = 2048 and 4096.
`--tiny` (automatic without CUDA): the tiny target's shapes and drafter=tiny, small S.
Prints progress as it goes and one table last; writes the same as JSON (--out, default
$OUT/bench.json or runs/bench-<time>.json).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from launcher.bench.counts import SHAPES, balance_advice
from launcher.bench.inputs import run_overrides, write_bench_target, write_synthetic_data
from launcher.bench.report import fmt, format_table
from launcher.bench.stages import REPO, baseline_stage, drafter_stage, e2e_stage, matmul_ceiling, progress, target_stage

GPU_DEFAULTS = dict(seq="2048,4096", steps=10, warmup=3, e2e_steps=40, baseline_steps=20, anchors=512,
                    e2e_timeout=240, baseline_timeout=200)
TINY_DEFAULTS = dict(seq="64,128", steps=4, warmup=2, e2e_steps=8, baseline_steps=4, anchors=32,
                     e2e_timeout=150, baseline_timeout=120)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launcher.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (automatic when CUDA is unavailable)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="target shape on GPUs")
    p.add_argument("--e2e-topology", help="t<T>d<D> of the end-to-end run (default t1d<G-1> on G GPUs)")
    p.add_argument("--seq", help="comma-separated sequence lengths (default 2048,4096; tiny 64,128)")
    p.add_argument("--steps", type=int, help="timed steps per stage measurement (default 10; tiny 4)")
    p.add_argument("--warmup", type=int, help="untimed steps first (compiles happen here; default 3)")
    p.add_argument("--anchors", type=int, help="anchors per row (default 512; tiny 32)")
    p.add_argument("--e2e-steps", type=int, help="optimiser steps of the end-to-end run (default 40)")
    p.add_argument("--e2e-seq", type=int, help="sequence length of the end-to-end run (default: the longest)")
    p.add_argument("--baseline-steps", type=int, help="micro-batches per drafter thread (default 20)")
    p.add_argument("--baseline-backend", choices=("auto", "flex", "sdpa"), default="auto",
                   help="attention backend of the thread baseline (auto: flex on GPU, sdpa on CPU)")
    p.add_argument("--fx-noise", action="store_true",
                   help="thread baseline: add a thread running torch.fx.symbolic_trace in a loop")
    p.add_argument("--baseline-cold-cache", action="store_true",
                   help="thread baseline compiles from an empty inductor cache (default: reuse the bench's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="hydra override for the drafter-alone and end-to-end rows (repeatable), "
                        "e.g. --set drafter.compile=false")
    p.add_argument("--profile", action="store_true",
                   help="profile two drafter steps at the longest length: kernel table and compile times")
    p.add_argument("--skip-target", action="store_true")
    p.add_argument("--skip-drafter", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--e2e-timeout", type=float)
    p.add_argument("--baseline-timeout", type=float)
    p.add_argument("--out", help="JSON output path")
    p.add_argument("--work-dir", help="scratch dir (bench target, data, runs); kept when given")
    p.add_argument("--tokenizer", help="dir of the tiny tokenizer to copy (default: build/reuse .cache/tiny-qwen3)")
    args = p.parse_args(argv)
    args.tiny = args.tiny or not torch.cuda.is_available()
    for key, value in (TINY_DEFAULTS if args.tiny else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seqs = [int(s) for s in str(args.seq).split(",") if s]
    args.e2e_seq = args.e2e_seq or max(args.seqs)
    return args


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "bench.json"
    return REPO / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _tokenizer_source(args) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    from dflash_core.tiny import build_tiny_target
    return build_tiny_target(REPO / ".cache" / "tiny-qwen3")


def _tiny_shape(tokenizer_src: Path) -> dict:
    from transformers import AutoConfig

    from dflash_core.tiny import MODEL_SHAPE
    vocab = AutoConfig.from_pretrained(tokenizer_src).vocab_size if (tokenizer_src / "config.json").is_file() else 1088
    return {**MODEL_SHAPE, "vocab_size": vocab}


def _error_row(n: int, name: str, exc: BaseException) -> dict:
    progress(f"{name} FAILED: {type(exc).__name__}: {exc}")
    return {"n": n, "row": name, "error": f"{type(exc).__name__}: {exc}",
            "notes": f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"}


def run(args) -> dict:
    from launcher.config import compose_config
    from launcher.distributed.isolation import isolate
    from launcher.distributed.topology import Topology, parse_topology
    from launcher.resolve import resolve

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    num_gpus = torch.cuda.device_count() if cuda else 0
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    procs = 2 if not cuda else num_gpus
    e2e_topology = parse_topology(args.e2e_topology or f"t1d{max(procs - 1, 1)}", max(procs, 2), 1)
    progress(f"torch {torch.__version__}, device {torch.cuda.get_device_name(0) if cuda else 'cpu'}, "
             f"{num_gpus} GPU(s), {'tiny' if args.tiny else args.shape} shapes, S={args.seqs}, work dir {work}")

    tokenizer_src = _tokenizer_source(args)
    shape = _tiny_shape(tokenizer_src) if args.tiny else dict(SHAPES[args.shape])
    target_dir = write_bench_target(work / "target", shape, tokenizer_src)
    data_path = work / "data.jsonl"
    data_info = write_synthetic_data(data_path, target_dir, max(args.seqs + [args.e2e_seq]))
    over = dict(target_dir=target_dir, data_path=data_path, tiny=args.tiny, anchors=args.anchors, work=work)
    extra = ([] if cuda else ["run.device=cpu"]) + list(args.overrides)   # --tiny on a GPU stays on the CPU
    cfg = compose_config(run_overrides(seq_len=max(args.seqs), steps=args.warmup + args.steps, **over) + extra)
    cache_root = work / "compile_cache"
    # The drafter stage compiles into the cache dir of the end-to-end run's first drafter, on that rank's
    # GPU: inductor's cache keys include the device, and a miss costs minutes at the 8B shape.
    first_drafter = e2e_topology.num_targets
    drafter_device = torch.device("cuda", first_drafter) if cuda and num_gpus > first_drafter else device
    iso = isolate("drafter", first_drafter, 1, cache_root, drafter_device, cfg.isolation.recompile_limit,
                  cfg.isolation.compile_threads)
    job = resolve(cfg, Topology(num_targets=0, num_drafters=1), drafter_device)   # one drafter rank
    dcfg, hf_config = job.drafter, job.target.hf_config
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "num_gpus": num_gpus, "tiny": args.tiny, "seqs": args.seqs, "anchors": args.anchors,
            "shape": shape, "drafter": {"num_layers": dcfg.num_hidden_layers, "block_size": dcfg.block_size,
                                        "target_layer_ids": dcfg.target_layer_ids,
                                        "mask_token_id": dcfg.mask_token_id, "backend": job.step.backend},
            "data": data_info, "args": {k: v for k, v in vars(args).items() if k != "seqs"}}
    rows: list[dict] = []

    progress("row 1: matmul ceiling")
    ceiling_row = {"n": 1, **matmul_ceiling(device, tiny=args.tiny)}
    rows.append(ceiling_row)
    ceiling = ceiling_row["tflops"]
    progress(f"matmul ceiling {ceiling:.1f} TFLOP/s ({ceiling_row['shape']})")

    def measure_target():
        progress("row 2: target alone")
        return target_stage(hf_config, dcfg.target_layer_ids, device, job.target.dtype,
                            args.seqs, warmup=args.warmup, reps=args.steps, ceiling=ceiling)
    target_rows = _measured(rows, 2, "target alone", measure_target,
                            skipped="skipped (--skip-target)" if args.skip_target else None) or []
    rows += [{"n": 2, **r} for r in target_rows]
    _free(device)

    def measure_drafter():
        progress("row 3: drafter alone (DrafterTrainer.train_step)")
        return drafter_stage(job, args.seqs, work=work, warmup=args.warmup, steps=args.steps, ceiling=ceiling,
                             profile=args.profile)
    drafter_rows = _measured(rows, 3, "drafter alone", measure_drafter,
                             skipped="skipped (--skip-drafter)" if args.skip_drafter else None) or []
    rows += [{"n": 3, **r} for r in drafter_rows]
    _free(drafter_device)

    target_rate = {r["seq_len"]: r["tokens_per_s"] for r in target_rows}
    drafter_rate = {r["seq_len"]: r["tokens_per_s"] for r in drafter_rows}

    def measure_e2e():
        progress(f"row 4: end to end, {e2e_topology.spec} on {procs} {'GPUs' if cuda else 'CPU processes'}, "
                 f"S={args.e2e_seq}, {args.e2e_steps} steps")
        summary = e2e_stage(run_overrides(seq_len=args.e2e_seq, steps=args.e2e_steps, **over) + extra,
                            topology=e2e_topology, work=work, tiny=args.tiny, timeout_s=args.e2e_timeout)
        return _e2e_row(summary, args.e2e_seq, target_rate, drafter_rate, e2e_topology)
    e2e_skipped = ("skipped (--skip-e2e)" if args.skip_e2e
                   else f"skipped: needs >= 2 GPUs, found {num_gpus}" if procs < 2 else None)
    e2e_row = _measured(rows, 4, "end to end", measure_e2e, skipped=e2e_skipped)
    if e2e_row:
        rows.append(e2e_row)

    for seq_len in args.seqs:
        if seq_len in target_rate and seq_len in drafter_rate:
            rows.append(_balance_row(seq_len, target_rate[seq_len], drafter_rate[seq_len], max(procs, 2)))

    def measure_baseline():
        progress(f"row 6: thread baseline (old design), S={args.e2e_seq}")
        result = baseline_stage(_baseline_spec(args, dcfg, target_dir, cfg, num_gpus, cuda), work=work,
                                tiny=args.tiny, timeout_s=args.baseline_timeout,
                                cache_dir=None if args.baseline_cold_cache else iso.cache_dir)
        return _baseline_row(result, e2e_row)
    baseline_row = _measured(rows, 6, "thread baseline", measure_baseline,
                             skipped="skipped (--skip-baseline)" if args.skip_baseline else None)
    if baseline_row:
        rows.append(baseline_row)

    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return {"meta": meta, "rows": rows}


def _measured(rows: list[dict], n: int, name: str, measure, *, skipped: str | None):
    """Row n's measurement: None, with a note row, when `skipped` says why; None, with an error row,
    when it raises (a failed row must not cost the others); else what `measure()` returns."""
    if skipped:
        rows.append({"n": n, "row": name, "notes": skipped})
        return None
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001
        rows.append(_error_row(n, name, exc))
        return None


def _free(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _e2e_row(summary: dict, seq_len: int, target_rate: dict, drafter_rate: dict, topology) -> dict:
    t, d = topology.num_targets, topology.num_drafters
    steady = summary["steady_tokens_per_s"]
    bound = None
    if seq_len in target_rate and seq_len in drafter_rate:
        bound = min(target_rate[seq_len] * t, drafter_rate[seq_len] * d)
    efficiency = steady / bound if bound else None
    compiles = summary.get("compiles", {})
    return {"n": 4, "row": f"end to end {topology.spec}", "seq_len": seq_len, "tokens_per_s": steady,
            "ms_per_step": 1e3 * seq_len * d / steady if steady else None,
            "pipeline_efficiency": efficiency, "stage_bound_tokens_per_s": bound,
            "target_idle_fraction": summary["target_idle_fraction"],
            "drafter_idle_fraction": summary["drafter_idle_fraction"],
            "channel_gb_per_s": summary["channel_gb_per_s"], "compiles_per_drafter": compiles,
            "compile_s_per_drafter": summary.get("compile_s", {}),
            "overall_tokens_per_s": summary["tokens_per_s"], "steps": summary["steps"], "wall_s": summary["wall_s"],
            "first_loss": summary.get("first_loss"), "last_loss": summary.get("last_loss"), "summary": summary,
            "notes": f"efficiency {fmt(efficiency, '.2f')}, idle target {summary['target_idle_fraction']:.0%} "
                     f"drafter {summary['drafter_idle_fraction']:.0%}, channel {summary['channel_gb_per_s']:.2f} GB/s, "
                     f"compiles {dict(compiles)}, compile s "
                     f"{ {r: round(v, 1) for r, v in summary.get('compile_s', {}).items() if v is not None} }"}


def _balance_row(seq_len: int, target_rate: float, drafter_rate: float, node_gpus: int) -> dict:
    here = balance_advice(target_rate, drafter_rate, node_gpus)
    eight = balance_advice(target_rate, drafter_rate, 8)
    return {"n": 5, "row": "balance", "seq_len": seq_len, "tokens_per_s": here[2],
            "advice": {str(node_gpus): f"t{here[0]}d{here[1]}", "8": f"t{eight[0]}d{eight[1]}"},
            "tokens_per_s_8_gpus": eight[2],
            "notes": f"{node_gpus} GPUs: t{here[0]}d{here[1]} ({here[2]:.0f} tok/s); 8 GPUs: t{eight[0]}d{eight[1]} "
                     f"({eight[2]:.0f} tok/s); target:drafter per-GPU rate {target_rate / drafter_rate:.2f}"}


def _baseline_spec(args, dcfg, target_dir: Path, cfg, num_gpus: int, cuda: bool) -> dict:
    import dataclasses
    if not cuda:
        target_device, devices = "cpu", ["cpu", "cpu"]
    elif num_gpus >= 3:
        target_device, devices = "cuda:0", [f"cuda:{i}" for i in range(1, num_gpus)]
    else:  # two threads on one GPU: they compile concurrently, as in the incident
        target_device, devices = "cuda:0", [f"cuda:{num_gpus - 1}"] * 2
    backend = args.baseline_backend if args.baseline_backend != "auto" else ("flex" if cuda else "sdpa")
    return {"target_dir": str(target_dir), "drafter_config": dataclasses.asdict(dcfg), "seq_len": args.e2e_seq,
            "num_anchors": args.anchors, "chunk_blocks": int(cfg.drafter.chunk_blocks),
            "items_per_thread": args.baseline_steps, "target_device": target_device, "drafter_devices": devices,
            "backend": backend, "fx_noise": args.fx_noise, "timeout_s": max(30.0, args.baseline_timeout - 60),
            "seed": 0, "lr": float(cfg.optim.lr)}


def _baseline_row(result: dict, e2e_row: dict | None) -> dict:
    kinds = "; ".join(f"{n}x {k[:90]}" for k, n in list(result["failure_kinds"].items())[:3])
    versus = ""
    if e2e_row and e2e_row.get("tokens_per_s"):
        versus = f", process design {e2e_row['tokens_per_s']:.0f} tok/s"
    note = (f"{result['threads']} threads on {','.join(sorted(set(result['drafter_devices'])))}, {result['backend']}"
            f"{', fx-noise' if result['fx_noise'] else ''}: "
            f"{result['steps_done']}/{result['steps_attempted']} steps ok, "
            f"{result['failures']} failed, {result['target_failures']} target forwards failed{versus}"
            + (f" [{kinds}]" if kinds else "")
            + (" (sdpa, no FX noise: nothing compiled, 0 failures expected)"
               if result["backend"] == "sdpa" and not result["fx_noise"] else ""))
    return {"n": 6, "row": "thread baseline", "seq_len": result["seq_len"],
            "tokens_per_s": result["steady_tokens_per_s"],
            **{k: result[k] for k in ("threads", "steps_done", "steps_attempted", "failures", "failure_kinds",
                                      "target_failures", "target_failure_kinds", "hung_threads", "fx_traces",
                                      "wall_s", "backend", "fx_noise", "per_thread")},
            "overall_tokens_per_s": result["tokens_per_s"], "notes": note}


def main(argv=None) -> None:
    from launcher.config import ConfigError
    args = parse_args(argv)
    out = Path(args.out) if args.out else default_out()
    try:
        report = run(args)
    except ConfigError as exc:
        raise SystemExit(f"launcher.bench: {exc}") from None
    table = format_table(report["rows"])
    report["table"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    progress(f"wrote {out}")
    print(table, flush=True)


if __name__ == "__main__":
    main()
