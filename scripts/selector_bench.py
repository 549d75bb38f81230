"""Time DFlash 2's two costs of issue 43 (item 6) at a training step's shape, on one CUDA GPU: each drafted
slot's top-K over the full vocabulary (the selector's candidates) and the codebooks' gradient (the figures:
docs/perf_notes.md, "DFlash 2's candidates and codebook gradient").

    python scripts/selector_bench.py OUT_DIR [--shape qwen3-8b] [--rows 1]

The shape: --shape's vocabulary (dflash_core.target.shapes), the drafter's defaults (launcher.config.schema:
512 anchors x block 16, chunks of 128 blocks, selector rank 256, top-16) and --rows packed rows per
micro-batch (1: the Qwen3-8B recipe's). A step drafts rows x anchors x (block - 1) slots. head_loss takes
the top-K chunk by chunk, over [rows x chunk_blocks x (block - 1), V] bf16 logits; the selector reads one
predecessor row and K + 1 successor rows (the top-K, then the label) of the codebooks per slot.

Each sample is one step's calls queued back to back behind a short device-side sleep (so that the host has
queued them before the first event fires, as a training step keeps the device ahead of the host), timed
with CUDA events; the median of --reps samples after --warmup. Rows:
  topk            torch.topk over each chunk's logits (what head_loss ran before)
  segmented_W     dflash_core.drafter.selector.segmented_topk, segments of W entries (head_loss's: W = 128)
  survivors_W     the other two-stage top-k: the top-K within each segment of W, then over the survivors
  indexing        both codebooks' rows by advanced indexing, and its backward (a sort of the ids)
  codebook_rows   both by dflash_core.drafter.selector.CodebookRows (an index_add_ backward)
The codebook rows run at each dtype of --codebook-dtypes (the trainer's GPU codebooks are bf16) and with the
ids drawn uniformly and Zipf-like (p ~ 1 / (id + 1): frequent tokens fill most slots). The logits are bf16
draws of N(0, 4).
Checks: each top-k's values against torch.topk's and the share of rows with torch.topk's id set (rows
differ only at ties across the K-th place, which bf16 logits have), and the largest codebook gradient
difference relative to the largest gradient entry.
Writes OUT_DIR/selector_bench.json and prints a table; well under a minute of GPU time.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_core.drafter.selector import CodebookRows, segmented_topk  # noqa: E402
from dflash_core.target.shapes import SHAPES  # noqa: E402
from launcher.config.schema import DrafterSettings  # noqa: E402

SLEEP_CYCLES = 2_000_000   # ~1 ms at H100 clocks: longer than the host takes to queue one step's calls


def _arguments(argv=None) -> argparse.Namespace:
    defaults = DrafterSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--rows", type=int, default=1, help="packed rows per micro-batch")
    p.add_argument("--anchors", type=int, default=defaults.num_anchors)
    p.add_argument("--block-size", type=int, default=defaults.block_size)
    p.add_argument("--chunk-blocks", type=int, default=defaults.chunk_blocks)
    p.add_argument("--rank", type=int, default=defaults.selector_rank)
    p.add_argument("--top-k", type=int, default=defaults.selector_top_k)
    p.add_argument("--segment-widths", type=int, nargs="+", default=[32, 64, 128, 1187],
                   help="segmented_topk's; widths that do not divide the vocabulary are skipped")
    p.add_argument("--survivor-widths", type=int, nargs="+", default=[1187, 2374, 4748])
    p.add_argument("--codebook-dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=25)
    return p.parse_args(argv)


def _median_ms(step, warmup, reps) -> float:
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def survivor_topk(logits, k, width):
    """The top-K within each segment of `width` entries, then the top-K of those survivors."""
    segments = logits.unflatten(-1, (logits.shape[-1] // width, width))
    values, positions = segments.topk(k, dim=-1)
    best, picked = values.flatten(-2).topk(k, dim=-1)
    return best, (picked // k) * width + positions.flatten(-2).gather(-1, picked)


def _top_k_variants(args, vocab):
    """name -> (logits, k) -> (values, ids), for the widths that cut the vocabulary into at least K segments."""
    def splits(width):
        return vocab % width == 0 and vocab // width >= args.top_k

    variants = {"topk": lambda logits, k: tuple(logits.topk(k, dim=-1))}
    variants.update({f"segmented_{w}": (lambda logits, k, w=w: segmented_topk(logits, k, w))
                     for w in args.segment_widths if splits(w)})
    variants.update({f"survivors_{w}": (lambda logits, k, w=w: survivor_topk(logits, k, w))
                     for w in args.survivor_widths if splits(w) and w >= args.top_k})
    return variants


def time_top_k(args, vocab, slots_per_block) -> list[dict]:
    """Each variant over one step's chunks of logits, as head_loss calls it."""
    blocks = [min(args.chunk_blocks, args.anchors - start) for start in range(0, args.anchors, args.chunk_blocks)]
    chunk_rows = [args.rows * b * slots_per_block for b in blocks]
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(max(chunk_rows), vocab, device="cuda", generator=gen) * 2).bfloat16()
    want = logits.topk(args.top_k, dim=-1)
    results = []
    for name, top_k in _top_k_variants(args, vocab).items():
        values, ids = top_k(logits, args.top_k)
        same_ids = (ids.sort(dim=-1).values == want.indices.sort(dim=-1).values).all(-1)
        step_ms = _median_ms(lambda: [top_k(logits[:rows], args.top_k) for rows in chunk_rows], args.warmup,
                             args.reps)
        results.append({"name": name, "ms_per_step": step_ms, "ms_per_chunk": step_ms / len(chunk_rows),
                        "chunks": len(chunk_rows), "chunk_rows": chunk_rows[0],
                        "values_equal": bool(torch.equal(values, want.values)),
                        "rows_with_topks_ids": float(same_ids.float().mean())})
    return results


