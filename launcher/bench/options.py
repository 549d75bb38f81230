"""The command line of `python -m launcher.bench`: every option with its default on GPUs and with
--tiny, and the flags every command shares (launcher/cli.py)."""
from __future__ import annotations

import argparse

import torch

from dflash_core.target.shapes import SHAPES
from launcher.bench.mix import MODES
from launcher.bench.report import Row

DESCRIPTION = ("GPU benchmark harness: the matmul ceiling, then the target, drafter and end-to-end rows on full "
               "rows and on a length mix, the stage balance and the old design's thread baseline "
               "(launcher/bench/report.py, Row, lists them).")
GPU_DEFAULTS = dict(seq="2048,4096", steps=10, warmup=3, e2e_steps=40, baseline_steps=20, anchors=512,
                    e2e_timeout=240, baseline_timeout=200, mix_samples=2000)
TINY_DEFAULTS = dict(seq="64,128", steps=4, warmup=2, e2e_steps=8, baseline_steps=4, anchors=32,
                     e2e_timeout=150, baseline_timeout=120, mix_samples=160)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m launcher.bench", description=DESCRIPTION)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (automatic when CUDA is unavailable)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b",
                   help="target shape on GPUs (dflash_core/target/shapes.py)")
    p.add_argument("--e2e-topology", help="t<T>d<D> of the end-to-end runs (default t1d<G-1> on G GPUs)")
    p.add_argument("--seq", help="comma-separated sequence lengths of the full rows (default 2048,4096; tiny 64,128)")
    p.add_argument("--steps", type=int, help="timed steps per stage measurement (default 10; tiny 4)")
    p.add_argument("--warmup", type=int, help="untimed steps first (compiles happen here; default 3)")
    p.add_argument("--anchors", type=int, help="anchors per row (default 512; tiny 32)")
    p.add_argument("--e2e-steps", type=int, help="optimiser steps of each end-to-end run (default 40)")
    p.add_argument("--e2e-seq", type=int, help="sequence length of the full-row end-to-end run (default: the longest)")
    mix = p.add_argument_group(f"length-mix rows ({Row.MIX_TARGET:d}-{Row.MIX_BALANCE:d})")
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
    p.add_argument("--skip-fp8", action="store_true", help="no FP8 rows (the FP8 ceiling, the drafter in fp8)")
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


def answer_flags(argv: list[str]) -> list[str]:
    """The flags every command shares (launcher/cli.py): `--cfg job|all` prints the resolved
    benchmark options and the training overrides its drafter and end-to-end rows use, `--info`
    where they come from; both exit 0. `--help` is argparse's (every option, its default)."""
    import yaml
    if "--info" in argv:
        print("options: this command line over the defaults of launcher/bench/options.py (--help lists them); "
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
