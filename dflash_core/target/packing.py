"""Packed rows in the target: several documents per row, told apart by position ids restarting at 0.

Attention: given position ids, no attention mask and no cache, transformers builds a
block-diagonal causal mask (masking_utils.find_packed_sequence_indices, 5.17 and later: a
document starts wherever a position is not its predecessor + 1), for the eager and sdpa
backends alike, sliding windows included, in every family whose decoder hands its position
ids to the mask functions. gpt-oss's decoder does not (5.17 to 5.24): for it
`block_diagonal_masks` builds the per-layer-type masks and the decoder takes them as is.

A recurrent token mixer (Qwen3.5's gated delta net) does not look at position ids: its
short causal convolution and its chunked scan run across the whole row, and transformers'
torch fallback ignores `cu_seqlens` (only the flash-linear-attention kernels take it, and
transformers passes it only on the flash-attention path). So `RecurrentRegrouping` hooks each
such module: its input [B, S, H] is regrouped into one right-padded row per document
[N, L, H], where convolution and scan start from zero exactly as for the document alone, and
its output is scattered back. Right padding is harmless because both are causal. The cost is
the padding: N * L tokens instead of B * S (a long document beside short ones pads them all).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .families import VARLEN, TargetError


class Documents:
    """Where each document of a packed [B, S] batch lies: its index and the offset inside it."""

    def __init__(self, position_ids: torch.Tensor):
        if position_ids.dim() != 2:
            raise TargetError(f"position_ids must be [batch, seq_len], got shape {tuple(position_ids.shape)}")
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        misplaced = (starts & (position_ids != 0)).nonzero()
        if len(misplaced):
            row, column = misplaced[0].tolist()
            raise TargetError(f"position_ids must restart at 0 at every document start and count up by 1: "
                              f"row {row}, token {column} starts a document at position "
                              f"{int(position_ids[row, column])}")
        self.shape = tuple(position_ids.shape)
        self.document = starts.flatten().cumsum(0) - 1   # [B*S] document index of every token
        self.offset = position_ids.flatten()             # [B*S] its position inside the document
        self.count = int(self.document[-1]) + 1
        self.length = int(self.offset.max()) + 1

    @property
    def one_per_row(self) -> bool:
        return self.count == self.shape[0]

    def group(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, ...] -> [N, L, ...]: one zero-padded row per document."""
        flat = x.reshape(-1, *x.shape[2:])
        grouped = flat.new_zeros(self.count, self.length, *x.shape[2:])
        grouped[self.document, self.offset] = flat
        return grouped

    def ungroup(self, grouped: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> [B, S, ...], the inverse of group on the documents' tokens."""
        return grouped[self.document, self.offset].reshape(*self.shape, *grouped.shape[2:])


def block_diagonal_masks(documents: Documents, layer_types, sliding_window: int | None,
                         dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """{layer type: additive [B, 1, S, S] mask}: 0 where a query may attend (causal, inside its own
    document, within the window on sliding layers), the dtype's minimum elsewhere (eager attention)."""
    rows, length = documents.shape
    document = documents.document.view(rows, length).to(device)
    position = torch.arange(length, device=device)
    distance = position[:, None] - position[None, :]   # query - key
    allowed = (document[:, :, None] == document[:, None, :]) & (distance >= 0)
    masks = {}
    for layer_type in set(layer_types):
        if layer_type == "sliding_attention":
            visible = allowed & (distance < sliding_window)
        elif layer_type == "full_attention":
            visible = allowed
        else:
            raise TargetError(f"no packed-row mask for layer type {layer_type!r} (full_attention and "
                              f"sliding_attention only)")
        blocked = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
        masks[layer_type] = blocked[:, None]
    return masks


class RecurrentRegrouping:
    """Hooks that run recurrent mixers once per document while `packed(documents)` is active."""

    def __init__(self):
        self._documents: Documents | None = None

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._group_input, with_kwargs=True)
        module.register_forward_hook(self._ungroup_output)

    @contextlib.contextmanager
    def packed(self, documents: Documents | None):
        """Regroup per document inside this block (None, or one document per row: nothing to do)."""
        self._documents = None if documents is None or documents.one_per_row else documents
        try:
            yield
        finally:
            self._documents = None

    def _group_input(self, module, args, kwargs):
        if self._documents is None:
            return None
        if kwargs.get("attention_mask") is not None:
            raise TargetError(f"{type(module).__name__}: packed rows take no padding mask (padding is its own "
                              f"document at the end of a row)")
        if args:
            return (self._documents.group(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._documents.group(kwargs["hidden_states"])}

    def _ungroup_output(self, module, args, output):
        if self._documents is None:
            return None
        if isinstance(output, tuple):
            return (self._documents.ungroup(output[0]), *output[1:])
        return self._documents.ungroup(output)


# ----------------------------------------------------------------------------------- varlen attention
class _AttentionDocuments:
    """The documents of the rows being captured, for varlen_attention. Set around the decoder call by
    `attention_documents` rather than passed through the layers' kwargs: compiled target layers would
    take them as graph inputs, whose length (the number of documents) changes every batch. `packed`
    is read inside compiled layers (a guard: one graph per value), `cu` only outside them."""
    packed = False
    cu: torch.Tensor | None = None


_DOCUMENTS = _AttentionDocuments()


@contextlib.contextmanager
def attention_documents(documents: Documents | None):
    packed = documents is not None and not documents.one_per_row
    _DOCUMENTS.packed, _DOCUMENTS.cu = packed, cu_seqlens(documents) if packed else None
    try:
        yield
    finally:
        _DOCUMENTS.packed, _DOCUMENTS.cu = False, None


def cu_seqlens(documents: Documents) -> torch.Tensor:
    """int32 [N + 1]: where each document of the flattened [B*S] rows starts, then the total."""
    starts = (documents.offset == 0).nonzero().flatten()
    return torch.cat([starts, starts.new_tensor([documents.offset.numel()])]).to(torch.int32)


@torch.compiler.disable   # the number of documents is data: outside any compiled graph
def _causal_per_document(q, k, v, length: int, scale: float | None):
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D], causal inside each document of the packed rows."""
    cu = _DOCUMENTS.cu
    if q.is_cuda:   # flash attention's variable-length kernel: no [S, S] mask, no work across documents
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, length, length, 0.0, True, False,
                                                       scale=scale)[0]
    out = torch.empty_like(q)   # the reference (CPU): one causal sdpa call per document
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                *(t[start:end].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale,
                enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1)
    return out


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """A transformers attention implementation for packed rows: causal attention inside each
    document (see attention_documents). Dense attention with a block-diagonal [S, S] mask computes
    every document pair and misses the causal kernels; this runs only the real work. Rows of one
    document each take transformers' sdpa path (causal kernels, no graph break)."""
    if not _DOCUMENTS.packed:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, length, dim = query.shape
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
    return _causal_per_document(*flat, length, scaling).view(batch, length, heads, dim), None


def _register_varlen() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(VARLEN, varlen_attention)


_register_varlen()
