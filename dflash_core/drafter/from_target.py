"""A drafter that starts as the target's last layers (drafter.init=target).

A DFlash drafter's layers have the target's width, heads and FFN, so its k layers can start as
copies of the target's last k decoder layers: the ones that turn the target's residual stream into
the next token's logits, through the final norm and LM head the drafter shares. The context starts
as the first copied layer reads it: fc passes the captured feature nearest that layer's input through
unchanged (the very input where the target layer ids include the layer before it), and hidden_norm is
that layer's input norm. The drafter normalises queries and keys per head where a Llama target does
not, so q_norm and k_norm start at 1 unless the target has its own. Trained from there, a drafter is
ahead of one from random weights over its first few hundred steps; over thousands the start stops
mattering (docs/perf_notes.md, "A drafter that starts as the target's last layers").
"""

import torch

from ..files.readers import read_tensor, tensor_files, tensor_shapes
from ..loss.frozen_head import decoder_prefix

# The target's decoder layer tensors a drafter layer copies, under the same names in both (the Llama,
# Qwen3 and Qwen3.5 families' layout); the query and key norms only where the target has them.
LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def copied_layers(cfg):
    """The target layers the drafter's layers start as: its last num_hidden_layers."""
    return list(range(cfg.num_target_layers - cfg.num_hidden_layers, cfg.num_target_layers))


def nearest_feature(cfg):
    """The index in target_layer_ids of the captured feature nearest the first copied layer's input (feature
    i is layer i's output: the input of layer i + 1); the deeper of two as near."""
    wanted = copied_layers(cfg)[0] - 1
    return min(range(cfg.num_features), key=lambda j: (abs(cfg.target_layer_ids[j] - wanted),
                                                       -cfg.target_layer_ids[j]))


def _sources(cfg, files, trained_names):
    """{drafter tensor: target tensor, or None where the drafter's own start (ones, or fc's pass-through)
    is kept} for every name in trained_names."""
    prefix = decoder_prefix(files)
    sources = {"fc.weight": None, "norm.weight": f"{prefix}norm.weight",
               "hidden_norm.weight": f"{prefix}layers.{copied_layers(cfg)[0]}.input_layernorm.weight"}
    for i, layer in enumerate(copied_layers(cfg)):
        for name in LAYER_TENSORS + QK_NORMS:
            theirs = f"{prefix}layers.{layer}.{name}"
            sources[f"layers.{i}.{name}"] = theirs if name in LAYER_TENSORS or theirs in files else None
    return {name: sources[name] for name in trained_names if name in sources}


def check_target_start(cfg, target_dir, drafter_shapes):
    """The target's tensors that drafter.init=target copies exist with the drafter's shapes {name: shape}
    (read from the checkpoint's header, no tensor loaded); else a ValueError naming each that does not."""
    if cfg.num_hidden_layers > cfg.num_target_layers:
        raise ValueError(f"the drafter's {cfg.num_hidden_layers} layers outnumber the target's {cfg.num_target_layers}")
    files = tensor_files(target_dir)
    sources = {ours: theirs for ours, theirs in _sources(cfg, files, drafter_shapes).items() if theirs is not None}
    missing = sorted(theirs for theirs in sources.values() if theirs not in files)
    if missing:
        raise ValueError(f"the target has no {', '.join(missing[:4])}{' ...' * (len(missing) > 4)} ({len(missing)} "
                         f"tensors): its layers are not the Llama/Qwen decoder layers a drafter's are")
    shapes = tensor_shapes(files, sources.values())
    differ = [f"{theirs} {list(shapes[theirs])} for {ours} {list(drafter_shapes[ours])}"
              for ours, theirs in sources.items() if list(shapes[theirs]) != list(drafter_shapes[ours])]
    if differ:
        raise ValueError(f"the target's layers differ from the drafter's in shape: {'; '.join(differ[:3])}")


def target_start(cfg, target_dir, trained_names):
    """The drafter's starting weights {name: fp32 tensor} for every name in trained_names that this start
    sets (DFlash 2's convolutions and selector keep their own start)."""
    files = tensor_files(target_dir)
    weights = {}
    for ours, theirs in _sources(cfg, files, trained_names).items():
        if theirs is not None:
            weights[ours] = read_tensor(files, theirs).float()
        elif ours == "fc.weight":   # one captured feature passed through
            nearest = nearest_feature(cfg)
            fc = torch.zeros(cfg.hidden_size, cfg.num_features * cfg.hidden_size)
            fc[:, nearest * cfg.hidden_size:(nearest + 1) * cfg.hidden_size] = torch.eye(cfg.hidden_size)
            weights[ours] = fc
        else:   # a query or key norm the target lacks
            weights[ours] = torch.ones(cfg.head_dim)
    return weights
