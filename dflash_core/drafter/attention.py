"""DFlash attention masks and the attention backends that share them.

Layout of one attention call (per batch row):
    Q axis:  [block_0 | block_1 | ... | block_{N-1}]          N * Bs queries
    KV axis: [context 0..S-1 | block_0 | ... | block_{N-1}]   S + N * Bs keys

Who sees what is defined by `query_intervals`: every query sees one interval of context keys
and one interval of its own block's keys. `make_mask_mod` states the same rules as per-block
gathers and comparisons (tests hold the two equal), and every backend uses it:
  - "flex": torch.compile'd flex_attention with a BlockMask built directly from the intervals
    (`interval_block_mask`: a few eager ops per micro-batch, nothing compiled, no dense
    [Q, KV] mask); tiles the intervals only partly cover apply the mask_mod. Inductor's Triton
    kernels run it;
  - "flash": the same flex_attention call and BlockMask run by flash-attn-4's CuTe kernels
    (flex's FLASH backend: FA3-class on Hopper, faster than the Triton kernels on this mask).
    Needs the `flash` extra and a GPU of compute capability 9.0 or newer. Chosen explicitly,
    never by auto: it pays at production shapes but compiles its kernels longer cold, and at toy
    shapes its step is slower (docs/perf_notes.md, "Where the flash step stands, and why auto
    keeps flex");
  - "sdpa": dense reference that evaluates the mask_mod on broadcast index grids and calls
    F.scaled_dot_product_attention (CPU training, tests).

Packed rows (several documents in one row) enter as `doc_starts` [B, N]: the first context
index of each block's document. Document ids are data, not shape, so one compiled graph serves
packed and unpacked rows alike.
"""

import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from .compile import compiled_function

LAYER_TYPES = ("full_attention", "sliding_attention")
FLEX_BACKENDS = ("flex", "flash")  # the flex_attention call with a BlockMask, by its kernels
RESOLVED_BACKENDS = (*FLEX_BACKENDS, "sdpa")  # what resolve_backend answers: the kernels a forward runs
BACKENDS = ("auto", *RESOLVED_BACKENDS)
TILE = 128  # flex_attention's default sparse block (tile) size, on both axes
_PADDED_ROWS = 256  # query rows of the largest kernel tile (FLASH: 2 x 128 on Hopper)


def block_doc_starts(anchors, position_ids=None):
    """[B, N]: the first row index of each anchor's document (position_ids restart at 0 at
    every document start); zeros for unpacked rows (position_ids None)."""
    if position_ids is None:
        return torch.zeros_like(anchors)
    return anchors - position_ids.gather(1, anchors)


def query_intervals(b, q_idx, anchors, keep, doc_starts, *, context_len, block_size, window):
    """The keys a query sees: [ctx_lo, ctx_hi) of the context and [blk_lo, blk_hi) of the KV
    axis's block part, both only where `live`. -> (live, ctx_lo, ctx_hi, blk_lo, blk_hi).

    A query in block j (anchor a, document start d, offset q_off) sees
      - context keys d <= kv < a (strictly before the anchor, never another document's);
      - keys of its own block: all of them on full layers (window None), kv_off <= q_off on
        sliding layers;
      - on sliding layers every key must also lie in the window: key position >= a + q_off - (W - 1)
        (positions are contiguous inside a document, so the window is the same in row indices);
      - nothing at all if keep[b, j] is False or the query row is padding (q_idx >= N * Bs).
    b and q_idx broadcast (scalars inside flex, index grids for the dense mask and the BlockMask)."""
    num_blocks = anchors.shape[1]
    q_blk_raw = q_idx // block_size
    # create_block_mask and the kernels evaluate padded query rows too: clamp the index so the
    # gathers stay in bounds, and mask those rows out through `live`.
    q_blk = q_blk_raw.clamp(max=num_blocks - 1)
    anchor = anchors[b, q_blk]
    live = keep[b, q_blk] & (q_blk_raw < num_blocks)
    ctx_lo = doc_starts[b, q_blk]
    blk_lo = context_len + q_blk * block_size
    blk_hi = blk_lo + block_size
    if window is not None:
        q_off = q_idx % block_size
        oldest = q_off - (window - 1)  # the oldest visible key, relative to the anchor
        ctx_lo = torch.maximum(ctx_lo, anchor + oldest)
        blk_hi = blk_lo + q_off + 1
        blk_lo = blk_lo + oldest.clamp(min=0)
    return live, ctx_lo, anchor.clamp(max=context_len), blk_lo, blk_hi


def _layer_window(layer_type, window):
    if layer_type not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {layer_type!r}; expected one of {LAYER_TYPES}")
    if layer_type == "full_attention":
        return None
    if window is None or window < 1:
        raise ValueError(f"sliding_attention needs a positive window, got {window!r}")
    return window


