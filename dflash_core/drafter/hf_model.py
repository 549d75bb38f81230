"""The drafter as a transformers model: ships as `dflash.py` inside every export, beside the
project's own model.py (and what model.py imports relatively), so that

    AutoModel.from_pretrained(export_dir, trust_remote_code=True)

returns the drafter the launcher trained (config.json maps AutoModel to dflash.DFlashDraftModel,
the layout of the public z-lab DFlash checkpoints). This file imports only torch, transformers
and its siblings, relatively: transformers copies relative imports of remote code, nothing else.
"""

from dataclasses import fields

from transformers import PreTrainedModel, Qwen3Config

from .attention import resolve_backend
from .dflash2 import ARCHITECTURE as DFLASH2_ARCHITECTURE
from .dflash2 import DFLASH_CONFIG_KEYS as DFLASH2_KEYS
from .dflash2 import DFlash2Config, build_drafter
from .model import DrafterConfig


def drafter_config_from_dict(data):
    """The DrafterConfig (a DFlash2Config for a DFlash 2 architecture) an export's config.json
    describes: the raw JSON, or the to_dict() of the Qwen3Config transformers parses it into (which
    keeps rope_theta in rope_parameters)."""
    values = {f.name: data[f.name] for f in fields(DrafterConfig) if data.get(f.name) is not None}
    rope_theta = (data.get("rope_parameters") or {}).get("rope_theta", data.get("rope_theta"))
    if rope_theta is not None:
        values["rope_theta"] = rope_theta
    dflash = data["dflash_config"]
    # z-lab's and SpecForge's configs keep block_size at the top level only.
    values.update(mask_token_id=dflash["mask_token_id"], target_layer_ids=dflash["target_layer_ids"],
                  block_size=dflash.get("block_size", data.get("block_size")))
    if DFLASH2_ARCHITECTURE in (data.get("architectures") or ()):
        return DFlash2Config(**values, **{key: dflash[key] for key in DFLASH2_KEYS if key in dflash})
    return DrafterConfig(**values)


class DFlashDraftModel(PreTrainedModel):
    """A DFlashDrafter behind the PreTrainedModel interface. The drafter's submodules are this
    model's own children, so state_dict() keys are exactly the serving layout (no prefix) and
    from_pretrained fills them straight from model.safetensors."""

    config_class = Qwen3Config  # model_type stays "qwen3": what vLLM and SGLang parse
    base_model_prefix = ""
    _no_split_modules = ("DrafterLayer",)  # device_map="auto" keeps a layer on one device

    def __init__(self, config):
        super().__init__(config)
        drafter = build_drafter(drafter_config_from_dict(config.to_dict()))
        for name, child in drafter.named_children():
            self.add_module(name, child)
        # Kept outside nn.Module's registry (a registered copy would add "drafter." keys); it
        # shares every child module, and so every parameter, with this model.
        object.__setattr__(self, "drafter", drafter)
        self.post_init()

    def forward(self, context_features, block_embeds, anchors, keep, *, backend="auto"):
        """DFlashDrafter.forward: context_features [B, S, L*H] (the target's hidden states at
        dflash_config.target_layer_ids, concatenated), block_embeds [B, N*Bs, H] (the target's
        embeddings of each block: anchor token then mask tokens), anchors/keep [B, N]
        -> final-normed block hidden states [B, N*Bs, H]; the target's LM head gives the logits."""
        return self.drafter(context_features, block_embeds, anchors, keep,
                            backend=resolve_backend(backend, anchors.device))


class DFlash2DraftModel(DFlashDraftModel):
    """The same wrapper around a DFlash2Drafter (config.json's architectures name it)."""

    _no_split_modules = ("DFlash2Layer",)
