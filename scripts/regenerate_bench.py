"""How fast `launcher.regenerate engine=hf` answers prompts on one GPU, against the decode floor.

    python scripts/regenerate_bench.py --out regenerate.json [--shape qwen3-8b --batches 16,64,256]
    python scripts/regenerate_bench.py --shape smollm2-135m --batches 64,512 --caches dynamic,static
    python scripts/regenerate_bench.py --shape smollm2-135m --batches 2048 --new-tokens 256 --ranks 1,2,4
    python scripts/regenerate_bench.py --shape smollm2-135m --batches 1024,4096 --new-tokens 64 --caches continuous
    python scripts/regenerate_bench.py --shape smollm2-135m --batches 2048,4096 --new-tokens 256 --caches dynamic,loop

The model is the target's full shape with random weights (no checkpoint is read; speed does not
depend on weight values, and random weights never emit a stop token, so every row decodes exactly
`--new-tokens`). Each row, per KV cache (`--caches`: dynamic, HF's default and what regeneration uses, and
static, whose decode step transformers compiles with CUDA graphs; its compile runs in an untimed first call), runs
`launcher.regeneration.hf.generate` (one left-padded HF `generate` call, as `regenerate.decode=generate` makes it),
for `loop` the static decode loop (`dflash_core.target.decode`, what `regenerate.decode=auto` runs: its CUDA
graphs are captured inside each timed call, as regeneration captures them per batch) or, for
`continuous`, one call of transformers' continuous batching (`generate_batch`: a paged KV cache, rows replaced as
they end; measured, not used by regeneration) on `batch` prompts of `--prompt-tokens` tokens, greedy, and
reports new tokens per second, the time of one decode step (after the prefill, timed apart) and the step's
floor: every weight and the batch's KV cache read once per step at the HBM bandwidth. A row faster than its
floor is a measurement bug and stops the bench.

`--ranks R` splits each batch over R processes sharing the GPU, as `torchrun --nproc-per-node R -m
launcher.regenerate` places them on one GPU: each answers batch / R prompts, all starting together,
and the row's time is the slowest one's. A host-bound decode step (HF's dynamic cache launches about
1,000 kernels a step) then overlaps R hosts' launches on the one GPU; its floor counts R weight copies."""
from __future__ import annotations

import argparse
import json
import queue
import time

import torch

from dflash_core.data.prompts import Prompt
from dflash_core.target.shapes import SHAPES, config_from_shape
from launcher.bench.ceiling import H200_HBM_TB_PER_S
from launcher.regeneration.hf import generate


