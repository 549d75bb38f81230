"""Time the drafter's AdamW update alone at the production drafter's parameter shapes (issue 13; its
share of the Qwen3-8B-shaped step: docs/perf_notes.md), against the HBM floor, for the ways PyTorch
(and our kernel) can run it.

    python scripts/adamw_bench.py --out adamw.json

fp32 parameters, gradients and moments: the update reads 16 and writes 12 bytes per parameter,
so its floor is 28 bytes x parameters / the HBM bandwidth (--hbm-tb-s: the spec sheet's). Variants:
  fused        torch.optim.AdamW(fused=True) with grad_scale and found_inf tensors (the trainer's until the
               seventh session)
  fused_flat   the same on one flat parameter as large as all the weights: one tensor instead of 58
  compiled     torch.compile of a capturable foreach AdamW step with a tensor learning rate (no recompiles)
  overlapped   the fused update on a side stream while the compute stream runs the next step's forward
               GEMMs (layer shapes, 8192 query rows): how much of the update such an overlap would hide
  one_pass_*   dflash_core.kernels.fused_adamw (the trainer's update) at several tile sizes, and its largest
               difference from the fused update; one_pass_bf16_copies: as the trainer runs it on GPU, bf16
               gradients in and bf16 compute copies out for the matrices (also 28 bytes per weight)
  norm_*       the clip norm over those gradients (bf16 matrices, fp32 vectors; ~2 bytes per weight read):
               torch's `_foreach_norm` with an fp32 result (the trainer's until the tenth session) against
               dflash_core.kernels.fused_adamw.sum_of_squares at a few (elements, tile, warps) per program, and the
               relative difference of the kept one; device time (`_timed_on_device`), since queueing their
               58 small launches takes the host longer than the GPU takes to run them"""

import argparse
import json
import time

import torch


def drafter_shapes(hidden=4096, kv=1024, inter=12288, head_dim=128, layers=5, features=5):
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (head_dim,), (head_dim,),
             (inter, hidden), (inter, hidden), (hidden, inter), (hidden,), (hidden,)]
    return layer * layers + [(hidden, features * hidden), (hidden,), (hidden,)]


def _params(shapes, device, flat: bool) -> list[torch.nn.Parameter]:
    """Parameters of `shapes` with gradients; flat: one parameter as large as all of them."""
    sizes = [torch.Size(s) for s in shapes]
    params = ([torch.nn.Parameter(torch.randn(sum(s.numel() for s in sizes), device=device) * 0.02)] if flat
              else [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in sizes])
    for param in params:
        param.grad = torch.randn_like(param)
    return params


def _timed(step, device, reps: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps


def _timed_on_device(step, device, reps: int) -> float:
    """Device seconds per call of `step` when queueing it takes the host longer than the GPU takes to run
    it (the norm rows: 58 launches of a short kernel, where `_timed` measured the host): the GPU sleeps
    while the host queues all `reps` calls (keep reps x launches under CUDA's ~1000 queued kernels), then
    runs them back to back between two events."""
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000_000)   # a billion clock cycles: longer than queueing the calls takes
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3 / reps


def _overlapped(shapes, device, reps: int, report) -> None:
    """GEMMs of one forward's worth (bf16, the 2-D weights of `shapes` applied to 8192 rows) alone, the
    fused update alone, and both at once on two streams."""
    params = _params(shapes, device, False)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    weights = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes if len(s) == 2]
    rows = torch.randn(8192, max(w.shape[1] for w in weights), device=device, dtype=torch.bfloat16)

    def forward():
        for w in weights:
            torch.mm(rows[:, :w.shape[1]], w.t())

    side = torch.cuda.Stream(device)

    def both():
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            opt.step()
        forward()
        torch.cuda.current_stream(device).wait_stream(side)

    gemm_s, adamw_s = _timed(forward, device, reps), _timed(opt.step, device, reps)
    both_s = _timed(both, device, reps)
    report("overlapped", both_s, gemms_ms=round(gemm_s * 1e3, 2), adamw_ms=round(adamw_s * 1e3, 2),
           hidden_ms=round((gemm_s + adamw_s - both_s) * 1e3, 2))