def _ids(distribution, vocab, count, gen):
    if distribution == "uniform":
        return torch.randint(0, vocab, (count,), device="cuda", generator=gen)
    weights = 1.0 / torch.arange(1, vocab + 1, device="cuda", dtype=torch.float32)
    return torch.multinomial(weights, count, replacement=True, generator=gen)


def time_codebooks(args, vocab, slots) -> list[dict]:
    """Both codebooks' rows and their gradient, one step's: a predecessor per slot, K + 1 successors."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    gathers = {"indexing": lambda codebook, ids: codebook[ids], "codebook_rows": CodebookRows.apply}
    results = []
    for dtype_name in args.codebook_dtypes:
        dtype = getattr(torch, dtype_name)
        codebooks = [torch.randn(vocab, args.rank, device="cuda", generator=gen).to(dtype).requires_grad_()
                     for _ in range(2)]
        for distribution in ("uniform", "zipf"):
            ids = [_ids(distribution, vocab, slots * width, gen).view(slots, width) for width in (1, args.top_k + 1)]
            upstream = [torch.randn(*i.shape, args.rank, device="cuda", generator=gen).to(dtype) for i in ids]

            def step(gather):
                rows = [gather(codebook, i) for codebook, i in zip(codebooks, ids)]
                return torch.autograd.grad(rows, codebooks, upstream)

            grads = {name: step(gather) for name, gather in gathers.items()}
            scale = max(float(g.abs().max()) for g in grads["indexing"])
            difference = max(float((a.float() - b.float()).abs().max())
                             for a, b in zip(grads["indexing"], grads["codebook_rows"]))
            for name, gather in gathers.items():
                results.append({"name": name, "dtype": dtype_name, "ids": distribution,
                                "ms_per_step": _median_ms(lambda: step(gather), args.warmup, args.reps),
                                "distinct_ids": [int(i.unique().numel()) for i in ids],
                                "relative_difference": difference / scale})
    return results


def _table(top_k, codebooks) -> str:
    lines = ["top-K over the chunks' logits: ms/chunk  ms/step  speed-up  values==topk  rows with topk's ids"]
    base = top_k[0]["ms_per_step"]
    lines += [f"  {r['name']:<16} {r['ms_per_chunk']:8.3f} {r['ms_per_step']:8.3f} {base / r['ms_per_step']:8.2f}x"
              f"  {str(r['values_equal']):<12} {r['rows_with_topks_ids']:.4f}" for r in top_k]
    lines.append("codebooks' rows and gradient:  ms/step  speed-up  relative gradient difference")
    for r in codebooks:
        base = next(b["ms_per_step"] for b in codebooks
                    if b["name"] == "indexing" and (b["dtype"], b["ids"]) == (r["dtype"], r["ids"]))
        lines.append(f"  {r['name']:<14} {r['dtype']:<8} {r['ids']:<7} {r['ms_per_step']:8.3f} "
                     f"{base / r['ms_per_step']:8.2f}x  {r['relative_difference']:.2e}")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = _arguments(argv)
    if not torch.cuda.is_available():
        sys.exit("scripts/selector_bench.py times CUDA kernels and found no CUDA device; run it on a GPU machine")
    vocab, slots_per_block = SHAPES[args.shape].config["vocab_size"], args.block_size - 1
    slots = args.rows * args.anchors * slots_per_block
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"name": args.shape, "vocab": vocab, "rows": args.rows, "anchors": args.anchors,
                        "block_size": args.block_size, "chunk_blocks": args.chunk_blocks, "rank": args.rank,
                        "top_k": args.top_k, "drafted_slots_per_step": slots},
              "top_k": time_top_k(args, vocab, slots_per_block),
              "codebooks": time_codebooks(args, vocab, slots)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "selector_bench.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}, {json.dumps(result['shape'])}")
    print(_table(result["top_k"], result["codebooks"]))


if __name__ == "__main__":
    main()
