"""Tensor-parallel target units: shard a loaded target's decoder layers over one unit's ranks.

transformers (>= 5.15) builds its tensor-parallel mesh over the whole world, so it cannot
shard a target over the few ranks of one unit. We do it ourselves with DTensor: a 1-D
DeviceMesh wrapping the unit's existing process group (`DeviceMesh.from_group` creates no
new group, so no rank-dependent group creation happens), then `parallelize_module` on each
decoder layer with the model's own `base_model_tp_plan`.

Attention heads and MLP columns are split across the unit; the row-parallel projections
(o_proj, down_proj) all-reduce their outputs, so every decoder layer's output, and hence
every captured hidden state, is a full replicated tensor equal (up to summation order) to
the unsharded model's.

What stays whole on every rank (replicated), per family (dflash_core.target.families):
- embeddings, norms, rotary buffers: small, and a replicated embedding keeps the decoder's
  input an ordinary tensor;
- MoE experts and routers (qwen3_moe, qwen3_5_moe, gpt_oss): transformers' plans shard the
  fused expert tensors with `packed_colwise` / `moe_tp_experts`, styles that need
  transformers' own distributed runtime; the experts are therefore replicated (each rank holds
  them all: tensor parallelism saves attention memory only);
- the shared-expert gate of qwen3_5_moe (one output);
- Qwen3.5's linear-attention layers are sharded as transformers' plan says
  (`colwise_gather_output`: each rank computes a slice of every projection, then the slices
  are all-gathered), so the recurrent scan itself runs whole on every rank.
gpt-oss has no layer plan in transformers: its attention is split by heads with the
family's own plan, its attention sinks (one logit per head) sliced with the heads.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dflash_core.target.capture import CapturingTarget
from dflash_core.target.families import family_of, text_config

log = logging.getLogger("dflash")

# transformers' plan strings -> the DTensor style for a frozen forward. "replicate*" entries
# (norms) need nothing at inference: a plain replicated parameter computes the same thing.
_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicate": None,
    "replicated_with_grad_allreduce": None,
}

_LAYER_PREFIX = "layers.*."


class TensorParallelError(ValueError):
    """A target that cannot be sharded over the requested unit size; the message says why."""


def check_divisible(config, tp_size: int) -> None:
    """Attention heads must split evenly: each rank keeps whole heads (the sharded Linear
    layers' widths are checked module by module in shard_target)."""
    text = text_config(config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(text, key, None)
        if value is not None and value % tp_size:
            raise TensorParallelError(f"target.tp_size={tp_size} does not divide the target's {key}={value}; "
                                      f"pick a tp_size that divides num_attention_heads="
                                      f"{text.num_attention_heads} and num_key_value_heads="
                                      f"{getattr(text, 'num_key_value_heads', None)}")


def plan_strings(config) -> tuple[dict[str, str], dict[str, str]]:
    """(sharded, replicated): the per-decoder-layer plan entries we apply, and those the family
    leaves whole on every rank, from the text config's `base_model_tp_plan` or the family's own."""
    family = family_of(config)
    model_plan = getattr(text_config(config), "base_model_tp_plan", None) or {}
    strings = {key[len(_LAYER_PREFIX):]: style for key, style in model_plan.items() if key.startswith(_LAYER_PREFIX)}
    strings = strings or dict(family.tp_layer_plan)
    if not strings:
        raise TensorParallelError(f"the {family.name} target has no tensor-parallel plan; "
                                  f"use target.parallel=replicate")
    replicated = {key: style for key, style in strings.items()
                  if any(key == root or key.startswith(root + ".") for root in family.tp_replicated)}
    return {key: style for key, style in strings.items() if key not in replicated}, replicated


def layer_plan(config) -> dict[str, ParallelStyle]:
    """The per-decoder-layer DTensor plan (see plan_strings); styles we cannot shard are an error."""
    sharded, _ = plan_strings(config)
    unknown = {key: style for key, style in sharded.items() if style not in _STYLES}
    if unknown:
        raise TensorParallelError(f"the target's tensor-parallel plan uses styles this launcher does not shard: "
                                  f"{unknown} (supported: {sorted(_STYLES)}); use target.parallel=replicate")
    return {key: _STYLES[style]() for key, style in sharded.items() if _STYLES[style] is not None}


def unit_mesh(unit_group: ProcessGroup, device: torch.device) -> DeviceMesh:
    # from_group wraps the group built_groups already created on every rank: no collective,
    # no new group, so ranks outside this unit need not take part.
    return DeviceMesh.from_group(unit_group, device.type, mesh_dim_names=("tp",))


def shard_target(target: CapturingTarget, unit_group: ProcessGroup, device: torch.device) -> DeviceMesh:
    """Shard `target`'s decoder layers in place over `unit_group` and move the rest to `device`.

    Every rank of the unit must call this with identical weights loaded (they all read the
    same checkpoint), so each keeps its own slice without a broadcast (src_data_rank=None).
    The target may be loaded on CPU first: sharded weights go to `device` one at a time, so a
    rank never holds the whole model on its accelerator. Layers of a hybrid stack get the plan
    entries of the submodules they have (Qwen3.5: linear_attn or self_attn).
    """
    mesh = unit_mesh(unit_group, device)
    tp_size, rank = mesh.size(), mesh.get_local_rank()
    check_divisible(target.config, tp_size)
    plan = layer_plan(target.config)
    decoder = target.decoder
    unused = set(plan)
    for index, layer in enumerate(decoder.layers):
        layer_plan_here = {name: style for name, style in plan.items() if _submodule(layer, name) is not None}
        for name, style in layer_plan_here.items():
            _check_width(layer, index, name, style, tp_size)
        unused -= set(layer_plan_here)
        parallelize_module(layer, mesh, layer_plan_here, src_data_rank=None)
        for name in target.family.tp_head_params:
            _slice_heads(layer, name, tp_size, rank)
    unused = missing_from_every_layer(unused, target.family.tp_replicated)
    if unused:
        raise TensorParallelError(f"no decoder layer ({type(decoder.layers[0]).__name__}) has the submodule(s) "
                                  f"{sorted(unused)} named in the tensor-parallel plan")
    # Replicated parts (embeddings, norms, rotary buffers, experts): ordinary tensors on this rank's device.
    for module in decoder.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if not _is_dtensor(tensor) and tensor.device != device:
                moved = tensor.to(device)
                if isinstance(tensor, nn.Parameter):
                    moved = nn.Parameter(moved, requires_grad=False)
                setattr(module, name, moved)
    log.info("target sharded over unit ranks %s (tp_size %d): %d layers, %s", mesh.mesh.tolist(), tp_size,
             len(decoder.layers), {k: type(v).__name__ for k, v in plan.items()})
    whole = [root for root in target.family.tp_replicated
             if any(_submodule(layer, root) is not None for layer in decoder.layers)]
    if whole:
        _, dropped = plan_strings(target.config)
        log.warning("tensor-parallel %s target: %s stay whole on every rank (transformers' plan styles for them: "
                    "%s)", target.family.name, whole, sorted(set(dropped.values())) or "none")
    return mesh


def _check_width(layer: nn.Module, index: int, name: str, style: ParallelStyle, tp_size: int) -> None:
    """A column-parallel Linear splits its outputs, a row-parallel one its inputs: evenly."""
    linear = layer.get_submodule(name)
    width = linear.in_features if isinstance(style, RowwiseParallel) else linear.out_features
    if width % tp_size:
        raise TensorParallelError(f"target.tp_size={tp_size} does not divide the width {width} of layer {index}'s "
                                  f"{name} ({type(style).__name__})")


def _slice_heads(layer: nn.Module, name: str, tp_size: int, rank: int) -> None:
    """Keep this rank's heads of a per-head parameter (gpt-oss attention sinks), in the order
    ColwiseParallel gives the heads of q_proj: rank r holds the r-th contiguous block."""
    owner_name, _, param_name = name.rpartition(".")
    owner = _submodule(layer, owner_name)
    if owner is None:
        return
    full = getattr(owner, param_name)
    setattr(owner, param_name, nn.Parameter(full.detach().chunk(tp_size)[rank].clone(), requires_grad=False))


def missing_from_every_layer(unused: set[str], replicated_roots: tuple[str, ...]) -> set[str]:
    """The plan entries no decoder layer has that are an error. Not a sparse family's dense-MLP entries:
    transformers >= 5.25 lists them for its dense layers (mlp_only_layers), and a stack of sparse layers
    only has none (its experts are in base_model_ep_plan, left whole here)."""
    if not replicated_roots:
        return unused
    return {name for name in unused if not name.startswith("mlp.")}


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)
