"""GPU benchmark harness: `python -m launcher.bench` (or `make bench ARGS=...`).

Rows, all measured in one run (random weights at the real shapes; speed does not depend on them):
  1. matmul ceiling     bf16 8192^3 (CPU: fp32 1024^3), back-to-back products between device
                        synchronisations, checked against the device's plausible peak (ceiling.py):
                        the MFU denominator, or none (MFU '-') when it is implausible
  Full rows (every token real and supervised), per sequence length:
  2. target alone       the frozen target's capture() on one GPU, with its family's kernel notes
  3. drafter alone      the real step (DrafterTrainer.train_step) fed from memory
  4. end to end         the real launcher under torchrun, t1d<G-1>, from its summary.json
  5. balance            the T:D split that keeps both stages busy (this node and 8 GPUs)
  6. thread baseline    the old one-process, thread-per-drafter design (thread_baseline.py)
  Length-mix rows (mix.py: --lengths FILE or the built-in mix), padded and packed, at --mix-seq:
  7. target alone       the same capture on the mix's real micro-batches: real tokens/s, padding
  8. drafter alone      supervised blocks/s (valid anchors per second), anchor_fill, compiles
  9. end to end         the launcher on a conversation file realising the mix (its own tokenisation
                        and packing): blocks/s per drafter GPU, real target tokens/s per GPU,
                        anchor_fill, padding, compiles, pipeline efficiency against rows 7 and 8
  10. balance           the split advice from rows 7 and 8

Default: the Qwen3-8B shape (--shape: qwen3-27b, qwen3.5-35b-a3b, llama3-8b too), drafter=dflash5
(5 layers, block 16, the spec's layer ids), 512 anchors, micro-batch 1, S = 2048 and 4096.
`--tiny` (automatic without CUDA): the tiny target's shapes and drafter=tiny, small S.
Prints progress as it goes and one table last; writes the same as JSON (--out, default
$OUT/bench.json or runs/bench-<time>.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from launcher.bench.ceiling import matmul_ceiling, plausible_peak, usable_ceiling
from launcher.bench.counts import MASK_TOKEN_IDS, SHAPES
from launcher.bench.inputs import run_overrides, write_bench_target, write_mix_conversations, write_synthetic_data
from launcher.bench.mix import MODES, REFERENCE_LENGTH, builtin_mix, mix_batches, mix_from_file, synthesize_samples
from launcher.bench.report import format_table
from launcher.bench.rows import balance_rows, baseline_row, e2e_row, load_stage_rates, measured, stage_rates
from launcher.bench.stages import (
    REPO,
    Workload,
    baseline_stage,
    drafter_stage,
    e2e_stage,
    full_row_workload,
    mix_workload,
    progress,
    target_stage,
)

GPU_DEFAULTS = dict(seq="2048,4096", steps=10, warmup=3, e2e_steps=40, baseline_steps=20, anchors=512,
                    e2e_timeout=240, baseline_timeout=200, mix_samples=2000)
TINY_DEFAULTS = dict(seq="64,128", steps=4, warmup=2, e2e_steps=8, baseline_steps=4, anchors=32,
                     e2e_timeout=150, baseline_timeout=120, mix_samples=160)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launcher.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (automatic when CUDA is unavailable)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="target shape on GPUs")
    p.add_argument("--e2e-topology", help="t<T>d<D> of the end-to-end runs (default t1d<G-1> on G GPUs)")
    p.add_argument("--seq", help="comma-separated sequence lengths of the full rows (default 2048,4096; tiny 64,128)")
    p.add_argument("--steps", type=int, help="timed steps per stage measurement (default 10; tiny 4)")
    p.add_argument("--warmup", type=int, help="untimed steps first (compiles happen here; default 3)")
    p.add_argument("--anchors", type=int, help="anchors per row (default 512; tiny 32)")
    p.add_argument("--e2e-steps", type=int, help="optimiser steps of each end-to-end run (default 40)")
    p.add_argument("--e2e-seq", type=int, help="sequence length of the full-row end-to-end run (default: the longest)")
    mix = p.add_argument_group("length-mix rows (7-10)")
    mix.add_argument("--lengths", metavar="FILE", help="take prompt and answer lengths from this dataset, rendered "
                                                       "and tokenised as training does with the bench target's "
                                                       "tokenizer (--tokenizer); default: the built-in mix")
    mix.add_argument("--mix-samples", type=int, help="conversations drawn from the mix (default 2000; tiny 160)")
    mix.add_argument("--mix-seq", type=int, help="row length of the mix rows (default: the longest --seq)")
    mix.add_argument("--modes", default=",".join(MODES), help="comma-separated: padded, packed (default both)")
    mix.add_argument("--mix-only", action="store_true", help="only the ceiling and the length-mix rows")
    mix.add_argument("--no-mix", action="store_true", help="no length-mix rows")
    mix.add_argument("--stage-rates", metavar="JSON", help="stage rates of an earlier bench JSON, for end-to-end "
                                                           "rows run without their stage rows (pipeline efficiency)")
    p.add_argument("--peak-tflops", type=float, help="plausible peak of the ceiling check (default: the device's "
                                                     "spec-sheet bf16 rate; none known on CPU: unchecked)")
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
                   help="profile two drafter steps (the longest full row, else the last mix mode): kernel table, "
                        "time per kernel category, compile times, and a Chrome trace beside --out (.trace.json.gz)")
    p.add_argument("--skip-target", action="store_true")
    p.add_argument("--skip-drafter", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--skip-baseline", action="store_true")
    p.add_argument("--skip-full-forward", action="store_true", help="target rows: no untruncated-model comparison")
    p.add_argument("--e2e-timeout", type=float)
    p.add_argument("--baseline-timeout", type=float)
    p.add_argument("--out", help="JSON output path")
    p.add_argument("--work-dir", help="scratch dir (bench target, data, runs, compile cache); kept when given")
    p.add_argument("--tokenizer", help="dir of the tokenizer to copy (default: build/reuse .cache/tiny-qwen3)")
    args = p.parse_args(argv)
    args.tiny = args.tiny or not torch.cuda.is_available()
    for key, value in (TINY_DEFAULTS if args.tiny else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seqs = [int(s) for s in str(args.seq).split(",") if s]
    args.e2e_seq = args.e2e_seq or max(args.seqs)
    args.mix_seq = args.mix_seq or max(args.seqs)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes {','.join(args.modes)!r}: choose from {', '.join(MODES)}")
    if args.mix_only and args.no_mix:
        p.error("--mix-only and --no-mix exclude each other")
    return args


def default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "bench.json"
    return REPO / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _tokenizer_source(args) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    from dflash_core.target.tiny import build_tiny_target
    return build_tiny_target(REPO / ".cache" / "tiny-qwen3")


def _tiny_shape(tokenizer_src: Path) -> dict:
    from transformers import AutoConfig

    from dflash_core.target.tiny import MODEL_SHAPE
    vocab = AutoConfig.from_pretrained(tokenizer_src).vocab_size if (tokenizer_src / "config.json").is_file() else 1088
    return {**MODEL_SHAPE, "vocab_size": vocab}


def _ceiling_peak(args, device_name: str, cuda: bool) -> tuple[float | None, str]:
    if args.peak_tflops is not None:
        return args.peak_tflops, f"--peak-tflops on {device_name}"
    if not cuda:
        return None, f"{device_name}: no plausible peak known (--peak-tflops sets one)"
    peak = plausible_peak(device_name)
    return peak, device_name if peak is not None else f"{device_name}: no plausible peak known (--peak-tflops)"


def _prepare_mix(args, job, work: Path):
    """The mix rows' lengths: the user's (--lengths) or the built-in mix, cut to --mix-seq, written
    as a conversation file for the end-to-end rows and read back as training reads it; the stage
    rows use that realised mix, so every mix row sees the same lengths."""
    from omegaconf import OmegaConf

    from dflash_core.data import load_tokenizer

    kwargs = OmegaConf.to_container(job.cfg.data.chat_template_kwargs)
    if args.lengths:
        nominal = mix_from_file(args.lengths, load_tokenizer(job.tokenizer_dir), max_length=args.mix_seq,
                                count=args.mix_samples, chat_template_kwargs=kwargs)
    else:
        nominal = builtin_mix(args.mix_samples, scale=args.mix_seq / REFERENCE_LENGTH if args.tiny else 1.0)
    nominal = nominal.capped(args.mix_seq)
    realised, info = write_mix_conversations(work / "mix.jsonl", nominal, job.tokenizer_dir, max_length=args.mix_seq,
                                             chat_template_kwargs=kwargs)
    info.update(nominal=nominal.describe(), realised=realised.describe())
    progress(f"length mix {nominal.source}: {info['conversations']} conversations, median prompt "
             f"{info['realised']['median_prompt']:.0f} / answer {info['realised']['median_answer']:.0f} tokens, "
             f"{info['mismatched']} not realised exactly by the chat template (max error {info['max_token_error']})")
    return realised, info


def _workloads(args, job, work: Path, meta: dict) -> tuple[list[Workload], list[Workload]]:
    """(full-row workloads, length-mix workloads) of the stage rows."""
    from dflash_core.data import load_tokenizer

    id_limit = min(job.drafter.mask_token_id, 1024)
    full = [] if args.mix_only else [full_row_workload(seq_len, id_limit, args.anchors) for seq_len in args.seqs]
    mixes = []
    if not args.no_mix:
        realised, meta["mix"] = _prepare_mix(args, job, work)
        tokenizer = load_tokenizer(job.tokenizer_dir)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        samples = synthesize_samples(realised, id_limit=id_limit)
        for mode in args.modes:
            rows = mix_batches(samples, mode=mode, seq_len=args.mix_seq, count=args.warmup + args.steps,
                               pad_token_id=pad, num_anchors=args.anchors)
            mixes.append(mix_workload(rows, args.mix_seq))
    if args.profile and (full or mixes):
        (full or mixes)[-1].profile = str(Path(args.out).with_suffix(".trace.json.gz"))
    return full, mixes


def _stage_rows(rows: list[dict], n_full: int, n_mix: int, name: str, measure, full, mixes, skipped) -> list[dict]:
    """Measure one stage over the full-row and mix workloads at once (one model build, one
    compile); number its rows n_full or n_mix."""
    measured_rows = measured(rows, n_full if full else n_mix, name, lambda: measure(full + mixes),
                             skipped=skipped) or []
    numbered = [{"n": n_full if r["mode"] == "full" else n_mix, **r} for r in measured_rows]
    rows += numbered
    return numbered


def run(args) -> dict:
    from launcher.config import compose_config
    from launcher.distributed.isolation import isolate
    from launcher.distributed.topology import Topology, parse_topology
    from launcher.resolve import resolve

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    num_gpus = torch.cuda.device_count() if cuda else 0
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    procs = 2 if not cuda else num_gpus
    e2e_topology = parse_topology(args.e2e_topology or f"t1d{max(procs - 1, 1)}",
                                  None if args.e2e_topology and procs < 2 else max(procs, 2), 1)
    shape_name = "tiny" if args.tiny else args.shape
    progress(f"torch {torch.__version__}, device {device_name}, {num_gpus} GPU(s), {shape_name} shapes, "
             f"S={args.seqs}, mix S={args.mix_seq}, work dir {work}")

    tokenizer_src = _tokenizer_source(args)
    target_dir = write_bench_target(work / "target", _tiny_shape(tokenizer_src) if args.tiny else args.shape,
                                    tokenizer_src)
    data_path = work / "data.jsonl"
    data_info = None if args.mix_only else write_synthetic_data(data_path, target_dir, max(args.seqs + [args.e2e_seq]))
    over = dict(target_dir=target_dir, tiny=args.tiny, anchors=args.anchors, work=work,
                mask_token_id=MASK_TOKEN_IDS.get(args.shape, "auto"))
    extra = ([] if cuda else ["run.device=cpu"]) + list(args.overrides)   # --tiny on a GPU stays on the CPU
    cfg = compose_config(run_overrides(data_path=data_path, seq_len=max(args.seqs + [args.mix_seq]),
                                       steps=args.warmup + args.steps, **over) + extra)
    # The drafter stage compiles into the cache dir of the end-to-end runs' first drafter, on cuda:0 (each
    # launched process sees its own GPU as cuda:0, and inductor's graph keys name the index), so those
    # runs start warm.
    first_drafter = e2e_topology.num_targets
    isolate("drafter", first_drafter, 1, work / "compile_cache", device, cfg.isolation.recompile_limit,
            cfg.isolation.compile_threads)
    if args.tiny:   # tiny shapes on cores other jobs share: more threads only spin (50x slower on 2 busy cores)
        torch.set_num_threads(1)
    job = resolve(cfg, Topology(num_targets=0, num_drafters=1), device)   # one drafter rank
    dcfg, hf_config = job.drafter, job.target.hf_config
    meta = {"torch": torch.__version__, "device": device_name, "num_gpus": num_gpus, "tiny": args.tiny,
            "shape_name": shape_name, "seqs": args.seqs, "mix_seq": args.mix_seq, "anchors": args.anchors,
            "shape": hf_config.to_dict(),
            "drafter": {"num_layers": dcfg.num_hidden_layers, "block_size": dcfg.block_size,
                        "target_layer_ids": dcfg.target_layer_ids, "mask_token_id": dcfg.mask_token_id,
                        "backend": job.step.backend},
            "data": data_info, "args": {k: v for k, v in vars(args).items() if k != "seqs"}}
    rows: list[dict] = []

    progress("row 1: matmul ceiling")
    peak, peak_source = _ceiling_peak(args, device_name, cuda)
    ceiling_row = {"n": 1, **matmul_ceiling(device, tiny=args.tiny, peak=peak, peak_source=peak_source)}
    rows.append(ceiling_row)
    ceiling = usable_ceiling(ceiling_row)
    progress(f"matmul ceiling {ceiling_row['tflops']:.1f} TFLOP/s: {ceiling_row['notes']}")

    full, mixes = _workloads(args, job, work, meta)
    target_rows = _stage_rows(
        rows, 2, 7, "target alone",
        lambda workloads: target_stage(hf_config, dcfg.target_layer_ids, device, job.target.dtype, workloads,
                                       warmup=args.warmup, reps=args.steps, ceiling=ceiling,
                                       compiled=job.compile.target_compiled, attention=job.target.attention,
                                       full_forward=not args.skip_full_forward),
        full, mixes, "skipped (--skip-target)" if args.skip_target else None)
    _free(device)
    drafter_rows = _stage_rows(
        rows, 3, 8, "drafter alone",
        lambda workloads: drafter_stage(job, workloads, work=work, warmup=args.warmup, steps=args.steps,
                                        ceiling=ceiling),
        full, mixes, "skipped (--skip-drafter)" if args.skip_drafter else None)
    _free(device)
    rates = {**(load_stage_rates(Path(args.stage_rates)) if args.stage_rates else {}),
             **stage_rates(target_rows + drafter_rows)}

    # One GPU runs the end-to-end rows only when asked for (--e2e-topology): its ranks share the GPU over
    # gloo, which says nothing of pipeline efficiency but does time start-up and compiling.
    e2e_skipped = ("skipped (--skip-e2e)" if args.skip_e2e
                   else f"skipped: needs >= 2 GPUs, found {num_gpus}" if procs < 2 and not args.e2e_topology
                   else None)

    def measure_e2e(mode: str, data: Path, seq_len: int, packing: list[str]):
        progress(f"end to end, {mode}: {e2e_topology.spec} on {procs} {'GPUs' if cuda else 'CPU processes'}, "
                 f"S={seq_len}, {args.e2e_steps} steps")
        summary = e2e_stage(run_overrides(data_path=data, seq_len=seq_len, steps=args.e2e_steps, **over) + packing
                            + extra, topology=e2e_topology, work=work, tiny=args.tiny, timeout_s=args.e2e_timeout,
                            name=f"e2e-{mode}")
        return e2e_row(4 if mode == "full" else 9, summary, seq_len, mode, rates, e2e_topology)

    full_e2e = None
    if not args.mix_only:
        full_e2e = measured(rows, 4, "end to end, full rows", lambda: measure_e2e("full", data_path, args.e2e_seq, []),
                            skipped=e2e_skipped)
        rows += [full_e2e] if full_e2e else []
    node_gpus = max(procs, 2)
    rows += balance_rows(5, {k: v for k, v in rates.items() if k[1] == "full"}, node_gpus, shape_name)
    rows += balance_rows(10, {k: v for k, v in rates.items() if k[1] != "full"}, node_gpus, shape_name)

    if not args.mix_only:
        def measure_baseline():
            progress(f"row 6: thread baseline (old design), S={args.e2e_seq}")
            result = baseline_stage(_baseline_spec(args, dcfg, target_dir, cfg, num_gpus, cuda), work=work,
                                    tiny=args.tiny, timeout_s=args.baseline_timeout,
                                    cache_dir=None if args.baseline_cold_cache else work / "compile_cache" /
                                    f"drafter{first_drafter}")
            return baseline_row(result, full_e2e)
        baseline = measured(rows, 6, "thread baseline", measure_baseline,
                            skipped="skipped (--skip-baseline)" if args.skip_baseline else None)
        rows += [baseline] if baseline else []

    for mode in ([] if args.no_mix else args.modes):
        packing = [f"data.packing={str(mode == 'packed').lower()}"]
        row = measured(rows, 9, f"end to end, {mode} mix",
                       lambda: measure_e2e(mode, work / "mix.jsonl", args.mix_seq, packing), skipped=e2e_skipped)
        rows += [row] if row else []

    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return {"meta": meta, "rows": sorted(rows, key=lambda r: r["n"])}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _baseline_spec(args, dcfg, target_dir: Path, cfg, num_gpus: int, cuda: bool) -> dict:
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


def _answer_flags(argv: list[str]) -> list[str]:
    """The flags every command shares (launcher/cli.py): `--cfg job|all` prints the resolved
    benchmark options and the training overrides its drafter and end-to-end rows use, `--info`
    where they come from; both exit 0. `--help` is argparse's (every option, its default)."""
    import yaml
    if "--info" in argv:
        print("options: this command line over the defaults of launcher/bench/__main__.py (--help lists them); "
              "training overrides (--set): conf/ and launcher/config/schema.py, as for launcher.train")
        raise SystemExit(0)
    if "--cfg" in argv:
        at = argv.index("--cfg")
        if at + 1 >= len(argv) or argv[at + 1] not in ("job", "all"):
            raise SystemExit("launcher.bench: --cfg takes job or all")
        args = parse_args(argv[:at] + argv[at + 2:])
        print(yaml.safe_dump({k: v for k, v in vars(args).items()}, sort_keys=True), end="")
        raise SystemExit(0)
    return argv


def main(argv=None) -> None:
    from launcher.config import ConfigError
    args = parse_args(_answer_flags(sys.argv[1:] if argv is None else list(argv)))
    out = Path(args.out) if args.out else default_out()
    try:
        report = run(args)
    except (ConfigError, ValueError) as exc:   # bad settings or inputs (MixError, --stage-rates) are ValueErrors
        raise SystemExit(f"launcher.bench: {exc}") from None
    table = format_table(report["rows"])
    report["table"] = table
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    progress(f"wrote {out}")
    print(table, flush=True)


if __name__ == "__main__":
    main()
