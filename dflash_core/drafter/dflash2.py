"""The DFlash 2 drafter (Inco AI / z-lab, 2026): the DFlash drafter plus
  - per decoder layer, two grouped dynamic depthwise convolutions along each query block, one
    pair around attention and one around the MLP (`attention_conv`, `mlp_conv`);
  - a candidate selector that rescores the unary top-K with a pair term (selector.py).

The convolution of one sublayer, as vLLM 0.32's DFlash2Qwen3DecoderLayer runs it: with x the
sublayer's (normed) input, the coefficients c = kernel_projection(x) [rows, 2, taps, groups];
the sublayer reads conv(x, c[:, 0], base_kernel[0]) and its output y leaves as
conv(y, c[:, 1], base_kernel[1]), where at block slot t and channel ch

    conv(x, c, base)[t, ch] = sum over taps j <= t of (base[j, ch] + c[t, j, ch // group_size]) * x[t - j, ch]

Only earlier slots of the same block enter: never another block, never the context. Fresh, every
convolution is the identity (base tap 0 = 1, the other taps 0, the projection 0) and the
successor codebook is 0, so a fresh DFlash 2 computes exactly what its DFlash backbone does and
drafts the unary top-1.

Names, shapes and config keys are those vLLM 0.32's qwen3_dflash2.py reads (see export.py).
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .model import DFlashDrafter, DrafterConfig, DrafterLayer
from .selector import CandidateSelector, unary_candidates

ARCHITECTURE = "DFlash2DraftModel"  # config.json's architectures entry vLLM and SGLang dispatch on
# The DFlash2Config fields an export's dflash_config carries, under these names.
DFLASH_CONFIG_KEYS = ("conv_group_size", "conv_kernel_size", "selector_rank", "selector_top_k", "output_multiplier",
                      "final_logit_softcapping")


@dataclass
class DFlash2Config(DrafterConfig):
    # Defaults: the published checkpoint configuration (z-lab/dflash tests/fixtures/dflash2-config.json),
    # but for the logit transform, off so that a DFlash 2 built on a DFlash drafter keeps its logits.
    conv_group_size: int = 16        # channels sharing one dynamic coefficient
    conv_kernel_size: int = 2        # taps: the slot itself and the taps - 1 before it
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None: no cap (the published checkpoints use 20.0)

    def backbone(self):
        """The config of the DFlash drafter this one is built on (what a warm start copies)."""
        return DrafterConfig(**{f.name: getattr(self, f.name) for f in fields(DrafterConfig)})

    def validate(self):
        super().validate()
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}")
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(f"conv_kernel_size {self.conv_kernel_size} must lie in [1, block_size "
                             f"{self.block_size}]: the convolution never reaches past its block")
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}")
        if not 1 <= self.selector_top_k <= self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} must lie in [1, vocab_size {self.vocab_size}]")
        if not self.output_multiplier > 0:
            # vLLM's top-K reduction refuses non-positive scales (the order of the top-K would flip).
            raise ValueError(f"output_multiplier must be > 0, got {self.output_multiplier}")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or None (no cap), "
                             f"got {self.final_logit_softcapping}")


def block_convolution(x, coefficients, base, block_size, group_size):
    """x [B, Q, H] (Q = blocks x block_size, slot-major within each block), coefficients
    [B, Q, taps, H // group_size], base [taps, H] -> [B, Q, H] (the module docstring's conv)."""
    batch, rows, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    blocks = x.view(batch, rows // block_size, block_size, groups, group_size)
    dynamic = coefficients.view(batch, rows // block_size, block_size, taps, groups, 1)
    out = None
    for tap in range(taps):
        # Slot t reads slot t - tap of its own block; the first `tap` slots read zeros.
        shifted = F.pad(blocks[:, :, :block_size - tap], (0, 0, 0, 0, tap, 0))
        term = (base[tap].view(groups, group_size) + dynamic[:, :, :, tap]) * shifted
        out = term if out is None else out + term
    return out.view(batch, rows, hidden)


class BlockConvolution(nn.Module):
    """The convolutions around one sublayer (vLLM's DFlashGroupedConv): base_kernel
    [2, taps, H] (0: the sublayer's input, 1: its output), kernel_projection H -> 2 x taps x groups."""

    def __init__(self, cfg):
        super().__init__()
        self.block_size, self.group_size = cfg.block_size, cfg.conv_group_size
        self.taps, self.groups = cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.taps, cfg.hidden_size))
        self.kernel_projection = nn.Linear(cfg.hidden_size, 2 * self.taps * self.groups, bias=False)

    @torch.no_grad()
    def to_identity(self):
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _convolve(self, x, coefficients, side):
        return block_convolution(x, coefficients[:, :, side], self.base_kernel[side].to(x.dtype),
                                 self.block_size, self.group_size)

    def around(self, sublayer, x):
        """sublayer(conv(x)), convolved again, with both coefficient sets projected from x."""
        coefficients = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.groups)
        return self._convolve(sublayer(self._convolve(x, coefficients, 0)), coefficients, 1)


