"""The loss at the target's frozen LM head: weighted cross-entropy of lm_head(h) over all blocks, with
drafter.kl_weight > 0 partly or wholly KL from the target's own distribution at each position.

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
from ..drafter.selector import top_candidates
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


def head_loss_terms(logits, labels, weights, loss, gamma, dpace_alpha, kernels=TORCH_KERNELS, with_gradient=True,
                    teacher_logits=None, kl_weight=0.0):
    """One chunk's (per-position loss, final weights [B, c, slots], argmax hits, d(weighted loss sum)/d(logits)
    or None). The per-position loss is the label's CE, or with `teacher_logits` [rows, V] (the target's
    logits at the same positions; torch's kernels only) (1 - kl_weight) * CE + kl_weight * KL(p || q), p
    the teacher's softmax and q the drafter's: its logit gradient is q - ((1 - kl_weight) onehot + kl_weight
    p). D-PACE's acceptance estimate reads the label's CE either way."""
    flat_labels = labels.reshape(-1)
    norm, ce, argmax = kernels.statistics(logits, flat_labels)
    ce = ce.view_as(weights)
    final = loss_weights(ce, weights, loss=loss, gamma=gamma, dpace_alpha=dpace_alpha)
    correct = (argmax == flat_labels).view_as(labels)
    if teacher_logits is None:
        grad_logits = kernels.gradient(logits, flat_labels, norm, final.reshape(-1)) if with_gradient else None
        return ce, final, correct, grad_logits
    log_p = torch.log_softmax(teacher_logits.float(), dim=-1)
    p = torch.exp(log_p)
    log_q = logits.float() - norm.unsqueeze(1)
    kl = (p * (log_p - log_q)).sum(dim=-1).view_as(ce)
    per_position = (1 - kl_weight) * ce + kl_weight * kl
    grad_logits = None
    if with_gradient:
        onehot = torch.arange(logits.shape[1], device=logits.device) == flat_labels.unsqueeze(1)
        target = (1 - kl_weight) * onehot.float() + kl_weight * p
        grad_logits = ((torch.exp(log_q) - target) * final.reshape(-1, 1)).to(logits.dtype)
    return per_position, final, correct, grad_logits


compiled_head_loss_terms = compiled_function("head_loss", head_loss_terms)
# One fused read of the operand (max, scale, cast) instead of eager's fp32 copies: a chunk's hidden rows
# (and, compiled on the CPU, its [rows, V] gradient, which CUDA's gradient kernel writes in e4m3 itself).
compiled_quantise_rows = compiled_function("fp8_quantise_rows", quantise_rows)


class HeadLoss(NamedTuple):
    """What `head_loss` gives for h [B, N, S, H] of the drafted slots."""
    loss_sum: torch.Tensor           # the weighted loss sum (with its graph when training): CE, or CE and KL
    weight_sum: torch.Tensor         # the sum of the final loss weights
    correct: torch.Tensor            # argmax == label [B, N, S]
    final: torch.Tensor              # the final loss weights [B, N, S] (no graph)
    candidate_logits: torch.Tensor | None   # top_k: [B, N, S, K + 1] the head's logits of the top-K (best
    #                                         first), then of the label (with its graph when training)
    candidate_ids: torch.Tensor | None      # top_k: [B, N, S, K + 1] their token ids


def _candidates(logits, flat_labels, top_k):
    """A chunk's logits [rows, V] -> (logits [rows, K + 1] of its top-K then of the label, their ids)."""
    values, ids = top_candidates(logits, top_k)
    label = flat_labels.unsqueeze(1)
    return torch.cat([values, logits.gather(1, label)], dim=1), torch.cat([ids, label], dim=1)


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
    writes the logit gradient straight in e4m3 for the second.

    `top_k` > 0 (DFlash 2's selector): each row's top-K logits and its label's leave as a
    differentiable output, taken before the gradient pass (on CUDA it overwrites the logits). Their
    gradient reaches h in backward through the K + 1 head rows alone: a gathered [rows, K + 1, H]
    product per chunk, not another [rows, V] GEMM.

    `teacher` [B, N, S, H] (drafter.kl_weight > 0): the target's final normed hidden state at the
    position each drafted slot is predicted from; each chunk's teacher logits are the frozen head's own
    product of it (its dtype, never FP8; no gradient), and the terms are torch's, compiled where the step
    is (the Triton kernels compute the label's CE only)."""

    @staticmethod
    def forward(ctx, h, head_weight, labels, weights, chunk_blocks, loss, gamma, dpace_alpha, compiled, fp8=None,
                top_k=0, teacher=None, kl_weight=0.0):
        if not compiled:
            terms = head_loss_terms
        elif h.is_cuda and teacher is None:
            terms = functools.partial(head_loss_terms, kernels=triton_kernels(e4m3_gradient=fp8 is not None))
        else:
            terms = compiled_head_loss_terms
        quantise = compiled_quantise_rows if compiled else quantise_rows
        grad_h = torch.empty_like(h)
        loss_sum = weight_sum = 0.0
        correct, finals, candidates = [], [], []
        for start in range(0, h.shape[1], chunk_blocks):
            part = slice(start, start + chunk_blocks)
            rows = h[:, part].reshape(-1, h.shape[-1]).to(head_weight.dtype)
            logits = rows @ head_weight.T if fp8 is None else fp8.logits(rows, quantise)
            if top_k:
                candidates.append(_candidates(logits, labels[:, part].reshape(-1), top_k))
            ce, final, hit, grad_logits = terms(logits, labels[:, part], weights[:, part], loss, gamma, dpace_alpha,
                                                **_teaching(teacher, part, head_weight, kl_weight))
            grad_rows = grad_logits @ head_weight if fp8 is None else fp8.input_gradient(grad_logits, quantise)
            grad_h[:, part] = grad_rows[:rows.shape[0]].view_as(grad_h[:, part])   # e4m3 rows come padded
            loss_sum = loss_sum + (final * ce).sum()
            weight_sum = weight_sum + final.sum()
            correct.append(hit)
            finals.append(final)
        correct, final = torch.cat(correct, dim=1), torch.cat(finals, dim=1)
        candidate_logits, candidate_ids = _joined(candidates, labels.shape)
        ctx.chunk_blocks = chunk_blocks
        ctx.save_for_backward(grad_h, *((head_weight, candidate_ids) if top_k else ()))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(weight_sum, correct, final, *(() if candidate_ids is None else (candidate_ids,)))
        return loss_sum, weight_sum, correct, final, candidate_logits, candidate_ids

    @staticmethod
    def backward(ctx, grad_loss, _grad_weight_sum, _grad_correct, _grad_final, grad_candidates, _grad_ids):
        grad_h, *candidates = ctx.saved_tensors
        grad = grad_h * grad_loss.to(grad_h.dtype) if grad_loss is not None else torch.zeros_like(grad_h)
        if grad_candidates is not None:
            head_weight, candidate_ids = candidates
            for start in range(0, grad.shape[1], ctx.chunk_blocks):
                part = slice(start, start + ctx.chunk_blocks)
                rows = head_weight[candidate_ids[:, part]]   # [B, c, S, K + 1, H]
                grad[:, part] += (grad_candidates[:, part].to(rows.dtype).unsqueeze(-2) @ rows).squeeze(-2).to(
                    grad.dtype)
        return grad, None, None, None, None, None, None, None, None, None, None, None, None


def _teaching(teacher, part, head_weight, kl_weight) -> dict:
    """head_loss_terms' teacher arguments for one chunk's blocks: the target's logits there (none without
    a teacher)."""
    if teacher is None:
        return {}
    rows = teacher[:, part].reshape(-1, teacher.shape[-1]).to(head_weight.dtype)
    return {"teacher_logits": rows @ head_weight.T, "kl_weight": kl_weight}


def _joined(candidates, shape):
    """The chunks' (logits, ids) [rows, K + 1] -> [B, N, S, K + 1] each; (None, None) without any."""
    if not candidates:
        return None, None
    batch, blocks, slots = shape
    logits, ids = zip(*candidates)
    return tuple(torch.cat([t.view(batch, -1, slots, t.shape[-1]) for t in parts], dim=1) for parts in (logits, ids))


def head_loss(h, head, labels, weights, *, loss, gamma, dpace_alpha, chunk_blocks, compiled, top_k=0, teacher=None,
              kl_weight=0.0) -> HeadLoss:
    """h [B, N, Bs - 1, H] of the drafted slots -> HeadLoss; with grad enabled through `FusedHeadLoss`,
    without it (evaluation) by the same terms, chunk by chunk. top_k > 0: also each slot's top-K
    candidates and its label's logit (HeadLoss.candidate_*). teacher [B, N, Bs - 1, H] with kl_weight > 0:
    the target's final hidden state for each slot, whose softmax through the head the KL share reads."""
    if torch.is_grad_enabled():
        return HeadLoss(*FusedHeadLoss.apply(h, head.lm_head_weight, labels, weights, chunk_blocks, loss, gamma,
                                             dpace_alpha, compiled, head.fp8, top_k, teacher, kl_weight))
    loss_sum, weight_sum, correct, finals, candidates = 0.0, 0.0, [], [], []
    for start in range(0, h.shape[1], chunk_blocks):
        part = slice(start, start + chunk_blocks)
        # One [rows, H] x [H, V] GEMM: a 4-D slice can make matmul fall back to a batched GEMM of
        # Bs-row blocks that re-reads the whole LM head per block.
        logits = head.logits(h[:, part].reshape(-1, h.shape[-1]))
        if top_k:
            candidates.append(_candidates(logits, labels[:, part].reshape(-1), top_k))
        ce, final, hit, _ = head_loss_terms(logits, labels[:, part], weights[:, part], loss, gamma, dpace_alpha,
                                            with_gradient=False,
                                            **_teaching(teacher, part, head.lm_head_weight, kl_weight))
        loss_sum = loss_sum + (final * ce).sum()
        weight_sum = weight_sum + final.sum()
        correct.append(hit)
        finals.append(final)
    return HeadLoss(loss_sum, weight_sum, torch.cat(correct, dim=1), torch.cat(finals, dim=1),
                    *_joined(candidates, labels.shape))
