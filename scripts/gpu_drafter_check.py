"""GPU checks of the DFlash drafter (run on an H200; importable on CPU).

  (a) flex vs sdpa, forward and backward, bf16 autocast vs an fp32 sdpa reference;
  (b) 20 training steps with changing data at one shape: the flex path compiles once;
  (c) a Qwen3-8B-shaped drafter at S=4096, 512 anchors: time per step and peak memory.

    python scripts/gpu_drafter_check.py [--parts a,b,c] [--benchmark-backends flex,sdpa]
                                        [--profile]

Prints PASS/FAIL lines and a table; writes $OUT/gpu_drafter_check.json when $OUT is set.
Exit status 1 if a check fails.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core import attention  # noqa: E402
from dflash_core.frozen_head import FrozenTargetHead  # noqa: E402
from dflash_core.model import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_core.objective import drafter_step  # noqa: E402

# Relative Frobenius error of bf16 flex vs the fp32 sdpa reference (H200, torch 2.11:
# 0.002 forward, 0.006 backward, the same as bf16 sdpa).
FORWARD_TOLERANCE = 1e-2
BACKWARD_TOLERANCE = 2e-2


def moderate_config():
    return DrafterConfig(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                         num_key_value_heads=4, head_dim=64, intermediate_size=2816,
                         vocab_size=32000, block_size=16, target_layer_ids=[1, 5, 9],
                         num_target_layers=12, mask_token_id=31999, rope_theta=1e6)


def qwen3_8b_config():
    return DrafterConfig(hidden_size=4096, num_hidden_layers=5, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                         vocab_size=151936, block_size=16, target_layer_ids=[1, 9, 17, 25, 33],
                         num_target_layers=36, mask_token_id=151669, rope_theta=1e6)


def random_batch(cfg, *, batch, seq_len, generator):
    """Token ids, a loss mask with a random-length prompt per row, and bf16 features, drawn on
    the generator's device (drawing the 8B-sized features on the CPU cost ~0.45 s a step)."""
    device = generator.device
    input_ids = torch.randint(0, cfg.mask_token_id, (batch, seq_len), generator=generator,
                              device=device)
    prompt = torch.randint(0, seq_len // 2, (batch, 1), generator=generator, device=device)
    loss_mask = (torch.arange(seq_len, device=device) >= prompt).long()
    hidden = torch.randn(batch, seq_len, cfg.num_features * cfg.hidden_size, generator=generator,
                         device=device, dtype=torch.bfloat16)
    return input_ids, loss_mask, hidden


def relative_error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def check_backends(*, device="cuda", batch=2, seq_len=1024, num_anchors=64, seed=0):
    """(a) drafter output and all gradients (params and features) in bf16 autocast, flex and
    sdpa, against fp32 sdpa."""
    cfg = moderate_config()
    drafter = DFlashDrafter(cfg, seed=seed).to(device)
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, seq_len, cfg.num_features * cfg.hidden_size, generator=gen)
    embeds = torch.randn(batch, num_anchors * cfg.block_size, cfg.hidden_size, generator=gen)
    anchors = torch.randint(0, seq_len - 1, (batch, num_anchors), generator=gen).sort(1).values
    keep = torch.rand(batch, num_anchors, generator=gen) > 0.1
    probe = torch.randn(batch, num_anchors * cfg.block_size, cfg.hidden_size, generator=gen)
    features, embeds, anchors, keep, probe = (t.to(device) for t in
                                              (features, embeds, anchors, keep, probe))

    def run(backend, bf16):
        drafter.zero_grad(set_to_none=True)
        inputs = features.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = drafter(inputs, embeds, anchors, keep, backend=backend)
        (out.float() * probe).sum().backward()
        grads = [p.grad.clone() for p in drafter.parameters()] + [inputs.grad]
        return out.detach(), torch.cat([g.flatten().float() for g in grads])

    ref_out, ref_grad = run("sdpa", bf16=False)
    result = {}
    for backend in ("flex", "sdpa"):
        out, grad = run(backend, bf16=True)
        result[f"{backend}_bf16_forward_rel_err"] = relative_error(out, ref_out)
        result[f"{backend}_bf16_backward_rel_err"] = relative_error(grad, ref_grad)
    result["compiles"] = attention.compile_count()
    result["passed"] = (result["flex_bf16_forward_rel_err"] < FORWARD_TOLERANCE
                        and result["flex_bf16_backward_rel_err"] < BACKWARD_TOLERANCE)
    return result


