"""GPU benchmark harness: `python -m launcher.bench` (or `make bench ARGS=...`).

Every row of launcher/bench/report.py's `Row`, measured in one run (random weights at the real
shapes; speed does not depend on them): the matmul ceiling; per sequence length the full rows
(every token real and supervised): target alone, drafter alone, end to end, their balance and the
thread baseline (drafters as threads of one process); at --mix-seq the length-mix rows (mix.py: --lengths FILE or the
built-in mix), padded and packed: target alone, drafter alone, end to end, their balance; where the
GPU has FP8 matmuls, the FP8 ceiling and the full drafter rows again in FP8 (option_rows.py).

Default: the Qwen3-8B shape (--shape: dflash_core/target/shapes.py), drafter=dflash5 (5 layers,
block 16, the spec's layer ids), 512 anchors, micro-batch 1, S = 2048 and 4096. `--tiny`
(automatic without CUDA): the tiny target's shapes and drafter=tiny, small S. Options:
launcher/bench/options.py. Prints progress as it goes and one table last; writes the same as JSON
(--out; default runs/bench-<time>.json).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from launcher.bench.ceiling import matmul_ceiling, plausible_peak, usable_ceiling
from launcher.bench.inputs import write_bench_target, write_mix_conversations, write_synthetic_data
from launcher.bench.mix import REFERENCE_LENGTH, builtin_mix, mix_batches, mix_from_file, synthesize_samples
from launcher.bench.option_rows import measure_fp8_ceiling, measure_fp8_drafter
from launcher.bench.options import answer_flags, parse_args
from launcher.bench.report import Row, format_table
from launcher.bench.rows import balance_rows, baseline_row, e2e_row, load_stage_rates, measured, stage_rates
from launcher.bench.session import Bench
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

if TYPE_CHECKING:
    from launcher.job import Job


def run(args) -> dict:
    """Every row, in table order but for the balance rows (they need both stages' rates) and the
    thread baseline (it compares itself with the full-row end-to-end row)."""
    bench = _set_up(args)
    job = _drafter_job(bench)
    meta = _meta(bench, job)
    ceiling = _measure_ceiling(bench)
    fp8_ceiling = measure_fp8_ceiling(bench, *_ceiling_peak(args, bench.device_name, bench.cuda))
    full, mixes, mix_info = _workloads(bench, job)
    if mix_info:
        meta["mix"] = mix_info
    # A drafter set to FP8 (--set drafter.matmul_precision=fp8) is held to the FP8 ceiling, as row 12 is.
    drafter_ceiling = fp8_ceiling if job.step.matmul_precision == "fp8" else ceiling
    rates = _measure_stages(bench, job, full, mixes, ceiling, drafter_ceiling)
    measure_fp8_drafter(bench, full, fp8_ceiling)
    full_e2e = None if args.mix_only else _measure_e2e(bench, "full", rates)
    bench.rows += _balance_rows(bench, rates)
    if not args.mix_only:
        _measure_baseline(bench, job, full_e2e)
    for mode in [] if args.no_mix else args.modes:
        _measure_e2e(bench, mode, rates)
    if not args.work_dir:
        shutil.rmtree(bench.work, ignore_errors=True)
    return {"meta": meta, "rows": sorted(bench.rows, key=lambda r: r["n"])}


# ------------------------------------------------------------------------------ set-up
def _set_up(args) -> Bench:
    """The device, the scratch dir, the bench target (its shape's config, a tokenizer) and the full
    rows' synthetic data."""
    cuda = torch.cuda.is_available() and not args.tiny
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    num_gpus = torch.cuda.device_count() if cuda else 0
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    progress(f"torch {torch.__version__}, device {device_name}, {num_gpus} GPU(s), "
             f"{'tiny' if args.tiny else args.shape} shapes, S={args.seqs}, mix S={args.mix_seq}, work dir {work}")
    tokenizer_src = _tokenizer_source(args)
    target_dir = write_bench_target(work / "target", _tiny_shape(tokenizer_src) if args.tiny else args.shape,
                                    tokenizer_src)
    data_path = work / "data.jsonl"
    data_info = None if args.mix_only else write_synthetic_data(data_path, target_dir, max(args.seqs + [args.e2e_seq]))
    return Bench(args, torch.device("cuda", 0) if cuda else torch.device("cpu"), device_name, num_gpus, work,
                 target_dir, data_path, data_info)


def _drafter_job(bench: Bench) -> Job:
    """The job of the stage rows' one drafter rank, for the longest row of any of them. It compiles
    into the cache dir of the end-to-end runs' first drafter, on cuda:0 (each launched process sees
    its own GPU as cuda:0, and inductor's graph keys name the index), so those runs start warm."""
    from launcher.config import compose_config
    from launcher.distributed.isolation import isolate
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve

    args = bench.args
    cfg = compose_config(bench.overrides(bench.data_path, max(args.seqs + [args.mix_seq]), args.warmup + args.steps))
    isolate("drafter", bench.e2e_topology.num_targets, 1, bench.work / "compile_cache", bench.device,
            cfg.isolation.recompile_limit, cfg.isolation.compile_threads)
    # Tiny shapes on cores other jobs share: more threads only spin (docs/perf_notes.md, "Figures the code quoted").
    if args.tiny:
        torch.set_num_threads(1)
    return resolve(cfg, Topology(num_targets=0, num_drafters=1), bench.device)


def _meta(bench: Bench, job: Job) -> dict:
    args, dcfg = bench.args, job.drafter
    return {"torch": torch.__version__, "device": bench.device_name, "num_gpus": bench.num_gpus, "tiny": args.tiny,
            "shape_name": bench.shape_name, "seqs": args.seqs, "mix_seq": args.mix_seq, "anchors": args.anchors,
            "shape": job.target.hf_config.to_dict(),
            "drafter": {"num_layers": dcfg.num_hidden_layers, "block_size": dcfg.block_size,
                        "target_layer_ids": dcfg.target_layer_ids, "mask_token_id": dcfg.mask_token_id,
                        "backend": job.step.backend},
            "data": bench.data_info, "args": {k: v for k, v in vars(args).items() if k != "seqs"}}


# ------------------------------------------------------------------------------ inputs
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


def _prepare_mix(args, job: Job, work: Path):
    """The mix rows' lengths: the user's (--lengths) or the built-in mix, cut to --mix-seq, written
    as a conversation file for the end-to-end rows and read back as training reads it; the stage
    rows use that realised mix, so every mix row sees the same lengths."""
    from dflash_core.data import load_tokenizer

    kwargs = job.data.chat_template_kwargs
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


def _workloads(bench: Bench, job: Job) -> tuple[list[Workload], list[Workload], dict | None]:
    """(full-row workloads, length-mix workloads, what the mix is) of the stage rows."""
    from dflash_core.data import load_tokenizer

    args = bench.args
    id_limit = min(job.drafter.mask_token_id, 1024)
    full = [] if args.mix_only else [full_row_workload(seq_len, id_limit, args.anchors) for seq_len in args.seqs]
    mixes, mix_info = [], None
    if not args.no_mix:
        realised, mix_info = _prepare_mix(args, job, bench.work)
        tokenizer = load_tokenizer(job.tokenizer_dir)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        samples = synthesize_samples(realised, id_limit=id_limit)
        for mode in args.modes:
            rows = mix_batches(samples, mode=mode, seq_len=args.mix_seq, count=args.warmup + args.steps,
                               pad_token_id=pad, num_anchors=args.anchors)
            mixes.append(mix_workload(rows, args.mix_seq))
    if args.profile and (full or mixes):
        (full or mixes)[-1].profile = str(Path(args.out).with_suffix(".trace.json.gz"))
    return full, mixes, mix_info


# ------------------------------------------------------------------------------ the rows
def _measure_ceiling(bench: Bench) -> float | None:
    """The ceiling row; its MFU denominator, or None when the row is implausible."""
    progress(f"row {Row.CEILING:d}: matmul ceiling")
    peak, peak_source = _ceiling_peak(bench.args, bench.device_name, bench.cuda)
    row = {"n": Row.CEILING, **matmul_ceiling(bench.device, tiny=bench.args.tiny, peak=peak, peak_source=peak_source)}
    bench.rows.append(row)
    progress(f"matmul ceiling {row['tflops']:.1f} TFLOP/s: {row['notes']}")
    return usable_ceiling(row)


def _measure_stages(bench: Bench, job: Job, full: list[Workload], mixes: list[Workload], ceiling,
                    drafter_ceiling) -> dict:
    """The target-alone and drafter-alone rows, full and mix, and the stage rates they give (over
    --stage-rates' where both have one); MFU against `ceiling` and `drafter_ceiling`."""
    args, target = bench.args, job.target
    measure_target = partial(target_stage, target.hf_config, job.drafter.target_layer_ids, bench.device, target.dtype,
                             warmup=args.warmup, reps=args.steps, ceiling=ceiling,
                             compiled=job.compile.target_compiled, attention=target.attention,
                             full_forward=not args.skip_full_forward)
    target_rows = _stage_rows(bench, (Row.TARGET, Row.MIX_TARGET), "target alone", measure_target, full, mixes,
                              "skipped (--skip-target)" if args.skip_target else None)
    _free(bench.device)
    measure_drafter = partial(drafter_stage, job, work=bench.work, warmup=args.warmup, steps=args.steps,
                              ceiling=drafter_ceiling)
    drafter_rows = _stage_rows(bench, (Row.DRAFTER, Row.MIX_DRAFTER), "drafter alone", measure_drafter, full, mixes,
                               "skipped (--skip-drafter)" if args.skip_drafter else None)
    _free(bench.device)
    earlier = load_stage_rates(Path(args.stage_rates)) if args.stage_rates else {}
    return {**earlier, **stage_rates(target_rows + drafter_rows)}


def _stage_rows(bench: Bench, numbers: tuple[Row, Row], name: str, measure, full, mixes, skipped) -> list[dict]:
    """One stage measured over the full-row and mix workloads at once (one model build, one
    compile); its rows numbered by mode: (full row, mix row) = `numbers`."""
    full_row, mix_row = numbers
    measured_rows = measured(bench.rows, full_row if full else mix_row, name, measure, full + mixes,
                             skipped=skipped) or []
    numbered = [{"n": full_row if r["mode"] == "full" else mix_row, **r} for r in measured_rows]
    bench.rows += numbered
    return numbered


def _measure_e2e(bench: Bench, mode: str, rates: dict) -> dict | None:
    """An end-to-end row: the launcher on the full rows' data (mode "full") or on the mix's
    conversation file, padded or packed; the stage rates judge its pipeline efficiency."""
    n, name = (Row.E2E, "end to end, full rows") if mode == "full" else (Row.MIX_E2E, f"end to end, {mode} mix")
    return bench.record(n, name, _e2e_row, bench, n, mode, rates, skipped=_e2e_skipped(bench))


def _e2e_skipped(bench: Bench) -> str | None:
    # One GPU runs the end-to-end rows only when asked for (--e2e-topology): its ranks share the GPU over
    # gloo, which says nothing of pipeline efficiency but does time start-up and compiling.
    if bench.args.skip_e2e:
        return "skipped (--skip-e2e)"
    if bench.processes < 2 and not bench.args.e2e_topology:
        return f"skipped: needs >= 2 GPUs, found {bench.num_gpus}"
    return None


def _e2e_row(bench: Bench, n: Row, mode: str, rates: dict) -> dict:
    args, topology = bench.args, bench.e2e_topology
    if mode == "full":
        data, seq_len, packing = bench.data_path, args.e2e_seq, []
    else:
        packing = [f"data.packing={str(mode == 'packed').lower()}"]
        data, seq_len = bench.work / "mix.jsonl", args.mix_seq
    progress(f"end to end, {mode}: {topology.spec} on {bench.processes} {'GPUs' if bench.cuda else 'CPU processes'}, "
             f"S={seq_len}, {args.e2e_steps} steps")
    summary = e2e_stage(bench.overrides(data, seq_len, args.e2e_steps, *packing), topology=topology, work=bench.work,
                        tiny=args.tiny, timeout_s=args.e2e_timeout, name=f"e2e-{mode}")
    return e2e_row(n, summary, seq_len, mode, rates, topology)


def _balance_rows(bench: Bench, rates: dict) -> list[dict]:
    """The split advice of the full rows and of the mix rows, for this node and for 8 GPUs."""
    node_gpus = max(bench.processes, 2)
    full = {key: rate for key, rate in rates.items() if key[1] == "full"}
    mix = {key: rate for key, rate in rates.items() if key[1] != "full"}
    return (balance_rows(Row.BALANCE, full, node_gpus, bench.shape_name)
            + balance_rows(Row.MIX_BALANCE, mix, node_gpus, bench.shape_name))


def _measure_baseline(bench: Bench, job: Job, full_e2e: dict | None) -> None:
    bench.record(Row.BASELINE, "thread baseline", _baseline_row, bench, job, full_e2e,
                 skipped="skipped (--skip-baseline)" if bench.args.skip_baseline else None)


def _baseline_row(bench: Bench, job: Job, full_e2e: dict | None) -> dict:
    args = bench.args
    progress(f"row {Row.BASELINE:d}: thread baseline (drafters as threads), S={args.e2e_seq}")
    first_drafter_cache = bench.work / "compile_cache" / f"drafter{bench.e2e_topology.num_targets}"
    result = baseline_stage(_baseline_spec(bench, job), work=bench.work, tiny=args.tiny,
                            timeout_s=args.baseline_timeout,
                            cache_dir=None if args.baseline_cold_cache else first_drafter_cache)
    return baseline_row(result, full_e2e)


def _baseline_spec(bench: Bench, job: Job) -> dict:
    args, num_gpus = bench.args, bench.num_gpus
    if not bench.cuda:
        target_device, devices = "cpu", ["cpu", "cpu"]
    elif num_gpus >= 3:
        target_device, devices = "cuda:0", [f"cuda:{i}" for i in range(1, num_gpus)]
    else:  # two threads on one GPU: they compile concurrently, as in the incident
        target_device, devices = "cuda:0", [f"cuda:{num_gpus - 1}"] * 2
    backend = args.baseline_backend if args.baseline_backend != "auto" else ("flex" if bench.cuda else "sdpa")
    return {"target_dir": str(bench.target_dir), "drafter_config": dataclasses.asdict(job.drafter),
            "seq_len": args.e2e_seq, "num_anchors": args.anchors, "chunk_blocks": job.step.chunk_blocks,
            "items_per_thread": args.baseline_steps, "target_device": target_device, "drafter_devices": devices,
            "backend": backend, "fx_noise": args.fx_noise, "timeout_s": max(30.0, args.baseline_timeout - 60),
            "seed": 0, "lr": job.optim.lr}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def default_out() -> Path:
    return REPO / "runs" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


def main(argv=None) -> None:
    from launcher.config import ConfigError
    args = parse_args(answer_flags(sys.argv[1:] if argv is None else list(argv)))
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
