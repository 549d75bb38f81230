"""AdamW in one pass over each stretch of weights, with the step's gradient multiplier and skip flag,
and the weights' compute copy written in the same pass.

torch's fused AdamW (`_fused_adamw_`) moves the fp32 parameters with their gradients and moments
short of HBM bandwidth, and with `grad_scale` it also writes the unscaled gradient back. This
kernel reads master weight, gradient and both moments once and writes master and moments once,
applying the multiplier in registers (how close each comes to the traffic floor, and how close
this one stays to torch's values: docs/perf_notes.md, "Step time, fourth pass").
Given a compute copy (the bf16 weight the model computes with) it also writes the updated master
rounded to the copy's dtype (round to nearest even, as `Tensor.to` rounds): 2 bytes more per weight,
where casting the fp32 weights before each forward GEMM moved 6.

Same arithmetic as torch's AdamW (decoupled weight decay, bias-corrected moments, `exp_avg` by
lerp). Off CUDA, torch's own fused step runs instead, so a CPU run computes torch's AdamW exactly.

The gradient norm that decides the clip multiplier is here too (`sum_of_squares`): torch's
`_foreach_norm` with an fp32 result for bf16 gradients takes its per-tensor path; one Triton pass
per tensor into fixed partial sums reads them at HBM speed (docs/perf_notes.md, "Step time, sixth
pass"), and sums them in one fixed order, so a step's norm is the same bits every run."""

import functools
import math

import torch


@functools.cache   # built on first use: importing Triton costs a process that never steps on CUDA
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, compute_ptr, numel, step_ptr,
                     multiplier_ptr, skip_ptr, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
                     WRITE_COMPUTE: tl.constexpr, BLOCK: tl.constexpr):
        if tl.load(skip_ptr) != 0:
            return
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        step = tl.load(step_ptr)
        grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32) * tl.load(multiplier_ptr)
        param = tl.load(master_ptr + offsets, mask=inside)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside)
        param = param * (1.0 - lr * weight_decay)
        exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
        step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        param = param - step_size * exp_avg / (tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps)
        tl.store(master_ptr + offsets, param, mask=inside)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=inside)
        if WRITE_COMPUTE:
            tl.store(compute_ptr + offsets, param.to(compute_ptr.dtype.element_ty), mask=inside)

    return adamw_kernel


@functools.cache
def _sum_of_squares_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sum_of_squares_kernel(x_ptr, numel, partial_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * CHUNK
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for offset in range(0, CHUNK, BLOCK):
            offsets = start + offset + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
            total += x * x
        tl.store(partial_ptr + tl.program_id(0), tl.sum(total, axis=0))

    return sum_of_squares_kernel


def _runs_kernel(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernels run on `tensor`'s device (the tests also run them in Triton's interpreter)."""
    return tensor.is_cuda


# Elements and warps per program: the fastest pair measured on an H200 (1.05 B fp32 parameters,
# scripts/adamw_bench.py).
BLOCK, NUM_WARPS = 1024, 4


def adamw_(masters, grads, exp_avgs, exp_avg_sqs, step, *, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, multiplier: torch.Tensor, skip: torch.Tensor, computes=None) -> None:
    """One AdamW update of every fp32 master on gradient * `multiplier` (0-d fp32 tensor), or none at
    all where `skip` (0-d tensor, nonzero: masters, moments, compute copies and `step` stay as they
    are). `step` is the one fp32 0-d step count of all of them, advanced here on the device; neither
    it nor `skip` is read on the host. Gradients may be of any float dtype; `computes[i]`, where given
    (None, or a list with None entries), receives the updated master i in its own dtype. Every tensor
    of one index is contiguous and of one size."""
    computes = computes or [None] * len(masters)
    keep = 1.0 - skip.float()
    step.add_(keep)
    if not _runs_kernel(step):
        # Its found_inf leaves every tensor as it was; its grad_scale divides each gradient as it reads it.
        torch._fused_adamw_(masters, [g.float() for g in grads], exp_avgs, exp_avg_sqs, [], [step] * len(masters),
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                            maximize=False, grad_scale=(1.0 / multiplier).float(), found_inf=skip.float())
        written = [(c, m) for c, m in zip(computes, masters) if c is not None]
        if written:
            torch._foreach_copy_(*map(list, zip(*written)))
        return
    multiplier = multiplier.float()
    for master, grad, exp_avg, exp_avg_sq, compute in zip(masters, grads, exp_avgs, exp_avg_sqs, computes):
        numel = master.numel()
        _kernel()[((numel + BLOCK - 1) // BLOCK,)](
            master, grad, exp_avg, exp_avg_sq, master if compute is None else compute, numel, step, multiplier,
            skip, lr, beta1, beta2, math.log2(beta1), math.log2(beta2), eps, weight_decay,
            WRITE_COMPUTE=compute is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


# Elements per program of the sum of squares, per iteration of its loop, and warps per program. Each
# tensor is its own launch, so a program's share must be small enough for the smallest to fill the GPU
# (64 K elements per program left a [4096, 4096] gradient 256 programs, far below HBM speed: docs/perf_notes.md,
# "Step time, sixth pass", and scripts/adamw_bench.py's norm_* rows). One fp32 partial sum per program.
SQUARES_CHUNK, SQUARES_BLOCK, SQUARES_WARPS = 4096, 4096, 4


def sum_of_squares(tensors) -> torch.Tensor:
    """sum over `tensors` (any float dtypes) of their squared elements, accumulated in fp32: a 0-d fp32
    tensor on their device, not read on the host. The same bits every run (fixed partial sums, then one
    fixed-order sum), on CUDA as off it."""
    if not _runs_kernel(tensors[0]):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()
    device = tensors[0].device
    tensors = [t.reshape(-1) for t in tensors if t.numel()]
    programs = [(t.numel() + SQUARES_CHUNK - 1) // SQUARES_CHUNK for t in tensors]
    partials = torch.zeros(max(sum(programs), 1), dtype=torch.float32, device=device)
    start = 0
    for tensor, count in zip(tensors, programs):
        _sum_of_squares_kernel()[(count,)](tensor, tensor.numel(), partials[start:], CHUNK=SQUARES_CHUNK,
                                          BLOCK=SQUARES_BLOCK, num_warps=SQUARES_WARPS)
        start += count
    return partials.sum()
