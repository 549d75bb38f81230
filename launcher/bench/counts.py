"""FLOP and byte counts of the two stages, the benchmark shapes, and the stage-balance advice
(docs/perf_notes.md gives the numbers these formulas give at the production shape)."""
from __future__ import annotations

import torch

# Qwen3-8B's shape (random weights: speed does not depend on weight values).
QWEN3_8B_SHAPE = dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                      max_position_embeddings=40960, rope_theta=1e6)
# The ~27B shape of the original 8-GPU incident (issue 8).
QWEN3_27B_SHAPE = dict(vocab_size=151936, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, intermediate_size=25600,
                       max_position_embeddings=40960, rope_theta=1e6)
SHAPES = {"qwen3-8b": QWEN3_8B_SHAPE, "qwen3-27b": QWEN3_27B_SHAPE}
QWEN3_MASK_TOKEN_ID = 151669
H200_BF16_MATMUL_TFLOPS = 790.0   # measured-class dense bf16 GEMM rate of one H200 (spec sheet: 989)
H200_HBM_TB_PER_S = 4.8


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
    fc follows the issue's 6x although its input (the target's hidden states)
    needs no gradient, so the step really does 4x there (the difference is ~1% at the 8B shape).
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


def drafter_step_min_bytes(cfg, seq_len: int, anchors: int) -> dict:
    """A lower bound on the HBM bytes one drafter step must move, every tensor touched once:
    the bf16 features read (S * L*H * 2), the bf16 LM head read (V*H*2; the embedding gather is
    negligible), and per fp32 master parameter 36 B: read for compute (4), gradient written (4),
    AdamW reads param, grad, m, v (16) and writes param, m, v (12). Activations are left out."""
    params = (cfg.num_hidden_layers * layer_matmul_params(cfg.hidden_size, cfg.num_attention_heads,
                                                          cfg.num_key_value_heads, cfg.head_dim,
                                                          cfg.intermediate_size)
              + cfg.num_features * cfg.hidden_size ** 2)
    parts = {"features": seq_len * cfg.num_features * cfg.hidden_size * 2,
             "lm_head": cfg.vocab_size * cfg.hidden_size * 2,
             "params_and_adamw": 36 * params}
    parts["total"] = sum(parts.values())
    return parts


def target_forward_flops(hf_config, kept_layers: int, seq_len: int, batch: int = 1) -> float:
    """Frozen target forward over `kept_layers` decoder layers (the capture stops after the last
    captured one): 2 * P_layer * kept * tokens for the matmuls, plus causal attention
    kept * 4 * heads * head_dim * S(S+1)/2 per row (QK^T and PV, 2 FLOPs per MAC, each query
    sees itself and the keys before it). No LM head: the capture never runs it."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    layer = layer_matmul_params(hf_config.hidden_size, hf_config.num_attention_heads,
                                hf_config.num_key_value_heads, head_dim, hf_config.intermediate_size)
    matmuls = 2 * layer * kept_layers * seq_len * batch
    attention = kept_layers * 4 * hf_config.num_attention_heads * head_dim * seq_len * (seq_len + 1) / 2 * batch
    return matmuls + attention


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
