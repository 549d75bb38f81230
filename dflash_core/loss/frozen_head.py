"""The target's frozen embed_tokens and lm_head, the drafter's input and output vocabulary.

Held as non-persistent buffers: never trained, never in gradient sync, never in the
drafter's (or anybody's) state_dict. Only these two tensors are read from the target
checkpoint, under the names every supported family uses (dflash_core.target.families): text-only
checkpoints keep the decoder under `model.`, composite multimodal ones (Qwen3.5/3.6) under
`model.language_model.`; the LM head is `lm_head.weight` in both. `use_fp8()` (drafter.matmul_precision=fp8)
quantises the LM head once, and the training loss's products run in FP8 from then on."""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..files.readers import read_json, read_tensor, tensor_files
from ..kernels.fp8 import Fp8HeadWeight

EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_KEY = "lm_head.weight"


def decoder_prefix(files):
    """Where the checkpoint keeps its decoder ("model." or "model.language_model."), from its embed_tokens."""
    embed_key = next((key for key in EMBED_KEYS if key in files), None)
    if embed_key is None:
        raise KeyError(f"none of {EMBED_KEYS} among the checkpoint's {len(files)} tensors")
    return embed_key.removesuffix("embed_tokens.weight")


class FrozenTargetHead(nn.Module):
    def __init__(self, embed_weight, lm_head_weight):
        super().__init__()
        if embed_weight.shape != lm_head_weight.shape:
            raise ValueError(f"embed_tokens {tuple(embed_weight.shape)} and lm_head "
                             f"{tuple(lm_head_weight.shape)} shapes differ")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.fp8: Fp8HeadWeight | None = None   # the LM head in FP8, once use_fp8() quantised it

    def use_fp8(self) -> None:
        """Quantise the frozen LM head once into the layouts of its FP8 products (kernels/fp8.py): the
        training loss's logits and input gradient run in FP8 from now on. `logits` (evaluation,
        decoding) keeps the bf16 product the served target computes; the bf16 weight stays for it
        (and the embedding may be the same tensor)."""
        self.fp8 = Fp8HeadWeight(self.lm_head_weight)

    @property
    def vocab_size(self):
        return self.embed_weight.shape[0]

    @property
    def hidden_size(self):
        return self.embed_weight.shape[1]

    @classmethod
    def from_target_dir(cls, path, *, device=None, dtype=None):
        target_dir = Path(path)
        files = tensor_files(target_dir)
        try:
            embed_key = decoder_prefix(files) + "embed_tokens.weight"
        except KeyError as exc:
            raise KeyError(f"{target_dir}: {exc.args[0]}") from None
        config_file = target_dir / "config.json"
        config = read_json(config_file) if config_file.is_file() else {}
        tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings",
                                                                                   LM_HEAD_KEY not in files))
        if not tied and LM_HEAD_KEY not in files:
            raise KeyError(f"{target_dir}: no {LM_HEAD_KEY} and tie_word_embeddings is false")
        embed = read_tensor(files, embed_key).to(device=device, dtype=dtype)
        lm_head = embed if tied else read_tensor(files, LM_HEAD_KEY).to(device=device, dtype=dtype)
        return cls(embed, lm_head)

    @classmethod
    def random(cls, vocab_size, hidden_size, *, seed=0, tied=False, device="cpu",
               dtype=torch.float32):
        """A random head built in memory (tests, toy targets, benchmarks)."""
        generator = torch.Generator(device=device).manual_seed(seed)

        def draw():
            return torch.randn(vocab_size, hidden_size, generator=generator, device=device,
                               dtype=dtype)
        embed = draw()
        return cls(embed, embed if tied else draw() / hidden_size ** 0.5)

    def embed(self, ids):
        return F.embedding(ids, self.embed_weight)

    def logits(self, h):
        """h [rows, H] -> logits [rows, V], as the served target's LM head computes them (in bf16 with fp8 too)."""
        return F.linear(h, self.lm_head_weight)
