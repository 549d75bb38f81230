"""The frozen target: load it truncated after the last captured layer, capture hidden states.

Captured features follow the HF `output_hidden_states` numbering: layer id i is
`hidden_states[i + 1]`, the output of decoder layer i. Layers after the last captured one,
the final norm and the LM head never run (nor, for the layers, even load): the drafter
needs only the selected features. One HF subtlety is kept: `hidden_states[N_t]` (the last
layer) is reported *after* the final norm, so the norm is kept when that layer is captured.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from pathlib import Path

import torch
from torch import nn

from ..drafter.compile import compiled_function
from ..files.readers import check_safetensors, read_json
from .families import (
    VARLEN,
    TargetError,
    decoder_of,
    family_of,
    kernel_notes,
    num_layers_of,
    packing_supported,
    text_config,
    truncated_config,
)
from .packing import Documents, RecurrentRegrouping, attention_documents, block_diagonal_masks

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
__all__ = ["CapturingTarget", "TargetError", "check_target_files", "load_target", "random_target"]
log = logging.getLogger("dflash")


def check_target_files(path) -> None:
    """A Hugging Face model directory whose config.json parses and whose safetensors files are whole
    (their headers read, no tensor): a truncated or corrupt file is a BadFileError naming it, before
    transformers reads it and says only `SafetensorError: invalid header length`."""
    path = Path(path)
    if not path.is_dir():
        raise TargetError(f"target directory not found: {path}")
    if not (path / "config.json").is_file():
        raise TargetError(f"{path} has no config.json; expected a Hugging Face model directory")
    read_json(path / "config.json")
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise TargetError(f"{path} has no weights (no *.safetensors or *.bin files)")
    for index in path.glob("*.safetensors.index.json"):
        read_json(index)
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights)


def _check_layer_ids(layer_ids, num_layers: int) -> list[int]:
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids:
        raise TargetError("layer_ids is empty; capture at least one target layer")
    if len(set(layer_ids)) != len(layer_ids):
        raise TargetError(f"layer_ids {layer_ids} contains duplicates")
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_layers:
            raise TargetError(f"target layer id {layer_id} is out of range: the target has {num_layers} "
                              f"decoder layers (valid ids 0..{num_layers - 1})")
    return layer_ids


class _DropLoadReport(logging.Filter):
    """Hides transformers' load report, which would list every skipped layer as UNEXPECTED
    (missing weights are checked explicitly instead). A filter rather than a higher log
    level: transformers runs extra checks when its logger level is raised."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def _without_load_report():
    logger, report_filter = logging.getLogger("transformers.modeling_utils"), _DropLoadReport()
    logger.addFilter(report_filter)
    try:
        yield
    finally:
        logger.removeFilter(report_filter)


def _run_layer(layer, forward, *args, **kwargs):
    return forward(layer, *args, **kwargs)


# One graph per decoder-layer class, shared by every layer (dynamo inlines the module, so its
# weights are graph inputs): norms, RoPE, the MLP's SiLU and the residuals fuse around the GEMMs.
_compiled_run_layer = compiled_function("target_layer", _run_layer)


