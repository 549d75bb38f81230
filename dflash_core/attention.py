"""DFlash attention masks and the two attention backends that share them.

Layout of one attention call (per batch row):
    Q axis:  [block_0 | block_1 | ... | block_{N-1}]          N * Bs queries
    KV axis: [context 0..S-1 | block_0 | ... | block_{N-1}]   S + N * Bs keys

A single `mask_mod` (built by `make_mask_mod`) defines who sees what. Both backends use it:
  - "flex": torch.compile'd flex_attention with a BlockMask from a compiled
    create_block_mask, so no dense [Q, KV] mask is materialised on the GPU;
  - "sdpa": dense reference that evaluates the same mask_mod on broadcast index grids and
    calls F.scaled_dot_product_attention (CPU training, tests).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .compile import compiled_function

LAYER_TYPES = ("full_attention", "sliding_attention")
BACKENDS = ("auto", "flex", "sdpa")


def make_mask_mod(anchors, keep, *, context_len, block_size, layer_type, window=None):
    """Return mask_mod(b, h, q_idx, kv_idx) -> bool for blocks anchored at `anchors` [B, N].

    A query in block j (anchor a, offset q_off) sees
      - context keys kv < a (strictly: the anchor's own target state is not visible);
      - keys of its own block: all of them on full layers, kv_off <= q_off on sliding layers;
      - on sliding layers every key must also lie in the window: pos >= a + q_off - (W - 1);
      - nothing at all if keep[b, j] is False or the query row is padding (q_idx >= N * Bs).
    """
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {layer_type!r}; expected one of {LAYER_TYPES}")
    sliding = layer_type == "sliding_attention"
    if sliding and (window is None or window < 1):
        raise ValueError(f"sliding_attention needs a positive window, got {window!r}")
    num_blocks = anchors.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_blk_raw = q_idx // block_size
        # create_block_mask and the kernels evaluate padded query rows too: clamp the index so
        # the gathers below stay in bounds, and mask those rows out through `live`.
        q_blk = q_blk_raw.clamp(max=num_blocks - 1)
        q_off = q_idx % block_size
        anchor = anchors[b, q_blk]
        live = keep[b, q_blk] & (q_blk_raw < num_blocks)

        is_context = kv_idx < context_len
        kv_blk = (kv_idx - context_len) // block_size
        kv_off = (kv_idx - context_len) % block_size
        visible_context = is_context & (kv_idx < anchor)
        visible_block = ~is_context & (kv_blk == q_blk_raw)
        if sliding:
            visible_block = visible_block & (kv_off <= q_off)
            key_pos = torch.where(is_context, kv_idx, anchor + kv_off)
            in_window = key_pos >= anchor + q_off - (window - 1)
            return live & (visible_context | visible_block) & in_window
        return live & (visible_context | visible_block)

    return mask_mod


def dense_mask(mask_mod, batch, q_len, kv_len, device):
    """Evaluate mask_mod on broadcast index grids: bool [B, 1, Q, KV] (head-independent)."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


# Compiled once per process; shapes are static (fixed anchor count and sequence length), so
# a process compiles each of these once per layer type. CPU flex has no backward: see attend.
_compiled_flex_attention = compiled_function("flex_attention", flex_attention)
# Compiled on CUDA so the dense [Q, KV] mask is never materialised there. On CPU the eager
# version is used: inductor's CPU codegen fails on this mask_mod (torch 2.13: VecMask<int>
# vs VecMask<float> in the padded reduction), and a dense mask is harmless on CPU.
_compiled_create_block_mask = compiled_function("create_block_mask", create_block_mask)


def resolve_backend(backend, device):
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


def build_attention_mask(anchors, keep, *, context_len, block_size, layer_type, window, backend):
    """The mask for one layer type, built once per forward and shared by its layers:
    a BlockMask for flex, a dense bool [B, 1, Q, KV] tensor for sdpa."""
    mask_mod = make_mask_mod(anchors, keep, context_len=context_len, block_size=block_size,
                             layer_type=layer_type, window=window)
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    if resolve_backend(backend, anchors.device) == "sdpa":
        return dense_mask(mask_mod, batch, q_len, kv_len, anchors.device)
    if anchors.device.type != "cuda":
        return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=anchors.device)
    return _compiled_create_block_mask(mask_mod, batch, None, q_len, kv_len, device=anchors.device)


def attend(q, k, v, mask):
    """q [B, Hq, Q, D], k/v [B, Hkv, KV, D] (GQA when Hkv < Hq) -> [B, Hq, Q, D].
    Rows that see no key return exactly 0 on both backends."""
    if isinstance(mask, BlockMask):
        if torch.compiler.is_compiling():  # traced into a compiled drafter layer
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        if q.device.type == "cpu" and torch.is_grad_enabled() and any(
                t.requires_grad for t in (q, k, v)):
            # CPU flex has no backward, and a compiled call with grad-requiring inputs makes
            # dynamo skip the function for the rest of the process. Fail loudly instead.
            raise RuntimeError("flex backend has no backward on CPU; use backend='sdpa'")
        return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    # Expand KV heads rather than enable_gqa: SDPA's memory-efficient CUDA kernel takes a
    # mask but not GQA, and the math fallback would store [B, H, Q, KV] scores.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    has_key = mask.any(dim=-1, keepdim=True)
    # Give fully masked rows one dummy key so softmax stays finite (no NaN in forward or
    # backward), then zero those rows, matching flex.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key)
    return out.masked_fill(~has_key, 0.0)
