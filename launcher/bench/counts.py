"""FLOP and byte counts of the two stages and the stage-balance advice
(docs/perf_notes.md gives the numbers these formulas give at the production shape)."""
from __future__ import annotations

import torch

from dflash_core.target.families import text_config

# Text model types whose q_proj also produces the attention output gate (twice the query width).
GATED_QUERY_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def layer_matmul_params(hidden, num_heads, num_kv_heads, head_dim, intermediate) -> int:
    """Weights of one Qwen3 decoder layer that enter matmuls: q, k, v, o and the SiLU MLP (norms and
    biases are negligible and left out)."""
    attention = hidden * num_heads * head_dim * 2 + hidden * num_kv_heads * head_dim * 2
    return attention + 3 * hidden * intermediate


def drafter_step_flops_breakdown(cfg, seq_len: int, anchors) -> dict:
    """Model FLOPs of one drafter training step on one row of `seq_len` context tokens.

    `anchors`: an int N (random anchors over the S-1 candidates 0..S-2, so the mean anchor is
    (S-2)/2), or the anchor positions themselves. With Q = N*Bs query tokens, n drafter layers,
    P = layer_matmul_params of one drafter layer, P_kv = its k,v weights, L captured target layers:

      layers    = 6 * P * Q * n            forward 2 + input-grad 2 + weight-grad 2, per query token
      lm_head   = 4 * V * H * Q            frozen head: forward + input-grad only (no weight grad)
      attention = 3 * n * 4 * heads * head_dim * sum_blocks Bs * (a + Bs)
                  QK^T and PV (2 FLOPs per MAC each) over the VISIBLE keys only: a query of the block
                  anchored at a sees the a context keys before it and the Bs keys of its block;
                  x3 = forward + backward (dQ, dK, dV, dP ~ twice the forward)
      context   = 6 * P_kv * S * n         k,v projections of every context token in every layer
      fc        = 6 * L * H * H * S        the feature projection, per context token

    MFU counts model FLOPs only (no recomputation; the fused head loss does none for the LM head).
    fc follows the issue's 6x although its input (the target's hidden states) needs no gradient,
    so the step really does 4x there (how little that moves the total: docs/perf_notes.md, "The two
    numbers").
    """
    n, bs, hidden = cfg.num_hidden_layers, cfg.block_size, cfg.hidden_size
    if isinstance(anchors, int):
        num_blocks, anchor_sum = anchors, anchors * (seq_len - 2) / 2
    else:
        positions = [int(a) for a in (anchors.flatten().tolist() if torch.is_tensor(anchors) else anchors)]
        num_blocks, anchor_sum = len(positions), sum(positions)
    queries = num_blocks * bs
    layer = layer_matmul_params(hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                cfg.intermediate_size)
    kv = 2 * hidden * cfg.num_key_value_heads * cfg.head_dim
    visible_keys = anchor_sum + num_blocks * bs   # summed over blocks, per query slot
    parts = {
        "layers": 6 * layer * queries * n,
        "lm_head": 4 * cfg.vocab_size * hidden * queries,
        "attention": 3 * n * 4 * cfg.num_attention_heads * cfg.head_dim * bs * visible_keys,
        "context_kv": 6 * kv * seq_len * n,
        "fc": 6 * cfg.num_features * hidden * hidden * seq_len,
    }
    parts["total"] = sum(parts.values())
    return parts


def drafter_step_flops(cfg, seq_len: int, anchors) -> float:
    """Total model FLOPs of one drafter step (see drafter_step_flops_breakdown for the formula)."""
    return drafter_step_flops_breakdown(cfg, seq_len, anchors)["total"]


def drafter_step_min_bytes(cfg, seq_len: int) -> dict:
    """A lower bound on the HBM bytes one drafter step must move, every tensor touched once:
    the bf16 features read (S * L*H * 2), the bf16 LM head read (V*H*2; the embedding gather is
    negligible), and per matrix weight 32 B (launcher/distributed/sharded_adamw.py): its bf16 compute
    copy read for the GEMMs (2), its bf16 gradient written (2), AdamW reads the fp32 master, gradient,
    m, v (14) and writes master, m, v and the copy (14). Activations and the norm weights are left out."""
    params = (cfg.num_hidden_layers * layer_matmul_params(cfg.hidden_size, cfg.num_attention_heads,
                                                          cfg.num_key_value_heads, cfg.head_dim,
                                                          cfg.intermediate_size)
              + cfg.num_features * cfg.hidden_size ** 2)
    parts = {"features": seq_len * cfg.num_features * cfg.hidden_size * 2,
             "lm_head": cfg.vocab_size * cfg.hidden_size * 2,
             "params_and_adamw": 32 * params}
    parts["total"] = sum(parts.values())
    return parts


def _layer_kinds(text, kept_layers: int) -> list[str]:
    kinds = getattr(text, "layer_types", None)
    return list(kinds[:kept_layers]) if kinds else ["full_attention"] * kept_layers


def token_mixer_weights(text, kind: str) -> int:
    """Matmul weights one token passes through in a layer's token mixer (biases and norms left out).
    Attention: q (twice as wide where it also makes the output gate), k, v, o. Linear attention
    (gated DeltaNet): in_proj_qkv, in_proj_z (output gate), in_proj_b and in_proj_a (per value
    head), out_proj."""
    hidden = text.hidden_size
    if kind == "linear_attention":
        key = text.linear_num_key_heads * text.linear_key_head_dim
        value = text.linear_num_value_heads * text.linear_value_head_dim
        return hidden * (2 * key + value) + hidden * value + 2 * hidden * text.linear_num_value_heads + value * hidden
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    query_width = heads * head_dim * (2 if getattr(text, "model_type", None) in GATED_QUERY_MODEL_TYPES else 1)
    return hidden * query_width + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden


