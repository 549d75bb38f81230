"""Target families: one table of what differs between the supported target architectures.

A target resolves to a `Family` through its text config's model_type; a composite multimodal
config (Qwen3.5/3.6 checkpoints carry `text_config` + `vision_config`) resolves through its
text part. The rest of the code is family-agnostic: truncation edits the text config, capture
hooks the decoder layers wherever `get_decoder()` finds them, tensor parallelism and packing
read the facts below. A new family is a new row, not a new code path.
"""
from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass

from torch import nn

from ..drafter.model import DrafterConfig, check_serving_layer_ids, default_target_layer_ids

# Attention backends whose capture (and packed capture) the tests check on CPU, fp32.
VERIFIED_ATTENTION = ("eager", "sdpa")
# packing.varlen_attention's name in transformers' AttentionInterface (a name with "flash" in it
# would make transformers look for a flash-attention package)
VARLEN = "varlen_causal"


class TargetError(ValueError):
    """A target checkpoint or layer selection that cannot be used; the message says why."""


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]        # text (and composite) model_type spellings of the family
    attention: tuple[str, ...] = VERIFIED_ATTENTION  # backends the family's modeling code supports
    # Whether the decoder derives the packed-row (block-diagonal) mask from position ids itself;
    # if not, capture passes explicit per-layer-type masks (dflash_core.target.packing).
    mask_from_positions: bool = True
    # A decoder-layer submodule that carries a recurrent state along the sequence (linear
    # attention): packed rows regroup its input per document (dflash_core.target.packing).
    recurrent_mixer: str | None = None
    # Tensor parallelism (launcher/tensor_parallel.py): layer submodules left whole on every
    # rank, our per-layer plan where transformers' config has none, and per-head parameters
    # (not Linear layers) that must be sliced like the heads they belong to.
    tp_replicated: tuple[str, ...] = ()
    tp_layer_plan: tuple[tuple[str, str], ...] = ()
    tp_head_params: tuple[str, ...] = ()
    # Config key of a dense FFN width the drafter copies; None: the family has experts only.
    dense_intermediate_key: str | None = "intermediate_size"
    # (python module, what it accelerates, what transformers' torch fallback costs without it)
    fast_kernels: tuple[tuple[str, str, str], ...] = ()
    # Plain causal softmax attention in every layer (no sinks, windows or recurrent layers): packed
    # rows can run dflash_core.target.packing.varlen_attention instead of a dense block-diagonal mask.
    varlen: bool = False


_EXPERTS_REPLICATED = ("mlp.experts", "mlp.gate", "mlp.router")
_LINEAR_ATTENTION_KERNELS = (
    ("fla", "flash-linear-attention (the linear-attention layers' chunked gated delta rule)",
     ("eager PyTorch: a Python loop over 64-token chunks with fp32 triangular solves instead of one "
      "fused Triton kernel (GPU only; `python -m launcher.bench` measures the target row)")),
    ("causal_conv1d", "causal-conv1d (the linear-attention layers' short convolution)",
     "a plain depthwise F.conv1d instead of the fused CUDA kernel"),
)
_ATTENTION_PLAN = (("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
                   ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"))

FAMILIES = {family.name: family for family in (
    Family("qwen3", ("qwen3",), varlen=True),
    Family("qwen3_moe", ("qwen3_moe",), tp_replicated=_EXPERTS_REPLICATED, varlen=True),
    Family("qwen3_5", ("qwen3_5", "qwen3_5_text"), recurrent_mixer="linear_attn",
           fast_kernels=_LINEAR_ATTENTION_KERNELS),
    Family("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"), recurrent_mixer="linear_attn",
           tp_replicated=_EXPERTS_REPLICATED + ("mlp.shared_expert_gate",), dense_intermediate_key=None,
           fast_kernels=_LINEAR_ATTENTION_KERNELS),
    Family("llama", ("llama",), varlen=True),
    # transformers has no layer plan for gpt-oss (its experts are served by expert parallelism):
    # attention is split by heads with our plan, the attention sinks (one logit per head) with them.
    Family("gpt_oss", ("gpt_oss",), attention=("eager",), mask_from_positions=False, tp_replicated=_EXPERTS_REPLICATED,
           tp_layer_plan=_ATTENTION_PLAN, tp_head_params=("self_attn.sinks",), dense_intermediate_key=None),
)}
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES.values() for model_type in family.model_types}