def make_mask_mod(anchors, keep, *, context_len, block_size, layer_type, window=None, doc_starts=None):
    """Return mask_mod(b, h, q_idx, kv_idx) -> bool for blocks anchored at `anchors` [B, N]
    (documents starting at `doc_starts` [B, N], zeros when None): kv lies in one of the
    query's `query_intervals`.

    The per-block bounds are computed here, once, and the mask_mod only gathers them at the
    query's block and compares: no min, max or clamp, which the CuTe code generator behind
    flex's FLASH kernels lacks (torch 2.11). A bound that would be a max (sliding windows) is
    one more comparison instead. The bounds cover every query row a kernel may evaluate (up to
    a multiple of `_PADDED_ROWS`) with dead blocks, so padded rows gather in bounds and see nothing."""
    window = _layer_window(layer_type, window)
    if doc_starts is None:
        doc_starts = torch.zeros_like(anchors)
    batch, num_blocks = anchors.shape
    padded_blocks = -(-(-(-num_blocks * block_size // _PADDED_ROWS) * _PADDED_ROWS) // block_size)

    def per_block(values, dead):
        values = torch.where(keep, values, dead).to(torch.int32)
        return torch.cat([values, values.new_full((batch, padded_blocks - num_blocks), dead)], dim=1)

    own_starts = context_len + block_size * torch.arange(num_blocks, device=anchors.device)
    kv_len = context_len + num_blocks * block_size
    ctx_lo = per_block(doc_starts, 0)
    ctx_hi = per_block(anchors.clamp(max=context_len), 0)          # dead: [0, 0) is empty
    own_lo = per_block(own_starts.expand_as(anchors), kv_len)      # dead: starts past every key
    anchor = per_block(anchors, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        lo = own_lo[b, block]
        in_context = (ctx_lo[b, block] <= kv_idx) & (kv_idx < ctx_hi[b, block])
        if window is None:
            return in_context | ((lo <= kv_idx) & (kv_idx < lo + block_size))
        q_off = q_idx % block_size
        oldest = q_off - (window - 1)  # the oldest visible key, relative to the anchor
        in_window = in_context & (kv_idx >= anchor[b, block] + oldest)
        return in_window | ((lo <= kv_idx) & (kv_idx <= lo + q_off) & (kv_idx - lo >= oldest))

    return mask_mod


def dense_mask(mask_mod, batch, q_len, kv_len, device):
    """Evaluate mask_mod on broadcast index grids: bool [B, 1, Q, KV] (head-independent)."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


def _ordered(tiles):
    """bool [B, H, R, C] -> (count int32 [B, H, R], columns int32 [B, H, R, C]): per row the
    marked columns ascending, then the others ascending (the layout create_block_mask makes
    with a stable argsort; here a cumsum and a scatter, no sort)."""
    marked = tiles.to(torch.int32)
    count = marked.sum(-1, dtype=torch.int32)
    rank = torch.where(tiles, marked.cumsum(-1) - 1, count.unsqueeze(-1) + (1 - marked).cumsum(-1) - 1)
    columns = torch.arange(tiles.shape[-1], dtype=torch.int32, device=tiles.device).expand_as(rank)
    return count, torch.empty_like(columns).scatter_(-1, rank.long(), columns)


def interval_block_mask(anchors, keep, doc_starts, *, context_len, block_size, window, mask_mod, tile=TILE):
    """The flex BlockMask of `query_intervals` without evaluating the mask per (query, key) and
    without compiling anything: a tile is skipped when no query row's interval touches it, full
    when every row's interval covers it, partial (mask_mod applied) otherwise. Padded rows and
    keys count as invisible, so the result equals create_block_mask(mask_mod, B, None, Q, KV).

    Each row's interval touches a contiguous range of key tiles and covers a contiguous range;
    per query tile, the rows touching / covering each key tile are counted with a difference
    array (two scatter-adds and a cumsum over [B, Q/tile, KV/tile]), so the cost is linear in Q."""
    batch, num_blocks = anchors.shape
    q_len = num_blocks * block_size
    kv_len = context_len + q_len
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    device = anchors.device
    q = torch.arange(q_tiles * tile, device=device)
    live, ctx_lo, ctx_hi, blk_lo, blk_hi = query_intervals(
        torch.arange(batch, device=device).unsqueeze(1), q.unsqueeze(0), anchors, keep, doc_starts,
        context_len=context_len, block_size=block_size, window=window)
    # Row r's tile ranges go to slots [q_tile(r), first .. last + 1] of a flat difference array.
    row_base = (q // tile * (kv_tiles + 1)).expand(batch, -1)
    touching = torch.zeros(batch, q_tiles * (kv_tiles + 1), dtype=torch.int32, device=device)
    covering = torch.zeros_like(touching)

    def add_ranges(counts, first, last, valid):
        valid = (valid & (first <= last)).to(torch.int32)
        counts.scatter_add_(1, row_base + first, valid)
        counts.scatter_add_(1, row_base + last + 1, -valid)

    for lo, hi in ((ctx_lo, ctx_hi), (blk_lo, blk_hi)):
        add_ranges(touching, lo // tile, (hi - 1) // tile, live & (lo < hi))
        # Covered tiles lie wholly inside [lo, hi), hence inside kv_len: padding is never covered.
        # The two intervals are disjoint, so no tile is counted twice for one row.
        add_ranges(covering, -(-lo // tile), hi // tile - 1, live)

    shape = (batch, 1, q_tiles, kv_tiles + 1)
    touched = touching.view(shape).cumsum(-1)[..., :kv_tiles] > 0
    # Every one of the tile's query rows covers it (padded rows are dead, so a ragged last
    # query tile is never full). Where the two intervals abut, a tile they cover only together
    # stays partial: still exact, as partial tiles apply the mask_mod.
    full = covering.view(shape).cumsum(-1)[..., :kv_tiles] == tile
    partial_count, partial_columns = _ordered(touched & ~full)
    full_count, full_columns = _ordered(full)
    return BlockMask.from_kv_blocks(partial_count, partial_columns, full_count, full_columns,
                                    BLOCK_SIZE=(tile, tile), mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


# Compiled once per process; shapes are static (fixed anchor count and sequence length), so
# a process compiles this once per layer type. CPU flex has no backward: see attend.
_compiled_flex_attention = compiled_function("flex_attention", flex_attention)


def flash_unavailable(device) -> str | None:
    """Why flex's FLASH kernels cannot run on `device`, or None when they can."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"it needs a CUDA GPU, not {device}" if device.type != "cuda" else "no CUDA GPU is available"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or newer (Hopper), this GPU has {major}.{minor}"
    try:  # an optional dependency: flex imports it when it lowers a FLASH call
        importlib.import_module("flash_attn.cute")
    except ImportError as error:
        return f"flash-attn-4 is not installed ({error}); pip install 'dflash-launcher[flash]'"
    return None


def resolve_backend(backend, device):
    """auto: sdpa on CPU, flex on a GPU (flash is chosen explicitly: see the module docstring).
    A flash that cannot run is an error, never a quiet switch to another kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    if backend == "flash" and (reason := flash_unavailable(device)):
        raise ValueError(f"attention backend 'flash' cannot run here: {reason}")
    return backend


def build_attention_mask(anchors, keep, *, context_len, block_size, layer_type, window, backend,
                         position_ids=None):
    """The mask for one layer type, built once per forward and shared by its layers: a BlockMask
    for flex, a dense bool [B, 1, Q, KV] tensor for sdpa. position_ids [B, S] (restarting at 0 at
    every document start) confine each block to its document; None: one document per row."""
    doc_starts = block_doc_starts(anchors, position_ids)
    mask_mod = make_mask_mod(anchors, keep, context_len=context_len, block_size=block_size,
                             layer_type=layer_type, window=window, doc_starts=doc_starts)
    if resolve_backend(backend, anchors.device) == "sdpa":
        q_len = anchors.shape[1] * block_size
        return dense_mask(mask_mod, anchors.shape[0], q_len, context_len + q_len, anchors.device)
    return interval_block_mask(anchors, keep, doc_starts, context_len=context_len, block_size=block_size,
                               window=_layer_window(layer_type, window), mask_mod=mask_mod)


def attend(q, k, v, mask, backend="flex"):
    """q [B, Hq, Q, D], k/v [B, Hkv, KV, D] (GQA when Hkv < Hq) -> [B, Hq, Q, D], by the resolved
    `backend` the mask was built for. Rows that see no key return exactly 0 on every backend."""
    if isinstance(mask, BlockMask):
        options = {"BACKEND": "FLASH"} if backend == "flash" else None
        if torch.compiler.is_compiling():  # traced into a compiled drafter layer
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
                                  kernel_options=options)
        if q.device.type == "cpu" and torch.is_grad_enabled() and any(
                t.requires_grad for t in (q, k, v)):
            # CPU flex has no backward, and a compiled call with grad-requiring inputs makes
            # dynamo skip the function for the rest of the process. Fail loudly instead.
            raise RuntimeError("flex backend has no backward on CPU; use backend='sdpa'")
        return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1],
                                        kernel_options=options)
    # Expand KV heads rather than enable_gqa: SDPA's memory-efficient CUDA kernel takes a
    # mask but not GQA, and the math fallback would store [B, H, Q, KV] scores.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    has_key = mask.any(dim=-1, keepdim=True)
    # Give fully masked rows one dummy key so softmax stays finite (no NaN in forward or
    # backward), then zero those rows, matching flex.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has_key)
    return out.masked_fill(~has_key, 0.0)