def ffn_weights(text, layer: int) -> int:
    """Matmul weights one token passes through in layer `layer`'s feed-forward block. Dense: gate,
    up, down. Sparse (a layer with experts: not in mlp_only_layers, on the decoder_sparse_step):
    the router (hidden x experts), the top-k routed experts it is sent to (gate, up, down of width
    moe_intermediate_size, or intermediate_size where that is the expert width, as in gpt-oss) and
    the shared expert with its sigmoid gate where the family has one."""
    hidden = text.hidden_size
    experts = getattr(text, "num_experts", None) or 0
    step = getattr(text, "decoder_sparse_step", None) or 1
    sparse = experts and layer not in (getattr(text, "mlp_only_layers", None) or []) and (layer + 1) % step == 0
    if not sparse:
        return 3 * hidden * text.intermediate_size
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    shared = getattr(text, "shared_expert_intermediate_size", None) or 0
    return hidden * experts + text.num_experts_per_tok * 3 * hidden * width + (3 * hidden * shared + hidden
                                                                                 if shared else 0)


def layer_weights_per_token(text, layer: int, kind: str) -> int:
    return token_mixer_weights(text, kind) + ffn_weights(text, layer)


def _visible_keys(documents: list[int], window: int | None) -> int:
    """Keys summed over queries: causal inside each document, at most `window` keys per query."""
    total = 0
    for length in documents:
        if window is None or length <= window:
            total += length * (length + 1) // 2
        else:
            total += window * (window + 1) // 2 + (length - window) * window
    return total


def _sequence_mixing_flops(text, kind: str, documents: list[int]) -> tuple[str, float]:
    """(part, FLOPs) of one layer's mixing along the sequence, beyond its projections.
    Attention: QK^T and PV, 2 FLOPs per MAC each, over the keys each query sees (its own document,
    causal, within a sliding window where the layer has one). Linear attention: counted as the
    recurrent form of the gated delta rule, per token and value head a read-out q.S, a prediction
    k.S and a rank-1 state update (3 x 2 x d_k x d_v FLOPs; the chunked kernel's intra-chunk
    triangular work is left out, so MFU reads slightly low there), plus the depthwise short
    convolution (2 x kernel FLOPs per channel)."""
    tokens = sum(documents)
    if kind == "linear_attention":
        key = text.linear_num_key_heads * text.linear_key_head_dim
        value = text.linear_num_value_heads * text.linear_value_head_dim
        state = 6 * text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
        conv = 2 * (2 * key + value) * text.linear_conv_kernel_dim
        return "recurrence", float(tokens * (state + conv))
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None) if kind == "sliding_attention" else None
    return "attention", float(4 * heads * head_dim * _visible_keys(documents, window))


def target_forward_flops_breakdown(hf_config, kept_layers: int, seq_len: int, batch: int = 1,
                                   documents: list[int] | None = None) -> dict:
    """Model FLOPs of the frozen target's forward over its first `kept_layers` decoder layers (the
    capture stops after the last captured one; no LM head, no router auxiliary loss).

    `documents`: the lengths of the causal segments of the whole batch (a packed row holds several,
    its end padding is one more); default `batch` rows of one document of `seq_len` tokens each.
    Per layer: 2 x (layer_weights_per_token) x tokens for the projections ("matmuls": attention or
    linear-attention projections, the dense MLP or the router + top-k experts + shared expert), plus
    the sequence mixing of `_sequence_mixing_flops`. A composite config counts its text decoder.
    """
    text = text_config(hf_config)
    documents = list(documents) if documents is not None else [seq_len] * batch
    tokens = sum(documents)
    parts = {"matmuls": 0.0, "attention": 0.0, "recurrence": 0.0}
    for layer, kind in enumerate(_layer_kinds(text, kept_layers)):
        parts["matmuls"] += 2.0 * layer_weights_per_token(text, layer, kind) * tokens
        part, flops = _sequence_mixing_flops(text, kind, documents)
        parts[part] += flops
    parts["total"] = sum(parts.values())
    return parts


def target_forward_flops(hf_config, kept_layers: int, seq_len: int, batch: int = 1,
                         documents: list[int] | None = None) -> float:
    """Total of target_forward_flops_breakdown."""
    return target_forward_flops_breakdown(hf_config, kept_layers, seq_len, batch, documents)["total"]


def documents_of(position_ids) -> list[int]:
    """Segment lengths of one row's position ids: a new segment starts at every 0 (a padded row
    is one segment, padding included; a packed row's documents and its end padding are several)."""
    positions = position_ids.tolist() if torch.is_tensor(position_ids) else list(position_ids)
    starts = [0] + [i for i, p in enumerate(positions) if p == 0 and i > 0] + [len(positions)]
    return [b - a for a, b in zip(starts, starts[1:]) if b > a]


def balance_advice(target_rate: float, drafter_rate: float, num_gpus: int) -> tuple[int, int, float]:
    """The T:D split of `num_gpus` (T, D >= 1) maximising min(T * target_rate, D * drafter_rate):
    (T, D, pipeline tokens/s). Ties go to more drafter GPUs (their idle time is the cheaper kind:
    the target's spare capacity can feed more data later)."""
    if num_gpus < 2:
        raise ValueError(f"a split needs at least 2 GPUs (one target, one drafter), got {num_gpus}")
    best = None
    for t in range(1, num_gpus):
        d = num_gpus - t
        rate = min(t * target_rate, d * drafter_rate)
        if best is None or rate > best[2] * (1 + 1e-9):
            best = (t, d, rate)
    return best