def build_model(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM
    config = config_from_shape(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.requires_grad_(False).eval()


def decode_floor_s(model, batch: int, context: int, ranks: int = 1) -> float:
    """Seconds per decode step if each rank's weights and every cached key and value were read once at
    HBM speed."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:   # the embedding table is gathered, not read whole
        weight_bytes -= model.get_input_embeddings().weight.numel() * 2
    weight_bytes *= ranks
    kv_bytes = batch * context * config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2
    return (weight_bytes + kv_bytes) / (H200_HBM_TB_PER_S * 1e12)


def timed(model, prompts, new_tokens: int, pad_id: int, cache: str) -> float:
    from transformers import GenerationConfig
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=pad_id,
                                  cache_implementation="static" if cache == "static" else None)
    torch.cuda.synchronize()
    start = time.perf_counter()
    if cache == "loop":
        from dflash_core.target.decode import Sampling, StaticDecoder
        from launcher.regeneration.hf import left_padded
        rows = StaticDecoder(model, new_tokens, [], pad_id, Sampling())(*left_padded(prompts, pad_id)).tolist()
    elif cache == "continuous":   # in a thread of its own, so not under inference_mode (its cache is updated in place)
        results = model.generate_batch([p.token_ids for p in prompts], generation_config=gen_config)
        rows = [list(r.generated_tokens) for r in results.values()]
    else:
        rows = generate(model, prompts, gen_config, pad_id)
    torch.cuda.synchronize()
    assert all(len(row) == new_tokens for row in rows), "a row stopped early"
    return time.perf_counter() - start


def rank_times(shape: str, batch: int, prompt_tokens: int, new_tokens: int, cache: str, barrier=None) -> tuple:
    """(prefill seconds, whole-call seconds, peak GiB) of one process answering `batch` prompts; with a
    barrier, every timed call starts when all the processes sharing the GPU are ready for it."""
    torch.cuda.reset_peak_memory_stats()   # this row's peak, not an earlier row's in the same process
    model = build_model(shape, torch.device("cuda"))
    gen = torch.Generator().manual_seed(batch)
    prompts = [Prompt(index=i, id=i, location="bench", messages=[],
                      token_ids=torch.randint(10, 1000, (prompt_tokens,), generator=gen).tolist())
               for i in range(batch)]
    wait = barrier.wait if barrier is not None else (lambda: None)
    timed(model, prompts, new_tokens, 0, cache)   # warm-up: cuBLAS handles, allocator, the static cache's compile
    wait()
    prefill_s = timed(model, prompts, 1, 0, cache)
    wait()
    total_s = timed(model, prompts, new_tokens, 0, cache)
    return prefill_s, total_s, torch.cuda.max_memory_allocated() / 2**30


def _rank_worker(results, barrier, *args) -> None:
    results.put(rank_times(*args, barrier=barrier))


def row(model, shape: str, batch: int, prompt_tokens: int, new_tokens: int, cache: str, ranks: int) -> dict:
    if ranks == 1:
        prefill_s, total_s, peak_gib = rank_times(shape, batch, prompt_tokens, new_tokens, cache)
    else:
        import torch.multiprocessing as mp
        context = mp.get_context("spawn")   # CUDA in each child: never forked
        results, barrier = context.Queue(), context.Barrier(ranks)
        workers = [context.Process(target=_rank_worker, args=(results, barrier, shape, batch // ranks, prompt_tokens,
                                                              new_tokens, cache)) for _ in range(ranks)]
        for worker in workers:
            worker.start()
        times = []
        while len(times) < ranks:
            try:
                times.append(results.get(timeout=5))
            except queue.Empty:   # a rank that died (out of memory, say) leaves the others at the barrier
                if any(worker.exitcode not in (None, 0) for worker in workers):
                    for worker in workers:
                        worker.kill()
                    raise SystemExit(f"batch {batch}, {ranks} ranks: exit codes "
                                     f"{[worker.exitcode for worker in workers]}; the failing rank's error is above")
        for worker in workers:
            worker.join()
        # Each rank's timed calls began together: the row takes as long as its slowest rank.
        prefill_s, total_s = max(t[0] for t in times), max(t[1] for t in times)
        peak_gib = sum(t[2] for t in times)
        batch = ranks * (batch // ranks)
    step_s = (total_s - prefill_s) / (new_tokens - 1)
    floor_s = decode_floor_s(model, batch, prompt_tokens + new_tokens // 2, ranks)
    if step_s < floor_s:
        raise SystemExit(f"batch {batch}: a decode step of {1e3 * step_s:.2f} ms beats its floor "
                         f"{1e3 * floor_s:.2f} ms: the timing is wrong")
    return {"cache": cache, "batch": batch, "ranks": ranks, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "tokens_per_s": batch * new_tokens / total_s, "prefill_ms": 1e3 * prefill_s,
            "decode_step_ms": 1e3 * step_s, "decode_floor_ms": 1e3 * floor_s, "of_floor": floor_s / step_s,
            "peak_gib": peak_gib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--caches", default="dynamic", help="comma-separated: dynamic, static, continuous, loop")
    parser.add_argument("--ranks", default="1", help="comma-separated: processes sharing the GPU per row")
    parser.add_argument("--out")
    args = parser.parse_args()
    model = build_model(args.shape, torch.device("meta"))   # the shape's sizes for the floor; each row builds its own
    rows = []
    for cache, batch, ranks in [(c, int(b), int(r)) for c in args.caches.split(",") for b in args.batches.split(",")
                                for r in args.ranks.split(",")]:
        rows.append(row(model, args.shape, batch, args.prompt_tokens, args.new_tokens, cache, ranks))
        r = rows[-1]
        print(f"{cache:7s} batch {batch:4d}, {ranks} rank(s): {r['tokens_per_s']:8.0f} tokens/s, "
              f"decode step {r['decode_step_ms']:6.1f} ms "
              f"(floor {r['decode_floor_ms']:.1f} ms, {r['of_floor']:.2f} of it), prefill {r['prefill_ms']:.0f} ms, "
              f"peak {r['peak_gib']:.1f} GiB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
