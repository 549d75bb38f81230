"""The loss at the target's frozen LM head: weighted cross-entropy of lm_head(h) over all blocks.

One definition, `head_loss_terms`: from one chunk's logits [rows, V], the per-position CE, the final
loss weights, the argmax hits and, when training, d(weighted CE sum)/d(logits). Evaluation, eager
and compiled training steps run it with torch's row statistics and gradient; a compiled step on
CUDA runs it with the Triton kernels of dflash_core/kernels/head_loss.py in their place (why:
docs/perf_notes.md, "Step time, fourth pass"). `head_loss` runs it chunk by chunk, so the [N*Bs, V]
logits never exist at once. With `drafter.matmul_precision=fp8` the training step's two head products
(the logits and d(loss)/dh) are FP8 products of its quantised weight (dflash_core/kernels/fp8.py); the
loss terms, their reduction and everything after stay as in bf16, and evaluation's logits are the
served head's bf16 product.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from ..drafter.compile import compiled_function
from ..kernels.fp8 import ALIGNMENT, quantise_rows

LOSS_TYPES = ("dflash", "dpace")


def loss_weights(ce, weights, *, loss, gamma, dpace_alpha):
    """Per-position loss weights [B, c, Bs - 1] of the drafted slots k = 1..Bs-1 (slot 0, the anchor,
    is given) from their 0/1 label weights (ce is detached).
    dflash: w * exp(-(k-1)/gamma).
    dpace:  q' = (1-dpace_alpha) exp(-ce) + dpace_alpha, prefix = cumprod of q' over slots 1..k,
            weight_k = w_k * sum_{j>=k} prefix_j w_j  (d E[accepted] / d log q'_k)."""
    slot_after_first = torch.arange(weights.shape[-1], device=weights.device, dtype=weights.dtype)   # k - 1
    if loss == "dflash":
        return weights * torch.exp(-slot_after_first / gamma)
    if loss == "dpace":
        q = (1 - dpace_alpha) * torch.exp(-ce) + dpace_alpha
        reach = torch.cumprod(q, dim=-1) * weights
        return weights * reach.flip(-1).cumsum(-1).flip(-1)
    raise ValueError(f"unknown loss {loss!r}; expected one of {LOSS_TYPES}")


class RowKernels(NamedTuple):
    """The two vocabulary-wide passes of the head loss. `norm` is what the gradient pass reads of the
    statistics: log_z [rows] for torch's, kernels.head_loss.RowNorm for the Triton ones."""
    statistics: Callable   # (logits [rows, V], labels [rows]) -> norm, ce (fp32), argmax [rows]
    gradient: Callable     # (logits, labels, norm, final [rows]) -> (softmax - onehot) * final in the logits'
    #                        dtype, or (e4m3 rows, fp32 row scales) from kernels.head_loss.e4m3_gradient


def _torch_statistics(logits, labels):
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    return log_z, log_z - logits.gather(1, labels.unsqueeze(1)).squeeze(1), logits.argmax(-1)


def _torch_gradient(logits, labels, log_z, final):
    onehot = torch.arange(logits.shape[1], device=logits.device) == labels.unsqueeze(1)
    grad = (torch.exp(logits.float() - log_z.unsqueeze(1)) - onehot.float()) * final.unsqueeze(1)
    return grad.to(logits.dtype)


TORCH_KERNELS = RowKernels(_torch_statistics, _torch_gradient)


def triton_kernels(e4m3_gradient: bool = False) -> RowKernels:
    """The Triton passes, which overwrite the logits with their gradient (a chunk's logits are
    computed only to become it) or, with `e4m3_gradient`, write it quantised for the FP8 head's
    product. Imported on first use: a process that never steps on CUDA never imports Triton."""
    from ..kernels import head_loss as kernels
    if e4m3_gradient:
        return RowKernels(kernels.row_statistics, functools.partial(kernels.e4m3_gradient, row_alignment=ALIGNMENT))
    return RowKernels(kernels.row_statistics, kernels.gradient_in_place)


def head_loss_terms(logits, labels, weights, loss, gamma, dpace_alpha, kernels=TORCH_KERNELS, with_gradient=True):
    """One chunk's (ce, final weights [B, c, slots], argmax hits, d(weighted CE sum)/d(logits) or None)."""
    flat_labels = labels.reshape(-1)
    norm, ce, argmax = kernels.statistics(logits, flat_labels)
    ce = ce.view_as(weights)
    final = loss_weights(ce, weights, loss=loss, gamma=gamma, dpace_alpha=dpace_alpha)
    correct = (argmax == flat_labels).view_as(labels)
    grad_logits = kernels.gradient(logits, flat_labels, norm, final.reshape(-1)) if with_gradient else None
    return ce, final, correct, grad_logits


compiled_head_loss_terms = compiled_function("head_loss", head_loss_terms)
# One fused read of the operand (max, scale, cast) instead of eager's fp32 copies: a chunk's hidden rows
# (and, compiled on the CPU, its [rows, V] gradient, which CUDA's gradient kernel writes in e4m3 itself).
compiled_quantise_rows = compiled_function("fp8_quantise_rows", quantise_rows)


class FusedHeadLoss(torch.autograd.Function):
    """Weighted CE of lm_head(h) over all blocks, `chunk_blocks` blocks at a time, with d(loss)/dh
    computed in the forward pass.

    Activation checkpointing would run each chunk's [rows, V] logits GEMM twice (forward, then
    again in backward); here the forward also forms (softmax - onehot) * weight and multiplies it
    back through the head into one [B, N, Bs, H] gradient, so backward is a scale of one saved
    tensor: the same FLOPs minus one head GEMM per chunk, and logits never outlive their chunk.
    One Function for all chunks rather than one per chunk slice: per-chunk slices cost autograd a
    zero-filled full-size gradient and an accumulation each. `fp8`: the head's Fp8HeadWeight, whose
    FP8 products replace the two bf16 ones (None: bf16); compiled on CUDA, the gradient kernel
    writes the logit gradient straight in e4m3 for the second."""

    @staticmethod
    def forward(ctx, h, head_weight, labels, weights, chunk_blocks, loss, gamma, dpace_alpha, compiled, fp8=None):
        if not compiled:
            terms = head_loss_terms
        elif h.is_cuda:
            terms = functools.partial(head_loss_terms, kernels=triton_kernels(e4m3_gradient=fp8 is not None))
        else:
            terms = compiled_head_loss_terms
        quantise = compiled_quantise_rows if compiled else quantise_rows
        grad_h = torch.empty_like(h)
        loss_sum = weight_sum = 0.0
        correct = []
        for start in range(0, h.shape[1], chunk_blocks):
            part = slice(start, start + chunk_blocks)
            rows = h[:, part].reshape(-1, h.shape[-1]).to(head_weight.dtype)
            logits = rows @ head_weight.T if fp8 is None else fp8.logits(rows, quantise)
            ce, final, hit, grad_logits = terms(logits, labels[:, part], weights[:, part], loss, gamma, dpace_alpha)
            grad_rows = grad_logits @ head_weight if fp8 is None else fp8.input_gradient(grad_logits, quantise)
            grad_h[:, part] = grad_rows[:rows.shape[0]].view_as(grad_h[:, part])   # e4m3 rows come padded
            loss_sum = loss_sum + (final * ce).sum()
            weight_sum = weight_sum + final.sum()
            correct.append(hit)
        ctx.save_for_backward(grad_h)
        correct = torch.cat(correct, dim=1)
        ctx.mark_non_differentiable(weight_sum, correct)
        return loss_sum, weight_sum, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_weight_sum, _grad_correct):
        grad_h, = ctx.saved_tensors
        return grad_h * grad_loss.to(grad_h.dtype), None, None, None, None, None, None, None, None, None


