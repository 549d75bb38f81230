"""The head loss's two vocabulary-wide passes (dflash_core/loss/head_loss.py) as Triton kernels, for
CUDA: exactly the passes the loss needs over the logits (why: docs/perf_notes.md, "Step time,
fourth pass").

  1. row statistics, one program per row: a single read of the row in BLOCK-sized chunks, with an
     online max and sum of exponentials in fp32, the argmax, the largest logit off the label and the
     label's logit -> log_z, ce, argmax and the row's peak, its largest |softmax - onehot(label)|;
  2. gradient, one program per BLOCK of a row: (exp(logit - log_z) - onehot(label)) * final weight,
     read and written in the logits' own storage, or written as e4m3 with one power-of-two scale per
     row for the FP8 head's input-gradient product.

Between them the caller turns ce into the final loss weights. The gradient overwrites the logits:
the caller computes each chunk's logits only to turn them into this gradient, so a second [rows, V]
buffer per chunk is never allocated. Each element is read and written by the same program, and the
statistics kernel has read the whole row before the gradient kernel starts (same stream), so in
place is safe. The e4m3 gradient needs its row's largest magnitude before any of its programs
writes: that is peak * |final| exactly, the peak being max(exp(largest logit off the label - log_z),
1 - exp(label logit - log_z)) in the same fp32 arithmetic the gradient uses, so no extra pass over
the row reduces it (a separate quantisation reads the bf16 gradient back twice). This module imports
nothing from the project."""

import functools
from typing import NamedTuple

import torch


@functools.cache   # built on first use: importing Triton costs a process that never steps on CUDA
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(logits_ptr, labels_ptr, log_z_ptr, ce_ptr, argmax_ptr, peak_ptr, vocab,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * vocab   # rows * V passes 2**31 at the production shape
        label = tl.load(labels_ptr + row)
        columns = tl.arange(0, BLOCK)
        running_max = -float("inf")
        other_max = -float("inf")
        exp_sum = 0.0
        argmax = 0
        for start in range(0, vocab, BLOCK):
            x = tl.load(row_ptr + start + columns, mask=start + columns < vocab, other=-float("inf")).to(tl.float32)
            other_max = tl.maximum(other_max, tl.max(tl.where(start + columns == label, -float("inf"), x), axis=0))
            block_max, block_argmax = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            new_max = tl.maximum(running_max, block_max)
            exp_sum = exp_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            # Strictly greater: a tie with an earlier chunk keeps the earlier index, as torch.argmax does.
            argmax = tl.where(block_max > running_max, start + block_argmax, argmax)
            running_max = new_max
        log_z = running_max + tl.log(exp_sum)
        label_logit = tl.load(row_ptr + label).to(tl.float32)
        tl.store(log_z_ptr + row, log_z)
        tl.store(ce_ptr + row, log_z - label_logit)
        tl.store(argmax_ptr + row, argmax)
        tl.store(peak_ptr + row, tl.maximum(tl.exp(other_max - log_z), 1.0 - tl.exp(label_logit - log_z)))

    @triton.jit
    def gradient_kernel(logits_ptr, out_ptr, scale_ptr, labels_ptr, log_z_ptr, peak_ptr, final_ptr, vocab,
                        BLOCK: tl.constexpr, E4M3: tl.constexpr):
        blocks_per_row = tl.cdiv(vocab, BLOCK)
        row = tl.program_id(0) // blocks_per_row   # one flat grid axis: no 65535 limit on rows
        column_block = tl.program_id(0) % blocks_per_row
        columns = column_block * BLOCK + tl.arange(0, BLOCK)
        inside = columns < vocab
        offsets = row.to(tl.int64) * vocab + columns
        x = tl.load(logits_ptr + offsets, mask=inside).to(tl.float32)
        onehot = (columns == tl.load(labels_ptr + row)).to(tl.float32)
        final = tl.load(final_ptr + row)
        grad = (tl.exp(x - tl.load(log_z_ptr + row)) - onehot) * final
        if E4M3:
            # fp8.quantise_rows's scale: the power of two bringing the row's amax closest to, not above,
            # e4m3's largest (448); the exponent read from the bits of a correctly rounded 448 / amax.
            amax = tl.maximum(tl.load(peak_ptr + row) * tl.abs(final), 1e-12)
            exponent = (tl.div_rn(448.0, amax).to(tl.int32, bitcast=True) >> 23) & 0xFF
            inverse = (exponent << 23).to(tl.float32, bitcast=True)
            q = tl.minimum(tl.maximum(grad * inverse, -448.0), 448.0)
            tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty), mask=inside)
            tl.store(scale_ptr + row, 1.0 / inverse, mask=column_block == 0)
        else:
            tl.store(out_ptr + offsets, grad.to(out_ptr.dtype.element_ty), mask=inside)

    return row_stats_kernel, gradient_kernel