def _one_pass(shapes, device, reps: int, report, scale, skip) -> None:
    """dflash_core.kernels.fused_adamw at a few tile sizes, and its largest difference from the fused update after
    three steps on identical copies of the first layer's parameters; then as the trainer runs it on GPU:
    bf16 gradients of the matrices, whose bf16 compute copies it writes (the same 28 bytes per weight)."""
    from dflash_core.kernels import fused_adamw
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def one_pass_state(params):
        return ([p.grad for p in params], [torch.zeros_like(p) for p in params],
                [torch.zeros_like(p) for p in params], torch.zeros((), device=device))

    reference = _params(shapes[:11], device, False)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in reference]
    for mine, theirs in zip(ours, reference):
        mine.grad = theirs.grad.clone()
    opt = torch.optim.AdamW(reference, lr=hyper["lr"], weight_decay=hyper["weight_decay"], fused=True)
    opt.grad_scale, opt.found_inf = scale, skip
    state = one_pass_state(ours)
    for _ in range(3):
        for mine, theirs in zip(ours, reference):  # the fused update writes the unscaled gradient back
            theirs.grad.copy_(mine.grad)
        opt.step()
        fused_adamw.adamw_(ours, *state, multiplier=1.0 / scale, skip=skip, **hyper)
    diff = max(float((a - b).abs().max()) for a, b in zip(ours, reference))
    del opt, reference, ours, state

    params = _params(shapes, device, False)
    state = one_pass_state(params)
    for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 4)):
        fused_adamw.BLOCK, fused_adamw.NUM_WARPS = block, warps
        report(f"one_pass_{block}_{warps}", _timed(
            lambda: fused_adamw.adamw_(params, *state, multiplier=scale, skip=skip, **hyper), device, reps),
            max_abs_diff_vs_fused=diff)
    fused_adamw.BLOCK, fused_adamw.NUM_WARPS = 1024, 4
    matrices = [p.dim() == 2 for p in params]
    grads = [p.grad.bfloat16() if matrix else p.grad for p, matrix in zip(params, matrices)]
    computes = [p.detach().bfloat16() if matrix else None for p, matrix in zip(params, matrices)]
    report("one_pass_bf16_copies", _timed(
        lambda: fused_adamw.adamw_(params, grads, *state[1:], multiplier=scale, skip=skip, computes=computes,
                                   **hyper), device, reps))


def _gradient_norm(shapes, device, report, reps: int = 8) -> None:
    from dflash_core.kernels import fused_adamw
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16 if len(s) == 2 else torch.float32) for s in shapes]
    moved = sum(g.numel() * g.element_size() for g in grads)

    def per_tensor():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))

    def one_pass():
        return fused_adamw.sum_of_squares(grads).sqrt()

    difference = float((per_tensor() - one_pass()).abs() / per_tensor())
    report("norm_foreach", _timed_on_device(per_tensor, device, reps), moved=moved)
    kept = fused_adamw.SQUARES_CHUNK, fused_adamw.SQUARES_BLOCK, fused_adamw.SQUARES_WARPS
    for config in (kept, (8192, 2048, 4), (8192, 4096, 8), (16384, 4096, 4), (65536, 2048, 4)):
        fused_adamw.SQUARES_CHUNK, fused_adamw.SQUARES_BLOCK, fused_adamw.SQUARES_WARPS = config
        report("norm_sum_of_squares_{}_{}_{}".format(*config), _timed_on_device(one_pass, device, reps), moved=moved,
               relative_difference=difference if config == kept else None)
    fused_adamw.SQUARES_CHUNK, fused_adamw.SQUARES_BLOCK, fused_adamw.SQUARES_WARPS = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="the device's HBM bandwidth (spec sheet)")
    parser.add_argument("--out", default="adamw.json")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    shapes = drafter_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    floor_ms = 28 * numel / (args.hbm_tb_s * 1e12) * 1e3
    rows = {}

    def report(name, seconds, moved=28 * numel, **extra):
        """moved: the bytes the row reads and writes (the update's 28 per weight unless given)."""
        floor = moved / (args.hbm_tb_s * 1e12) * 1e3
        rows[name] = {"ms": seconds * 1e3, "tb_s": moved / seconds / 1e12, "of_floor": floor / (seconds * 1e3),
                      **extra}
        print(f"{name:11s} {seconds * 1e3:7.2f} ms  {rows[name]['tb_s']:.2f} TB/s  floor {floor:.2f} ms  "
              f"{extra}", flush=True)

    scale, skip = torch.tensor(2.0, device=device), torch.tensor(0.0, device=device)
    for name, flat in (("fused", False), ("fused_flat", True)):
        params = _params(shapes, device, flat)
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        opt.grad_scale, opt.found_inf = scale, skip
        report(name, _timed(opt.step, device, args.reps), tensors=len(params))
        del opt, params

    _overlapped(shapes, device, args.reps, report)
    _one_pass(shapes, device, args.reps, report, scale, skip)
    _gradient_norm(shapes, device, report)

    params = _params(shapes, device, False)
    opt = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=device), weight_decay=0.01, foreach=True,
                            capturable=True)
    multiplier = torch.tensor(0.5, device=device)

    @torch.compile(fullgraph=False)
    def compiled_step():
        torch._foreach_mul_([p.grad for p in params], multiplier)   # the trainer's one multiplier
        opt.step()

    start = time.perf_counter()
    compiled_step()
    torch.cuda.synchronize(device)
    compile_s = time.perf_counter() - start
    report("compiled", _timed(compiled_step, device, args.reps), compile_s=round(compile_s, 1))
    json.dump({"params": numel, "floor_ms": floor_ms, "hbm_tb_s": args.hbm_tb_s, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "rows": rows}, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