class DFlash2Layer(DrafterLayer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.attention_conv = BlockConvolution(cfg)
        self.mlp_conv = BlockConvolution(cfg)

    def forward(self, h, context_kv, rope, mask, backend="flex"):
        # The context keys and values are the backbone's: only the block's states are convolved.
        h = h + self.attention_conv.around(lambda x: self.self_attn(x, context_kv, rope, mask, backend),
                                           self.input_layernorm(h))
        return h + self.mlp_conv.around(self.mlp, self.post_attention_layernorm(h))


class DFlash2Drafter(DFlashDrafter):
    layer_class = DFlash2Layer

    def build(self, cfg):
        super().build(cfg)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def draw_weights(self, generator, std):
        super().draw_weights(generator, std)  # every linear layer, the new ones too, then:
        for layer in self.layers:
            layer.attention_conv.to_identity()
            layer.mlp_conv.to_identity()
        self.candidate_selector.draw_codebooks(generator, std)

    def candidates(self, head, hidden, anchor_ids):
        """hidden [R, Bs, H]: final-normed states of R blocks; anchor_ids [R] -> (candidate ids
        [R, Bs-1, K] of the drafted slots, their pair-score lattice [R, Bs-1, K, K])."""
        cfg = self.config
        drafted = hidden[:, 1:]
        ids, unary = unary_candidates(head.logits(drafted.to(head.lm_head_weight.dtype)), cfg.selector_top_k,
                                      cfg.output_multiplier, cfg.final_logit_softcapping)
        return ids, self.lattice(ids, unary, drafted, anchor_ids)

    def lattice(self, candidate_ids, unary, hidden, anchor_ids):
        """The pair-score lattice [R, S, K, K] of candidates [R, S, K] (CandidateSelector.pair_scores)."""
        self.weights_ready(self.candidate_selector)
        return self.candidate_selector.pair_scores(candidate_ids, unary, hidden, anchor_ids)

    def teacher_forced_scores(self, predecessor_ids, candidate_ids, unary, hidden):
        """predecessor_ids [...] (one per slot), candidate_ids and unary [..., C], hidden [..., H] -> the
        scores [..., C] of the candidates after that predecessor (what the selector's loss reads)."""
        self.weights_ready(self.candidate_selector)
        return self.candidate_selector.scores(predecessor_ids.unsqueeze(-1), candidate_ids, unary, hidden).squeeze(-2)


def parameter_names(cfg):
    """The tensor names DFlash 2 adds to a DFlash drafter's."""
    per_layer = [f"{conv}.{name}" for conv in ("attention_conv", "mlp_conv")
                 for name in ("base_kernel", "kernel_projection.weight")]
    selector = [f"candidate_selector.{name}"
                for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")]
    return [f"layers.{i}.{name}" for i in range(cfg.num_hidden_layers) for name in per_layer] + selector


def config_from_fields(values):
    """The config whose dataclasses.asdict() `values` are (what a checkpoint records): a DFlash2Config when
    they hold DFlash 2's fields, else a DrafterConfig."""
    return (DFlash2Config if "selector_top_k" in values else DrafterConfig)(**values)


def build_drafter(cfg, *, seed=None):
    """The drafter a config describes: DFlash 2 for a DFlash2Config, else DFlash."""
    return (DFlash2Drafter if isinstance(cfg, DFlash2Config) else DFlashDrafter)(cfg, seed=seed)
