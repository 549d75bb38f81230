"""The head loss's two vocabulary-wide passes (dflash_core/loss/head_loss.py) as Triton kernels, for
CUDA: exactly the passes the loss needs over the logits (why: docs/perf_notes.md, "Step time,
fourth pass").

  1. row statistics, one program per row: a single read of the row in BLOCK-sized chunks, with an
     online max and sum of exponentials in fp32, the argmax and the label's logit -> log_z, ce, argmax;
  2. gradient, one program per BLOCK of a row: (exp(logit - log_z) - onehot(label)) * final weight,
     read and written in the logits' own storage.

Between them the caller turns ce into the final loss weights. The gradient overwrites the logits:
the caller computes each chunk's logits only to turn them into this gradient, so a second [rows, V]
buffer per chunk is never allocated. Each element is read and written by the same program, and the
statistics kernel has read the whole row before the gradient kernel starts (same stream), so in
place is safe. This module imports nothing from the project."""

import functools

import torch


@functools.cache   # built on first use: importing Triton costs a process that never steps on CUDA
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(logits_ptr, labels_ptr, log_z_ptr, ce_ptr, argmax_ptr, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * vocab   # rows * V passes 2**31 at the production shape
        columns = tl.arange(0, BLOCK)
        running_max = -float("inf")
        exp_sum = 0.0
        argmax = 0
        for start in range(0, vocab, BLOCK):
            x = tl.load(row_ptr + start + columns, mask=start + columns < vocab, other=-float("inf")).to(tl.float32)
            block_max, block_argmax = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            new_max = tl.maximum(running_max, block_max)
            exp_sum = exp_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            # Strictly greater: a tie with an earlier chunk keeps the earlier index, as torch.argmax does.
            argmax = tl.where(block_max > running_max, start + block_argmax, argmax)
            running_max = new_max
        log_z = running_max + tl.log(exp_sum)
        label_logit = tl.load(row_ptr + tl.load(labels_ptr + row)).to(tl.float32)
        tl.store(log_z_ptr + row, log_z)
        tl.store(ce_ptr + row, log_z - label_logit)
        tl.store(argmax_ptr + row, argmax)

    @triton.jit
    def gradient_kernel(logits_ptr, labels_ptr, log_z_ptr, final_ptr, vocab, BLOCK: tl.constexpr):
        blocks_per_row = tl.cdiv(vocab, BLOCK)
        row = tl.program_id(0) // blocks_per_row   # one flat grid axis: no 65535 limit on rows
        columns = (tl.program_id(0) % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
        inside = columns < vocab
        offsets = row.to(tl.int64) * vocab + columns
        x = tl.load(logits_ptr + offsets, mask=inside).to(tl.float32)
        onehot = (columns == tl.load(labels_ptr + row)).to(tl.float32)
        grad = (tl.exp(x - tl.load(log_z_ptr + row)) - onehot) * tl.load(final_ptr + row)
        tl.store(logits_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=inside)

    return row_stats_kernel, gradient_kernel


# Logits per program step and warps per program, for both kernels; not yet tuned on an H200. At
# 8 warps a step of 4096 bf16 logits is two 16-byte loads per thread (vectorised when V % 16 == 0,
# which Triton specialises on: 151936 is), and sm_90 builds need 40 (statistics) and 32 (gradient)
# registers per thread, so several programs share an SM to keep loads in flight.
BLOCK, NUM_WARPS = 4096, 8


def row_statistics(logits, labels):
    """logits [rows, V] (any float dtype, contiguous), labels [rows] in [0, V) -> log_z, ce (fp32), argmax."""
    row_stats_kernel, _ = _kernels()
    rows, vocab = logits.shape
    log_z = torch.empty(rows, dtype=torch.float32, device=logits.device)
    ce = torch.empty_like(log_z)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    row_stats_kernel[(rows,)](logits.contiguous(), labels.contiguous(), log_z, ce, argmax, vocab, BLOCK=BLOCK,
                              num_warps=NUM_WARPS)
    return log_z, ce, argmax


def gradient_in_place(logits, labels, log_z, final):
    """(softmax - onehot) * final [rows], written over `logits` and returned: the logits are consumed,
    so a caller must not read them after this call."""
    _, gradient_kernel = _kernels()
    if not logits.is_contiguous():
        raise ValueError("gradient_in_place writes the gradient into the logits: they must be contiguous")
    rows, vocab = logits.shape
    gradient_kernel[(rows * ((vocab + BLOCK - 1) // BLOCK),)](
        logits, labels.contiguous(), log_z, final.float().contiguous(), vocab, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return logits
