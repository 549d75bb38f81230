"""AdamW in one pass over each parameter, with the step's gradient multiplier and skip flag.

torch's fused AdamW (`_fused_adamw_`) moves 1.05 B fp32 parameters with their gradients and
moments at ~2.9 TB/s on an H200 (60% of HBM bandwidth), and with `grad_scale` it also writes the
unscaled gradient back: 9.96 ms per drafter step where the traffic floor is 6.1 ms
(docs/perf_notes.md). This kernel reads parameter, gradient and both moments once and writes
parameter and moments once, applying the multiplier in registers: 7.27 ms, within 2.2e-8 of torch.

Same arithmetic as torch's AdamW (decoupled weight decay, bias-corrected moments, `exp_avg` by
lerp), same state layout (`step`, `exp_avg`, `exp_avg_sq` per parameter): `OnePassAdamW` is torch's
fused AdamW whose `step_scaled` runs this kernel on CUDA and torch's own fused step elsewhere, so
checkpoints move freely between the two and between devices."""

import math

import torch


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, numel, step_ptr, multiplier_ptr,
                     skip_ptr, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
                     BLOCK: tl.constexpr):
        if tl.load(skip_ptr) != 0:
            return
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        step = tl.load(step_ptr)
        grad = tl.load(grad_ptr + offsets, mask=inside) * tl.load(multiplier_ptr)
        param = tl.load(param_ptr + offsets, mask=inside)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside)
        param = param * (1.0 - lr * weight_decay)
        exp_avg = exp_avg + (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + (1.0 - beta2) * grad * grad
        step_size = lr / (1.0 - tl.exp2(step * log2_beta1))
        bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
        param = param - step_size * exp_avg / (tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps)
        tl.store(param_ptr + offsets, param, mask=inside)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=inside)

    return adamw_kernel


_KERNEL = None
# Elements and warps per program: the fastest pair measured on an H200 (1.05 B fp32 parameters,
# scripts/adamw_bench.py).
BLOCK, NUM_WARPS = 1024, 4


def adamw_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, multiplier: torch.Tensor, skip: torch.Tensor) -> None:
    """One AdamW update of every parameter on gradient * `multiplier` (0-d fp32 tensor), or none at
    all where `skip` (0-d tensor, nonzero: leave weights, moments and step counts as they are).
    `steps` are the per-parameter fp32 0-d step counts, advanced here on the device."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _kernel()
    keep = 1.0 - skip.float()
    # Where skipped, the count stays (the kernel then returns at once). A list of tensors, not one
    # tensor: `_foreach_add_(steps, keep)` reads a 0-d CUDA `keep` on the host, a sync every step.
    torch._foreach_add_(steps, [keep] * len(steps))
    for param, grad, exp_avg, exp_avg_sq, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        numel = param.numel()
        _KERNEL[((numel + BLOCK - 1) // BLOCK,)](
            param, grad, exp_avg, exp_avg_sq, numel, step, multiplier, skip, lr, beta1, beta2,
            math.log2(beta1), math.log2(beta2), eps, weight_decay, BLOCK=BLOCK, num_warps=NUM_WARPS)


class OnePassAdamW(torch.optim.AdamW):
    """torch's AdamW with fused=True (its state, its `step()`, its checkpoints), plus `step_scaled`:
    the step on gradient * multiplier, or none at all where skip, from two device tensors.
    Options the kernel does not implement are refused here rather than ignored there."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **options):
        unsupported = [f"{name}=True" for name in ("amsgrad", "maximize", "differentiable") if options.get(name)]
        if isinstance(lr, torch.Tensor) or any(isinstance(beta, torch.Tensor) for beta in betas):
            unsupported.append("a tensor lr or betas")  # the kernel takes them as floats, read on the host
        if unsupported:
            raise ValueError(f"OnePassAdamW does not implement {', '.join(unsupported)}: use torch.optim.AdamW")
        super().__init__(params, lr, betas, eps, weight_decay, fused=True, **options)

    def load_state_dict(self, state_dict: dict) -> None:
        # A checkpoint of an unfused AdamW (CPU runs saved them) says fused=False, and torch then
        # leaves each `step` where it was saved; as fused it lands on its parameter's device, fp32,
        # where both fused steps read it.
        groups = [{**group, "fused": True} for group in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})

    def step_scaled(self, multiplier: torch.Tensor, skip: torch.Tensor) -> None:
        """One AdamW step on gradient * `multiplier` (0-d tensor), or none at all (weights, moments
        and step counts kept) where `skip` (0-d tensor) is nonzero. Neither is read on the host."""
        if not all(p.is_cuda for group in self.param_groups for p in group["params"]):
            # torch's fused kernel divides each gradient by AMP's `grad_scale` as it reads it and does
            # nothing where `found_inf` is set. Removed after: a later plain step() is unscaled.
            self.grad_scale, self.found_inf = (1.0 / multiplier).float(), skip.float()
            try:
                self.step()
            finally:
                del self.grad_scale, self.found_inf
            return
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            beta1, beta2 = group["betas"]
            adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                   [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr=group["lr"], beta1=beta1,
                   beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                   multiplier=multiplier.float(), skip=skip)
        # The mark torch's LR schedulers look for (they wrap step(), which this path bypasses):
        # without it the first scheduler.step() warns that it ran before the optimiser's.
        self._opt_called = True

    def _state(self, param: torch.Tensor) -> dict:
        """The parameter's state, created on its first step as torch's fused AdamW creates it."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