class CapturingTarget:
    """A frozen, truncated target decoder that returns the selected layers' hidden states.
    compiled: each decoder layer's forward runs through torch.compile (static shapes: the rows
    of a run have one length); the capture hooks stay outside the compiled code."""

    def __init__(self, decoder: nn.Module, config, layer_ids: list[int], *, compiled: bool = False):
        self.decoder = decoder
        self.config = config  # the full target's config (composite or text-only), before truncation
        self.family = family_of(config)
        self.layer_ids = layer_ids
        self.num_layers = num_layers_of(config)  # N_t of the full target
        self.hidden_size = text_config(config).hidden_size
        self.packing = packing_supported(decoder.config)
        self._captured: dict[int, torch.Tensor] = {}
        self._final_layer_id = self.num_layers - 1
        self._regrouping = RecurrentRegrouping()
        for layer_id in layer_ids:
            decoder.layers[layer_id].register_forward_hook(self._recorder(layer_id))
        if self.family.recurrent_mixer:
            for layer in decoder.layers:  # in a hybrid stack only some layers have one
                mixer = getattr(layer, self.family.recurrent_mixer, None)
                if mixer is not None:
                    self._regrouping.attach(mixer)
        if compiled:
            if self.family.recurrent_mixer:
                raise TargetError(f"a compiled {self.family.name} target is not supported: its per-document "
                                  f"{self.family.recurrent_mixer} regrouping has data-dependent shapes")
            for layer in decoder.layers:
                layer.forward = functools.partial(_compiled_run_layer, layer, type(layer).forward)

    def _recorder(self, layer_id: int):
        def record(module, args, output):
            # Decoder layers return a tensor in recent transformers and a tuple in older ones.
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return record

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    @property
    def num_kept_layers(self) -> int:
        return len(self.decoder.layers)

    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S] token ids -> [B, S, L*H] = cat(hidden_states[i + 1] for i in layer_ids).

        No attention mask: rows are right-padded, so causal attention keeps real tokens from
        ever seeing padding. Packed rows pass `position_ids` [B, S] that restart at 0 at every
        document (trailing padding is a document of its own): each document is then captured
        exactly as if it were forwarded alone (see dflash_core.target.packing).
        """
        documents = self._documents(input_ids, position_ids) if position_ids is not None else None
        masks = None
        varlen = self.decoder.config._attn_implementation == VARLEN
        if documents is not None and not (varlen or self.family.mask_from_positions or documents.one_per_row):
            masks = block_diagonal_masks(documents, self.decoder.config.layer_types,
                                         getattr(self.decoder.config, "sliding_window", None), self.dtype, self.device)
        try:
            with torch.inference_mode(), self._regrouping.packed(documents), \
                    attention_documents(documents if varlen else None):
                output = self.decoder(input_ids=input_ids.to(self.device), attention_mask=masks,
                                      position_ids=None if documents is None else position_ids.to(self.device),
                                      use_cache=False)
            if self._final_layer_id in self._captured:  # HF reports the last layer after the norm
                self._captured[self._final_layer_id] = output.last_hidden_state
            # Concatenated outside inference mode, so the result is an ordinary tensor that the
            # drafter's trainable layers may save for backward (inference tensors cannot be).
            return torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        finally:
            self._captured.clear()

    def _documents(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> Documents:
        if tuple(position_ids.shape) != tuple(input_ids.shape):
            raise TargetError(f"position_ids shape {tuple(position_ids.shape)} differs from input_ids "
                              f"shape {tuple(input_ids.shape)}")
        supported, reason = self.packing
        if not supported:
            raise TargetError(f"packed rows are not supported for this target: {reason}")
        return Documents(position_ids.to(self.device))


def load_target(path, *, layer_ids, device="cpu", dtype=torch.bfloat16,
                attn_implementation: str | None = None, compiled: bool = False) -> CapturingTarget:
    """Load a Hugging Face causal LM of a supported family (dflash_core.target.families) as a frozen
    feature extractor.

    Only decoder layers 0..max(layer_ids) are built and loaded; the final norm is dropped
    unless the last layer is captured, and the LM head is released after loading. A composite
    (multimodal) checkpoint loads its text decoder only.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    check_target_files(path)
    config = AutoConfig.from_pretrained(path)
    family_of(config)  # an unsupported family fails here, before any weight is read
    layer_ids = _check_layer_ids(layer_ids, num_layers_of(config))
    kept = max(layer_ids) + 1

    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if importlib.util.find_spec("accelerate") is not None:
        # Straight onto the device: otherwise every target rank of a node stages its whole copy
        # in host memory first (8 ranks x 16 GB for a Qwen3-8B node).
        extra["device_map"] = str(torch.device(device))
    with _without_load_report():
        model, info = AutoModelForCausalLM.from_pretrained(
            path, config=truncated_config(config, kept), dtype=dtype, output_loading_info=True, **extra)
    if info["missing_keys"]:
        raise TargetError(f"{path}: the checkpoint lacks weights the model needs: {sorted(info['missing_keys'])[:8]}")

    return _capturing(model, config, layer_ids, device, source=str(path), compiled=compiled)


def random_target(config, *, layer_ids, device="cpu", dtype=torch.bfloat16, seed: int = 0,
                  attn_implementation: str | None = None, compiled: bool = False) -> CapturingTarget:
    """The target's exact shapes with random weights, built on `device` without reading a checkpoint:
    for benchmarks, whose speed does not depend on weight values."""
    from transformers import AutoModelForCausalLM

    family_of(config)
    layer_ids = _check_layer_ids(layer_ids, num_layers_of(config))
    torch.manual_seed(seed)
    with torch.device(device):
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_config(truncated_config(config, max(layer_ids) + 1), dtype=dtype, **extra)
    return _capturing(model, config, layer_ids, device, source=f"random {config.model_type}", compiled=compiled)


def _capturing(model, config, layer_ids: list[int], device, *, source: str, compiled: bool) -> CapturingTarget:
    decoder = decoder_of(model, source=source)
    if max(layer_ids) + 1 < num_layers_of(config):
        decoder.norm = nn.Identity()  # the truncated stack's output is a raw layer output, never normed
    decoder.requires_grad_(False).eval().to(device)
    for note in kernel_notes(decoder.config):
        log.warning("target %s: %s", source, note)
    return CapturingTarget(decoder, config, layer_ids, compiled=compiled)
