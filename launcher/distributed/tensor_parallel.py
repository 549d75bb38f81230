"""Tensor-parallel target units: shard a loaded target's decoder layers over one unit's ranks.

transformers (>= 5.15) builds its tensor-parallel mesh over the whole world, so it cannot
shard a target over the few ranks of one unit. We do it ourselves with DTensor: a 1-D
DeviceMesh wrapping the unit's existing process group (`DeviceMesh.from_group` creates no
new group, so no rank-dependent group creation happens), then `parallelize_module` on each
decoder layer with the model's own `base_model_tp_plan`.

Attention heads and MLP columns are split across the unit; the row-parallel projections
(o_proj, down_proj) all-reduce their outputs, so every decoder layer's output, and hence
every captured hidden state, is a full replicated tensor equal (up to summation order) to
the unsharded model's. Embeddings and norms stay replicated: they are small, and a
replicated embedding keeps the decoder's input an ordinary tensor.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from dflash_core.target import CapturingTarget

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

# Used when the config has no base_model_tp_plan: the Llama/Qwen layout (Megatron-style
# column-then-row pairs, one all-reduce after attention and one after the MLP).
FALLBACK_LAYER_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}

_LAYER_PREFIX = "layers.*."


class TensorParallelError(ValueError):
    """A target that cannot be sharded over the requested unit size; the message says why."""


def check_divisible(config, tp_size: int) -> None:
    """Heads, kv heads and MLP width must split evenly: each rank keeps whole heads."""
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, key, None)
        if value is not None and value % tp_size:
            raise TensorParallelError(f"target.tp_size={tp_size} does not divide the target's {key}={value}; "
                                      f"pick a tp_size that divides num_attention_heads="
                                      f"{config.num_attention_heads} and num_key_value_heads="
                                      f"{getattr(config, 'num_key_value_heads', None)}")


def layer_plan(config) -> dict[str, ParallelStyle]:
    """The per-decoder-layer plan, from the config's `base_model_tp_plan` or our fallback."""
    model_plan = getattr(config, "base_model_tp_plan", None) or {}
    strings = {key[len(_LAYER_PREFIX):]: style for key, style in model_plan.items() if key.startswith(_LAYER_PREFIX)}
    if not strings:
        log.warning("target config %s has no base_model_tp_plan for its layers; using the Llama/Qwen layout",
                    type(config).__name__)
        strings = FALLBACK_LAYER_PLAN
    unknown = {key: style for key, style in strings.items() if style not in _STYLES}
    if unknown:
        raise TensorParallelError(f"the target's tensor-parallel plan uses styles this launcher does not shard: "
                                  f"{unknown} (supported: {sorted(_STYLES)}); use target.parallel=replicate")
    return {key: _STYLES[style]() for key, style in strings.items() if _STYLES[style] is not None}


def unit_mesh(unit_group: ProcessGroup, device: torch.device) -> DeviceMesh:
    # from_group wraps the group built_groups already created on every rank: no collective,
    # no new group, so ranks outside this unit need not take part.
    return DeviceMesh.from_group(unit_group, device.type, mesh_dim_names=("tp",))


def shard_target(target: CapturingTarget, unit_group: ProcessGroup, device: torch.device) -> DeviceMesh:
    """Shard `target`'s decoder layers in place over `unit_group` and move the rest to `device`.

    Every rank of the unit must call this with identical weights loaded (they all read the
    same checkpoint), so each keeps its own slice without a broadcast (src_data_rank=None).
    The target may be loaded on CPU first: sharded weights go to `device` one at a time, so a
    rank never holds the whole model on its accelerator.
    """
    mesh = unit_mesh(unit_group, device)
    tp_size = mesh.size()
    check_divisible(target.config, tp_size)
    plan = layer_plan(target.config)
    decoder = target.decoder
    for index, layer in enumerate(decoder.layers):
        missing = [name for name in plan if _submodule(layer, name) is None]
        if missing:
            raise TensorParallelError(f"decoder layer {index} ({type(layer).__name__}) has no submodule(s) {missing} "
                                      f"named in the tensor-parallel plan")
        parallelize_module(layer, mesh, plan, src_data_rank=None)
    # Replicated parts (embeddings, norms, rotary buffers): ordinary tensors on this rank's device.
    for module in decoder.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if not _is_dtensor(tensor) and tensor.device != device:
                moved = tensor.to(device)
                if isinstance(tensor, nn.Parameter):
                    moved = nn.Parameter(moved, requires_grad=False)
                setattr(module, name, moved)
    log.info("target sharded over unit ranks %s (tp_size %d): %d layers, %s", mesh.mesh.tolist(), tp_size,
             len(decoder.layers), {k: type(v).__name__ for k, v in plan.items()})
    return mesh


def _submodule(layer: nn.Module, name: str) -> nn.Module | None:
    try:
        return layer.get_submodule(name)
    except AttributeError:
        return None


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)
