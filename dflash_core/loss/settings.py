"""How one drafter step runs: the objective's settings, one typed object from the config to the loss.

launcher/resolve.py builds it once per process from the `drafter.*` keys (their meanings and
defaults are in launcher/config/schema.py); the field names are those keys. drafter_step and
evaluate_tau receive it whole.
"""
from dataclasses import dataclass

import torch

from ..drafter.attention import RESOLVED_BACKENDS
from ..kernels.fp8 import FP8_RECIPES
from .head_loss import LOSS_TYPES

MATMUL_PRECISIONS = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class StepSettings:
    num_anchors: int           # blocks per row (one static shape)
    loss: str                  # dflash | dpace: how the slots' cross-entropies are weighted
    gamma: float               # dflash slot decay exp(-(k-1)/gamma): drafter.gamma, or default_gamma(block_size)
    dpace_alpha: float         # D-PACE acceptance floor
    backend: str               # flex | flash | sdpa: drafter.backend resolved for the device
    chunk_blocks: int          # blocks per LM-head chunk
    feature_noise_std: float   # Gaussian noise added to the target features while training
    compiled: bool             # drafter.compile resolved: the layers and the head loss through torch.compile
    matmul_precision: str = "bf16"   # fp32 | bf16 | fp8: the drafter's linear layers and the LM head's products
    fp8_recipe: str = FP8_RECIPES[0]  # with fp8: torchao's recipe for the linear layers
    selector_weight: float = 1.0     # DFlash 2: the selector's K-way CE in the loss, relative to the unary CE
    selector_detach: bool = False    # DFlash 2: the selector term's gradient stops at the backbone
    kl_weight: float = 0.0           # the unary term's KL(target || drafter) share (1 - it: the label's CE)

    @property
    def with_teacher(self) -> bool:
        """The target's final normed hidden state rides as the features' last hidden_size columns."""
        return self.kl_weight > 0

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the weights' compute copies, the frozen head and the autocast activations."""
        return torch.float32 if self.matmul_precision == "fp32" else torch.bfloat16

    def __post_init__(self):
        if self.loss not in LOSS_TYPES:
            raise ValueError(f"StepSettings.loss={self.loss!r}: expected one of {LOSS_TYPES}")
        if self.backend not in RESOLVED_BACKENDS:
            raise ValueError(f"StepSettings.backend={self.backend!r}: expected a resolved backend, one of "
                             f"{RESOLVED_BACKENDS} (dflash_core.drafter.attention.resolve_backend resolves auto)")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"StepSettings.matmul_precision={self.matmul_precision!r}: expected one of "
                             f"{MATMUL_PRECISIONS}")
        if not self.selector_weight >= 0:
            raise ValueError(f"StepSettings.selector_weight={self.selector_weight!r}: expected a number >= 0")
        if not 0 <= self.kl_weight <= 1:
            raise ValueError(f"StepSettings.kl_weight={self.kl_weight!r}: expected a number in [0, 1]")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"StepSettings.fp8_recipe={self.fp8_recipe!r}: expected one of {FP8_RECIPES}")
