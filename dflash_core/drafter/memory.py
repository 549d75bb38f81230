"""What one drafter rank holds in memory to train at a shape, estimated before its first step.

A count of the tensors the step keeps, from the drafter's config and the step's shape: rows (the
micro-batch) of seq_len context tokens, each with num_anchors blocks of block_size slots, i.e.
Q = num_anchors x block_size queries over KV = seq_len + Q keys per row. Terms:
  - weights: the drafter's compute copy and its gradient, fp32 masters where it computes in bf16, the
    fp32 gradient sums several ranks or micro-batches need, and the frozen embedding and LM head;
  - optimiser: AdamW's two fp32 moments of this rank's shard (launcher/distributed/sharded_adamw.py);
  - activations: what autograd saves per layer for each query, context token and key (the norms,
    projections, RoPE copies and MLP products of dflash_core/drafter/model.py, counted per element),
    the sdpa backend's dense masks (a bool [rows, 1, Q, KV] per layer type, and per layer the bool mask
    attend() passes and the float copy torch's CPU kernel makes of it and keeps for backward), the
    head loss's saved gradient [rows, N, Bs - 1, H] and its largest transient, one chunk's [rows', V]
    logits and the fp32 tensors its statistics and gradient make of them.
The counts were checked against measured peaks on CPU (tests/test_memory.py states the factor).
"""
from __future__ import annotations

import dataclasses

import torch

GIB = 1 << 30
# Elements autograd keeps per query token in one layer, by the width they scale with (model.py's
# DrafterLayer: the RMSNorms' products, o_proj's and down_proj's outputs, the residual sums; the MLP's
# gate, up and product; the query's projection, norm and RoPE copies and the attention output; the
# block keys' and values' projection, norm and RoPE copies). Counted, then fitted to measured peaks
# (fp32 on CPU: 10.9 KB a query token and layer at H=128, I=256, 4 query and 2 key-value heads of 32).
_PER_QUERY = {"hidden": 6, "intermediate": 3, "query_heads": 6, "kv_heads": 4}
# Per context token in one layer: that layer's keys and values of the context (projection, norm, RoPE).
_PER_CONTEXT_KV_HEADS = 8
# Per key (context + block) in one layer: the concatenated keys and values, and their copies
# repeated to every query head (attend() expands GQA heads).
_PER_KEY = {"kv_heads": 2, "query_heads": 2}
# Bytes per query-key pair per layer on the sdpa backend: the bool mask attend() passes (1) and the
# float copy the CPU kernel keeps for backward (4; measured 4.5 a pair); and per layer type the mask built
# for the forward. The step peaks at the end of the forward (the backward frees as it goes).
_SDPA_PAIR_BYTES = 5
_SDPA_SHARED_PAIR_BYTES = 1
# A head-loss chunk's [rows, V] logits, plus the fp32 tensors its torch statistics and gradient make of
# them (exp, minus the one-hot, times the weights; the one-hot itself in bool).
_HEAD_CHUNK_FP32_COPIES = 5
# With the KL share: the chunk's teacher logits (compute dtype) and the fp32 tensors of its log-softmax,
# softmax, the drafter's log-probabilities and the blended target (head_loss.head_loss_terms).
_TEACHER_FP32_COPIES = 4


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes one drafter rank holds at a step's peak, by kind."""
    weights: int
    optimiser: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.optimiser + self.activations

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB (weights and frozen head {self.weights / GIB:.2f}, optimiser "
                f"{self.optimiser / GIB:.2f}, activations {self.activations / GIB:.2f})")


def parameter_count(config) -> int:
    """The drafter's parameters, counted on the meta device (nothing allocated)."""
    from .dflash2 import build_drafter
    with torch.device("meta"):
        return sum(p.numel() for p in build_drafter(config).parameters())


def step_memory(config, *, parameters: int, rows: int, seq_len: int, num_anchors: int, chunk_blocks: int,
                backend: str, compute_bytes: int, drafters: int = 1, grad_accum: int = 1,
                tied_head: bool = False, head_in_place: bool = False, teacher: bool = False) -> StepMemory:
    """StepMemory of one drafter rank training `config` (a DrafterConfig) at [rows, seq_len] with
    num_anchors blocks a row; compute_bytes: 4 (fp32, CPU) or 2 (bf16 under autocast, GPU); drafters:
    the ranks sharing the optimiser's shards and gradient sums; head_in_place: the compiled CUDA head loss,
    whose Triton kernels turn a chunk's logits into their gradient where they lie (no fp32 copies); teacher:
    the KL share's target hidden state per context token and its logits per head chunk."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    query_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    queries = num_anchors * config.block_size
    keys = seq_len + queries
    vocab = config.vocab_size

    sums = 4 * parameters if drafters > 1 or grad_accum > 1 else 0
    masters = 4 * parameters // drafters if compute_bytes != 4 else 0
    head = (1 if tied_head else 2) * vocab * hidden * compute_bytes
    weights = 2 * parameters * compute_bytes + masters + sums + head
    optimiser = 2 * 4 * parameters // drafters

    per_query = (_PER_QUERY["hidden"] * hidden + _PER_QUERY["intermediate"] * config.intermediate_size
                 + _PER_QUERY["query_heads"] * query_width + _PER_QUERY["kv_heads"] * kv_width)
    per_key = _PER_KEY["kv_heads"] * kv_width + _PER_KEY["query_heads"] * query_width
    layer = rows * (queries * per_query + seq_len * _PER_CONTEXT_KV_HEADS * kv_width + keys * per_key) * compute_bytes
    if backend == "sdpa":
        layer += rows * queries * keys * _SDPA_PAIR_BYTES
    # Outside the layers: the features in fp32 and their projection and norm, the block embeddings and
    # the final norm, the head loss's saved gradient of the drafted slots.
    outside = rows * (seq_len * (config.num_features + teacher + 3) * hidden + queries * 4 * hidden) * compute_bytes
    shared_masks = len(set(config.layer_types)) * rows * queries * keys * _SDPA_SHARED_PAIR_BYTES \
        if backend == "sdpa" else 0
    chunk_rows = rows * min(chunk_blocks, num_anchors) * (config.block_size - 1)
    head_chunk = chunk_rows * vocab * (compute_bytes + (0 if head_in_place else 4 * _HEAD_CHUNK_FP32_COPIES))
    if teacher:
        head_chunk += chunk_rows * vocab * (compute_bytes + 4 * _TEACHER_FP32_COPIES)
    activations = layers * layer + outside + shared_masks + head_chunk
    return StepMemory(weights, optimiser, activations)