# Logits per program step and warps per program, for both kernels; not yet tuned on an H200. At
# 8 warps a step of 4096 bf16 logits is two 16-byte loads per thread (vectorised when V % 16 == 0,
# which Triton specialises on: 151936 is), and sm_90 builds need 40 (statistics) and 32 (gradient)
# registers per thread, so several programs share an SM to keep loads in flight.
BLOCK, NUM_WARPS = 4096, 8


class RowNorm(NamedTuple):
    """What the gradient pass reads of each row's statistics: log_z and peak, fp32 [rows]."""
    log_z: torch.Tensor
    peak: torch.Tensor


def row_statistics(logits, labels):
    """logits [rows, V] (any float dtype, contiguous), labels [rows] in [0, V) -> RowNorm, ce (fp32), argmax."""
    row_stats_kernel, _ = _kernels()
    rows, vocab = logits.shape
    log_z = torch.empty(rows, dtype=torch.float32, device=logits.device)
    ce, peak = torch.empty_like(log_z), torch.empty_like(log_z)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    row_stats_kernel[(rows,)](logits.contiguous(), labels.contiguous(), log_z, ce, argmax, peak, vocab, BLOCK=BLOCK,
                              num_warps=NUM_WARPS)
    return RowNorm(log_z, peak), ce, argmax


def _gradient(logits, out, scale, labels, norm, final):
    _, gradient_kernel = _kernels()
    rows, vocab = logits.shape
    gradient_kernel[(rows * ((vocab + BLOCK - 1) // BLOCK),)](
        logits, out, scale, labels.contiguous(), norm.log_z, norm.peak, final.float().contiguous(), vocab,
        BLOCK=BLOCK, E4M3=out.dtype == torch.float8_e4m3fn, num_warps=NUM_WARPS)


def gradient_in_place(logits, labels, norm, final):
    """(softmax - onehot) * final [rows], written over `logits` and returned: the logits are consumed,
    so a caller must not read them after this call."""
    if not logits.is_contiguous():
        raise ValueError("gradient_in_place writes the gradient into the logits: they must be contiguous")
    _gradient(logits, logits, norm.peak, labels, norm, final)   # no scales: scale_ptr is never written
    return logits


def e4m3_gradient(logits, labels, norm, final, row_alignment):
    """(softmax - onehot) * final [rows] as (q [padded rows, V] e4m3, scale [padded rows, 1] fp32) with
    gradient ~= q * scale, scaled per row as fp8.quantise_rows scales; rows up to a multiple of
    `row_alignment` (torch._scaled_mm's on CUDA) are zeros with scale 1."""
    rows, vocab = logits.shape
    padded = -(-rows // row_alignment) * row_alignment
    q = torch.empty(padded, vocab, dtype=torch.float8_e4m3fn, device=logits.device)
    scale = torch.ones(padded, 1, dtype=torch.float32, device=logits.device)
    q[rows:] = 0
    _gradient(logits.contiguous(), q, scale, labels, norm, final)
    return q, scale
