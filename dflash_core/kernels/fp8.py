"""FP8 (e4m3) matmuls with row-wise scaling, for `drafter.matmul_precision=fp8`.

Two users:
  * the drafter's nn.Linear layers, converted to torchao's float8 training (`convert_linears`, one
    of torchao's recipes, FP8_RECIPES: `rowwise_with_gw_hp` scales the operands of the forward and
    input-gradient products per row of their contraction and keeps the weight gradient in bf16,
    `rowwise` makes that one FP8 too, `tensorwise` has one scale per tensor; what each costs:
    docs/perf_notes.md, "FP8"), imported only here and only when fp8 is asked for; in eval mode
    a converted layer runs the bf16 product of the same weight, as the exported drafter does when
    it is served, so held-out figures score the drafter users get;
  * the frozen LM head (`Fp8HeadWeight`): its weight quantised once into the two layouts its
    products read, the per-call operands (a chunk of hidden rows, a chunk of logit gradients)
    quantised row-wise each call (the logit gradients by the head-loss gradient kernel itself in a
    compiled step on CUDA: kernels/head_loss.py), the products through `torch._scaled_mm` with an
    fp32 accumulator (on Hopper its FP8 tensor cores keep partial sums in less than fp32, which
    cuBLAS promotes) and a bf16 result.

Scales are powers of two, as torchao's row-wise recipe has them: dividing by one is exact, so a
value's only error is its rounding to e4m3 (3 mantissa bits). Nothing here is exported with the
drafter: the export writes plain weights and model.py never imports this module.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
# _scaled_mm on CUDA wants every dimension of its operands a multiple of 16.
ALIGNMENT = 16
# Elements quantised at a time when the head weight is: bounds the fp32 copy that quantising makes.
_QUANTISE_ELEMENTS = 1 << 24
INSTALL_HINT = "pip install -e '.[fp8]'"
# torchao's float8 training recipes (Float8LinearRecipeName); the first is drafter.fp8_recipe's default.
FP8_RECIPES = ("rowwise_with_gw_hp", "rowwise", "tensorwise")


def unsupported_reason(device: torch.device) -> str | None:
    """Why `device` cannot run FP8 matmuls, or None when it can (CUDA capability 8.9 or newer)."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 tensor cores (FP8 matmuls need a CUDA GPU of capability 8.9 or newer)"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} has CUDA capability {capability[0]}.{capability[1]}; "
                f"FP8 matmuls need 8.9 or newer (Ada, Hopper, Blackwell)")
    return None


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, 1] fp32) with x ~= q * scale: each row scaled by the power
    of two that brings its largest magnitude closest to, and not above, e4m3's largest value."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    # The floor on amax (torchao's) keeps an all-zero row's scale finite; any scale quantises zeros exactly.
    inverse = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp(min=1e-12))))
    q = (x.float() * inverse).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, inverse.reciprocal()


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values an e4m3 operand and its scales stand for (tests compare products against these)."""
    return q.float() * scale


def scaled_product(a_q, a_scale, b_q_t, b_scale, out_dtype=torch.bfloat16) -> torch.Tensor:
    """(a_q * a_scale) @ (b_q_t * b_scale) into an fp32 accumulator: a_q [M, K] row-major with a_scale [M, 1];
    b_q_t [K, N] column-major (the transpose of a row-major [N, K]) with b_scale [1, N]."""
    return torch._scaled_mm(a_q, b_q_t, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


def _padded_rows(x: torch.Tensor) -> torch.Tensor:
    short = -x.shape[0] % ALIGNMENT
    return x if not short else torch.nn.functional.pad(x, (0, 0, 0, short))


def _quantised_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantise_rows of a large [R, C] weight (any strides), a block of rows at a time."""
    q = torch.empty(weight.shape, dtype=E4M3, device=weight.device)
    scale = torch.empty(weight.shape[0], 1, dtype=torch.float32, device=weight.device)
    block = max(1, _QUANTISE_ELEMENTS // weight.shape[1])
    for start in range(0, weight.shape[0], block):
        rows = slice(start, start + block)
        q[rows], scale[rows] = quantise_rows(weight[rows])
    return q, scale


class Fp8HeadWeight:
    """The frozen LM head weight W [V, H] in e4m3, quantised once in both layouts its products read:
    per vocabulary row (over H) for the logits h W^T, per hidden column (over V) for the input
    gradient g W. `quantise` quantises the per-call operand row-wise (quantise_rows, or a compiled
    copy of it)."""

    def __init__(self, weight: torch.Tensor):
        vocab, hidden = weight.shape
        if vocab % ALIGNMENT or hidden % ALIGNMENT:
            raise ValueError(f"FP8 LM head: its shape {tuple(weight.shape)} must be multiples of {ALIGNMENT} "
                             f"(torch._scaled_mm's alignment)")
        self.out_dtype = torch.bfloat16
        by_vocab, vocab_scale = _quantised_weight(weight)            # [V, H], [V, 1]
        by_hidden, hidden_scale = _quantised_weight(weight.t())      # [H, V], [H, 1]
        self._logits_operand = (by_vocab.t(), vocab_scale.t())      # [H, V] column-major, [1, V]
        self._gradient_operand = (by_hidden.t(), hidden_scale.t())  # [V, H] column-major, [1, H]

    def _product(self, rows, operand, quantise):
        if isinstance(rows, tuple):   # quantised by its producer, rows already aligned
            return scaled_product(*rows, *operand, out_dtype=self.out_dtype)
        q, scale = quantise(_padded_rows(rows))
        return scaled_product(q, scale, *operand, out_dtype=self.out_dtype)[:rows.shape[0]]

    def logits(self, h_rows: torch.Tensor, quantise=quantise_rows) -> torch.Tensor:
        """h_rows [rows, H] -> logits [rows, V] in bf16."""
        return self._product(h_rows, self._logits_operand, quantise)

    def input_gradient(self, grad_logits, quantise=quantise_rows) -> torch.Tensor:
        """d(loss)/d(logits) [rows, V] -> d(loss)/d(h) [rows, H] in bf16; grad_logits may come quantised,
        as (e4m3 [rows, V], scale [rows, 1]) with rows a multiple of ALIGNMENT."""
        return self._product(grad_logits, self._gradient_operand, quantise)


def _torchao_float8():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as exc:
        raise ImportError(f"drafter.matmul_precision=fp8 trains the drafter's linear layers with torchao's float8 "
                          f"training, and torchao is not importable ({exc}): {INSTALL_HINT}") from exc
    return Float8LinearConfig, convert_to_float8_training, Float8Linear


@functools.cache
def _training_only(float8_linear: type) -> type:
    """torchao's Float8Linear while training; in eval mode the bf16 product of the same weight (what the
    exported drafter runs when served). Also spares a process compiling FP8 evaluation graphs."""
    class Float8TrainingLinear(float8_linear):
        def forward(self, x):
            return super().forward(x) if self.training else F.linear(x, self.weight, self.bias)
    return Float8TrainingLinear


def torchao_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torchao") is not None


def convert_linears(model: nn.Module, recipe: str = FP8_RECIPES[0]) -> int:
    """Every nn.Linear of `model` (in place) to torchao's Float8Linear with `recipe` (FP8_RECIPES): the
    same parameters (names, shapes, dtypes: the state dict, the optimiser and the export see no
    change), FP8 products in forward and backward while training, bf16 ones in eval mode. Returns how
    many were converted; a layer whose shape FP8 cannot take is an error naming it."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"FP8 recipe {recipe!r}: expected one of {FP8_RECIPES}")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and (module.in_features % ALIGNMENT or module.out_features % ALIGNMENT):
            raise ValueError(f"FP8 linear layers: {name} is {module.in_features} -> {module.out_features}; both "
                             f"must be multiples of {ALIGNMENT} (torch._scaled_mm's alignment)")
    config_class, convert, float8_linear = _torchao_float8()
    count = sum(isinstance(module, nn.Linear) for module in model.modules())
    convert(model, config=config_class.from_recipe_name(recipe))
    # Retyped rather than built by our own swap: torchao's conversion also patches inductor for its kernels.
    for module in model.modules():
        if type(module) is float8_linear:
            module.__class__ = _training_only(float8_linear)
    return count