def check_single_compile(*, device="cuda", steps=20, batch=2, seq_len=1024, num_anchors=48,
                         seed=0):
    """(b) training steps with fresh data each step at one fixed shape (not check_backends'
    shape, so it is new to this process): the flex path compiles once, at the first step."""
    cfg = moderate_config()
    drafter = DFlashDrafter(cfg, seed=seed).to(device)
    head = FrozenTargetHead.random(cfg.vocab_size, cfg.hidden_size, seed=seed, device=device,
                                   dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4)
    gen = torch.Generator(device=device).manual_seed(seed)
    before = {name: attention.compile_count(name) for name in ("flex_attention", "create_block_mask")}
    after_first, losses = None, []
    for step in range(steps):
        batch_data = random_batch(cfg, batch=batch, seq_len=seq_len, generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = drafter_step(drafter, head, *batch_data, num_anchors=num_anchors, generator=gen,
                               backend="flex", chunk_blocks=16)
        optimizer.zero_grad(set_to_none=True)
        (out.loss_sum / out.weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        losses.append(out.loss_sum.item() / out.weight_sum.item())
        if step == 0:
            after_first = attention.compile_count()
    compiles = {name: attention.compile_count(name) - before[name] for name in before}
    return {
        "steps": steps,
        "flex_attention_compiles": compiles["flex_attention"],
        "create_block_mask_compiles": compiles["create_block_mask"],
        "compiles_after_first_step": attention.compile_count() - after_first,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "passed": compiles == {"flex_attention": 1, "create_block_mask": 1}
        and attention.compile_count() == after_first,
    }


def benchmark_8b(*, backend, device="cuda", seq_len=4096, num_anchors=512, warmup=3, steps=10,
                 chunk_blocks=32, seed=0, profile=False):
    """(c) Qwen3-8B-shaped drafter, random weights, fp32 master params, bf16 autocast, AdamW."""
    cfg = qwen3_8b_config()
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: a 1B-parameter CPU init is slow
        drafter = DFlashDrafter(cfg)
    head = FrozenTargetHead.random(cfg.vocab_size, cfg.hidden_size, seed=seed, device=device,
                                   dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4, weight_decay=0.01, fused=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    torch.cuda.reset_peak_memory_stats()

    def step():
        batch_data = random_batch(cfg, batch=1, seq_len=seq_len, generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = drafter_step(drafter, head, *batch_data, num_anchors=num_anchors, generator=gen,
                               backend=backend, chunk_blocks=chunk_blocks)
        optimizer.zero_grad(set_to_none=True)
        (out.loss_sum / out.weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()

    def timed(num_steps):
        start = time.perf_counter()
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    first_step_s = timed(1)  # includes compiling at this shape
    timed(warmup - 1)
    step_s = timed(steps) / steps
    if profile:
        with torch.profiler.profile() as prof:
            timed(2)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        print(torch._dynamo.utils.compile_times())
    result = {
        "backend": backend,
        "params_M": sum(p.numel() for p in drafter.parameters()) / 1e6,
        "seq_len": seq_len,
        "num_anchors": num_anchors,
        "block_size": cfg.block_size,
        "first_step_s": first_step_s,
        "step_ms": 1000 * step_s,
        "context_tokens_per_s": seq_len / step_s,
        "max_memory_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30,
    }
    del drafter, head, optimizer
    torch.cuda.empty_cache()
    return result


def print_table(rows):
    columns = list(rows[0])
    widths = [max(len(c), *(len(format_cell(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(format_cell(row[c]).ljust(w) for c, w in zip(columns, widths)))


def format_cell(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="a,b,c", help="which checks to run")
    parser.add_argument("--benchmark-backends", default="flex,sdpa")
    parser.add_argument("--profile", action="store_true", help="profile two benchmark steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    parts = set(args.parts.split(","))
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    passed = True

    if "a" in parts:
        report["backends"] = check_backends()
        passed &= report["backends"]["passed"]
        print(f"(a) flex vs sdpa (bf16 vs fp32 sdpa, tolerance fwd {FORWARD_TOLERANCE} "
              f"bwd {BACKWARD_TOLERANCE}): {'PASS' if report['backends']['passed'] else 'FAIL'}")
        print_table([report["backends"]])

    if "b" in parts:
        report["single_compile"] = check_single_compile()
        passed &= report["single_compile"]["passed"]
        print(f"(b) {report['single_compile']['steps']} steps, one shape, changing data: "
              f"{'PASS' if report['single_compile']['passed'] else 'FAIL'}")
        print_table([report["single_compile"]])

    if "c" in parts:
        report["benchmark"] = [benchmark_8b(backend=b, profile=args.profile)
                               for b in args.benchmark_backends.split(",")]
        print("(c) Qwen3-8B-shaped drafter, S=4096, 512 anchors x 16, bf16 autocast, AdamW")
        print_table(report["benchmark"])

    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_drafter_check.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    sys.exit(0 if passed else 1)

if __name__ == "__main__":
    main()