def head_loss(h, head, labels, weights, *, loss, gamma, dpace_alpha, chunk_blocks, compiled):
    """h [B, N, Bs - 1, H] of the drafted slots -> (weighted CE sum, weight sum, argmax == label
    [B, N, Bs - 1]); with grad enabled through `FusedHeadLoss`, without it (evaluation) by the same
    terms, chunk by chunk."""
    if torch.is_grad_enabled():
        return FusedHeadLoss.apply(h, head.lm_head_weight, labels, weights, chunk_blocks, loss, gamma, dpace_alpha,
                                   compiled, head.fp8)
    loss_sum, weight_sum, correct = 0.0, 0.0, []
    for start in range(0, h.shape[1], chunk_blocks):
        part = slice(start, start + chunk_blocks)
        # One [rows, H] x [H, V] GEMM: a 4-D slice can make matmul fall back to a batched GEMM of
        # Bs-row blocks that re-reads the whole LM head per block.
        logits = head.logits(h[:, part].reshape(-1, h.shape[-1]))
        ce, final, hit, _ = head_loss_terms(logits, labels[:, part], weights[:, part], loss, gamma, dpace_alpha,
                                            with_gradient=False)
        loss_sum = loss_sum + (final * ce).sum()
        weight_sum = weight_sum + final.sum()
        correct.append(hit)
    return loss_sum, weight_sum, torch.cat(correct, dim=1)
