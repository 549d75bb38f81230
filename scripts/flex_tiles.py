"""Time the drafter's flex_attention alone, at a production shape, for several kernel tile
configurations (issue 13: flex ran far below the GEMMs' rate; docs/perf_notes.md, "Step time, second pass").

    python scripts/flex_tiles.py --seq 4096 --anchors 512 --out flex_tiles.json

Each configuration compiles flex_attention forward + backward with its `kernel_options` and times
forward alone and forward + backward on the real DFlash BlockMask (sorted random anchors over a
fully supervised row, `dflash_core.drafter.attention.build_attention_mask`). FLOPs are the useful ones:
4 x head_dim x heads per visible (query, key) pair forward, 2.5x that backward (flex recomputes
QK^T), so the TFLOP/s are comparable with the GEMM ceiling."""

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash_core.drafter.attention import build_attention_mask, dense_mask, interval_block_mask, make_mask_mod
from dflash_core.loss.anchors import sample_anchors

CONFIGS = {
    "default": {},
    "flash": {"BACKEND": "FLASH"},  # flash-attn-4's CuTe kernels (FA3-class on Hopper), where installed
    "tma": {"USE_TMA": True},
    "fwd_128x128_w8_s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd_128x64_w4_s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd_64x128_w4_s3": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "bwd_64x64_w4_s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd_32x128_w4_s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                         "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd_64x128_w8_s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 8, "bwd_num_stages": 2},
    "bwd_64x128_w4_s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd_32x64_w4_s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                        "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd_64x64_w4_s3_tma": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                            "bwd_num_warps": 4, "bwd_num_stages": 3, "USE_TMA": True},
    "tile64_64x64": {"tile": 64, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                     "bwd_num_warps": 4, "bwd_num_stages": 3},
}


def timed(fn, iters):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="flex_tiles.json")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    loss_mask = torch.ones(1, args.seq, dtype=torch.bool, device=device)
    anchors, keep = sample_anchors(loss_mask, args.anchors, generator=gen)
    q_len = args.anchors * args.block_size
    kv_len = args.seq + q_len
    common = dict(context_len=args.seq, block_size=args.block_size)
    mask = build_attention_mask(anchors, keep, layer_type="full_attention", window=None, backend="flex", **common)
    mask_mod = make_mask_mod(anchors, keep, layer_type="full_attention", **common)
    pairs = int(dense_mask(mask_mod, 1, q_len, kv_len, device).sum())
    fwd_tflop = 4 * args.head_dim * args.heads * pairs / 1e12

    def tensor(heads, length):
        return torch.randn(1, heads, length, args.head_dim, device=device, dtype=torch.bfloat16,
                           requires_grad=True, generator=gen)

    q, k, v = tensor(args.heads, q_len), tensor(args.kv_heads, kv_len), tensor(args.kv_heads, kv_len)
    grad = torch.randn_like(q)
    results = {"seq": args.seq, "anchors": args.anchors, "visible_pairs": pairs, "fwd_tflop": fwd_tflop,
               "torch": torch.__version__, "device": torch.cuda.get_device_name(device), "configs": {}}
    print(f"mask: {pairs} visible pairs of {q_len * kv_len} ({pairs / (q_len * kv_len):.3f}), "
          f"forward {fwd_tflop:.3f} TFLOP per head group layer call", flush=True)
    reference = None  # the default configuration's output and gradients, once it has run
    for name in args.configs.split(","):
        options, block_mask = dict(CONFIGS[name]), mask
        if options.pop("tile", None) == 64:  # a 64 x 64 BlockMask: tighter around the 16-query blocks
            block_mask = interval_block_mask(anchors, keep, torch.zeros_like(anchors), window=None,
                                             mask_mod=mask_mod, tile=64, **common)
        torch._dynamo.reset()
        attend = torch.compile(lambda q, k, v, m, o=options: flex_attention(
            q, k, v, block_mask=m, enable_gqa=True, kernel_options=o or None))
        start = time.perf_counter()
        try:
            attend(q, k, v, block_mask).backward(grad)
            torch.cuda.synchronize()
        except Exception as error:  # a config the kernel rejects (shared memory, divisibility)
            print(f"{name}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
            results["configs"][name] = {"options": options, "error": f"{type(error).__name__}: {error}"[:500]}
            continue
        with torch.no_grad():  # grad mode is a guard: compile the forward-only graph before timing
            attend(q, k, v, block_mask)
        compile_s = time.perf_counter() - start
        out = attend(q, k, v, block_mask)
        answer = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))
        reference = answer if name == "default" else reference
        differences = None if reference is None else [float((a.float() - b.float()).abs().max())
                                                      for a, b in zip(answer, reference)]
        with torch.no_grad():
            fwd_ms = timed(lambda: attend(q, k, v, block_mask), args.iters)
        both_ms = timed(lambda: attend(q, k, v, block_mask).backward(grad), args.iters)
        row = {"options": options, "compile_s": compile_s, "fwd_ms": fwd_ms, "bwd_ms": both_ms - fwd_ms,
               "fwd_tflops": fwd_tflop / fwd_ms * 1e3, "bwd_tflops": 2.5 * fwd_tflop / (both_ms - fwd_ms) * 1e3,
               "fwd_bwd_ms": both_ms, "max_abs_diff_out_dq_dk_dv": differences}
        results["configs"][name] = row
        print(f"{name}: fwd {fwd_ms:.2f} ms ({row['fwd_tflops']:.0f} TFLOP/s), bwd {row['bwd_ms']:.2f} ms "
              f"({row['bwd_tflops']:.0f} TFLOP/s), compile {compile_s:.1f} s, max diff vs default {differences}",
              flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