def text_config(config):
    """The decoder's own config: `text_config` of a composite config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if get is not None else config


def family_of(config) -> Family:
    model_type = getattr(text_config(config), "model_type", None)
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise TargetError(f"unsupported target model_type {model_type!r} (config {type(config).__name__}); "
                          f"supported families: {', '.join(FAMILIES)} (model types {sorted(_BY_MODEL_TYPE)})")
    return family


def num_layers_of(config) -> int:
    layers = getattr(text_config(config), "num_hidden_layers", None)
    if layers is None:
        raise TargetError(f"target config {type(config).__name__} has no num_hidden_layers, "
                          f"neither at top level nor in a text_config")
    return int(layers)


def truncated_config(config, num_layers: int):
    """A copy of config whose decoder has only its first num_layers layers, for loading.

    Decoder forwards iterate `layers[: num_hidden_layers]` and config validation checks every
    per-layer list (`layer_types`) against it, so those lists are cut too. Lists of layer
    *indices* (e.g. `mlp_only_layers`, ints) name layers and stay valid as they are. The router's
    logits are never collected: capture needs no auxiliary loss.
    """
    truncated = copy.deepcopy(config)
    text = text_config(truncated)  # the composite copy's own text part, edited in place
    full = text.num_hidden_layers
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == full and not all(isinstance(v, int) for v in value):
            setattr(text, key, type(value)(value[:num_layers]))
    text.num_hidden_layers = num_layers
    for part in (truncated, text) if text is not truncated else (truncated,):
        if hasattr(part, "output_router_logits"):
            part.output_router_logits = False
        part.use_cache = False
    return truncated


def decoder_of(model: nn.Module, *, source: str) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm) inside a causal LM, wherever the family keeps it."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not (isinstance(getattr(decoder, "layers", None), nn.ModuleList) and hasattr(decoder, "embed_tokens")):
        raise TargetError(f"{source}: {type(model).__name__} has no decoder with embed_tokens and a layers list "
                          f"(found {type(decoder).__name__})")
    return decoder


def drafter_intermediate_size(config) -> int:
    """The target's dense FFN width; expert-only families (no dense FFN) get 3x the hidden size,
    the ratio of the dense Qwen3 models (override with drafter.intermediate_size). Configs of no
    known family (plain namespaces in tests) are read as dense."""
    text = text_config(config)
    family = _BY_MODEL_TYPE.get(getattr(text, "model_type", None))
    key = family.dense_intermediate_key if family else "intermediate_size"
    return int(getattr(text, key)) if key else 3 * int(text.hidden_size)


def packing_supported(config, attn_implementation: str | None = None) -> tuple[bool, str]:
    """Whether packed rows (several documents per row, positions restarting at 0) capture exactly
    what each document would alone, and if not why. Attention gets a block-diagonal causal mask
    from the position ids (transformers' packed-sequence path); recurrent layers are regrouped
    per document (dflash_core.target.packing). Checked on the eager and sdpa backends, and on the
    variable-length attention (dflash_core.target.packing.VARLEN) of the families that allow it."""
    try:
        family = family_of(config)
    except TargetError as error:
        return False, str(error)
    backend = (attn_implementation or getattr(text_config(config), "_attn_implementation", None)
               or ("sdpa" if "sdpa" in family.attention else "eager"))  # transformers' own default
    if backend == VARLEN and family.varlen:
        return True, f"{family.name}: causal attention per document (variable-length kernel)"
    if backend not in VERIFIED_ATTENTION:
        return False, (f"packed rows are verified with attention backends {VERIFIED_ATTENTION} only; "
                       f"the {family.name} target uses {backend!r}")
    return True, f"{family.name}: block-diagonal attention" + (
        f", {family.recurrent_mixer} state restarted per document" if family.recurrent_mixer else "")


def kernel_notes(config) -> list[str]:
    """Where this family falls back to slower code on this machine, and what that costs."""
    text, family = text_config(config), family_of(config)
    notes = [f"python module {module} not installed: {what} runs transformers' fallback, {cost}"
             for module, what, cost in family.fast_kernels if importlib.util.find_spec(module) is None]
    attention = getattr(text, "_attn_implementation", None)
    if attention == "eager":
        notes.append(f"{family.name} attention runs eager (materialises the [S, S] scores per head: memory "
                     f"and time grow with S^2; no sdpa support in transformers for this family)")
    experts = getattr(text, "_experts_implementation", None)
    if family.tp_replicated and experts == "eager":
        notes.append("MoE experts run transformers' eager loop over experts (grouped_mm unavailable)")
    return notes


def drafter_config_for_target(hf_config, *, num_layers, block_size, mask_token_id, target_layer_ids=None,
                              **overrides) -> DrafterConfig:
    """Copy width, heads, RoPE and vocabulary from the target's HF config (its text part for a
    composite multimodal config; dflash_core.target.families says where each family keeps them)."""
    text = text_config(hf_config)
    num_target_layers = text.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    check_serving_layer_ids(target_layer_ids, num_target_layers)
    hidden_size = overrides.pop("hidden_size", text.hidden_size)
    if hidden_size != text.hidden_size:
        raise ValueError(f"drafter hidden size {hidden_size} must equal the target's hidden "
                         f"size {text.hidden_size}")
    fields = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        "intermediate_size": drafter_intermediate_size(hf_config),
        "vocab_size": text.vocab_size,
        "block_size": block_size,
        "target_layer_ids": target_layer_ids,
        "num_target_layers": num_target_layers,
        "mask_token_id": mask_token_id,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": _rope_theta(text),
        "max_position_embeddings": text.max_position_embeddings,
        "attention_bias": getattr(text, "attention_bias", False),
    }
    fields.update(overrides)
    return DrafterConfig(**fields)


def _rope_theta(hf_config):
    """transformers 5 keeps rope_theta in rope_parameters; older configs have it at top level."""
    rope_parameters = getattr(hf_config, "rope_parameters", None) or {}
    theta = rope_parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("target config has no rope_theta (neither top level nor rope_parameters)")
    return float(theta)
