"""A batch decode loop for Llama-family targets that the GPU paces, not the host.

HF `generate` runs a decode step as ~1,000 kernels launched one by one from Python, syncs once a step
for its stop check, and with its static cache attends over a mask it materialises per step; for a
small target at thousands of rows the host paces it at several times the step's floor
(docs/perf_notes.md, "The HF engine's decode rate on a GPU"). This loop runs the model's own
weights, embedding, rotary embedding and head, and the families' layer math (RMSNorm, attention, SwiGLU) as
their modules compute it, with:
- a KV cache sized to the batch (prompts left-padded, so every row writes the same slot each step);
- decode attention as two batched products over the cache's filled prefix, rounded up to a bucket of
  slots, with an additive key bias of one row per sequence (left padding and unwritten slots);
- the next token chosen on the device (greedy, or temperature / top-k / top-p sampling) and written
  into the output there;
- on CUDA, the step's element-wise passes fused by inductor, and one decode step captured as a CUDA
  graph per bucket and replayed, with the stop check read every `check_every` steps.

Families: the decoder layers of Llama, Qwen2, Qwen3 and Mistral (`SUPPORTED`), full attention only;
`unsupported(model)` says why another cannot run here (its caller falls back to `generate`, saying so).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_core.drafter.model import apply_rope

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")
BUCKET = 64   # slots per attention bucket: each bucket is one captured graph; a step reads < 64 unused slots


def unsupported(model) -> str | None:
    """Why this loop cannot decode `model` (None: it can)."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"model_type {config.model_type!r} is not one of {SUPPORTED}"
    layers = model.model.layers
    windowed = [k for k, layer in enumerate(layers) if getattr(layer.self_attn, "sliding_window", None)]
    if windowed:
        return f"layers {windowed} use sliding-window attention"
    if config.hidden_act != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu (the loop's MLP is SwiGLU)"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if "dynamic" in rope or rope == "longrope":   # their frequencies follow the longest position: a host sync
        return f"its rotary embedding ({rope!r}) rescales with the sequence length"
    return None


@dataclass(frozen=True)
class Sampling:
    """Greedy at temperature 0; otherwise temperature, then top-k (0: none), then top-p, as HF's warpers."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B] token ids, on the device and without a sync (capturable)."""
        raw, logits = logits, logits.float()
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1:
            # Ascending, so the tail's mass is a cumulative sum. The order is read from the logits in the head's own
            # dtype: a bf16 sort takes half an fp32 one's time, and neither the temperature nor the top-k cut (the
            # lowest go) changes the order, so the fp32 values gathered by it are the fp32 sort's (ties aside).
            order = raw.argsort(dim=-1)
            sorted_logits = logits.gather(-1, order)
            tail = sorted_logits.softmax(-1).cumsum(-1) <= 1 - self.top_p
            tail[:, -1] = False   # the most likely token always stays
            logits = logits.masked_fill(tail.scatter(-1, order, tail), -math.inf)
        # The exponential race: argmax(p / E), E ~ Exp(1), draws from p; one kernel, no host sync.
        return (logits.softmax(-1) / torch.empty_like(logits).exponential_()).argmax(-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The families' RMSNorm, as their modules compute it: in fp32, cast back, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's tensors, handed to the step's functions as arguments: compiled once, those
    functions serve every layer (a module argument would be guarded by identity, one compile per layer)."""
    norm: tuple          # (input RMSNorm weight, eps)
    q: tuple             # (weight, bias or None), as k, v, o
    k: tuple
    v: tuple
    o: tuple
    qk_norm: tuple | None   # Qwen3: (q weight, k weight, eps), over each head's features before the rotation
    mlp_norm: tuple
    gate: tuple
    up: tuple
    down: tuple

    @classmethod
    def of(cls, layer) -> "_Layer":
        attn, mlp = layer.self_attn, layer.mlp
        linear = lambda m: (m.weight, m.bias)   # noqa: E731
        qk = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon) if hasattr(attn, "q_norm") else None
        return cls((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                   linear(attn.q_proj), linear(attn.k_proj), linear(attn.v_proj), linear(attn.o_proj), qk,
                   (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                   linear(mlp.gate_proj), linear(mlp.up_proj), linear(mlp.down_proj))


def _queries_keys_values(h: torch.Tensor, w: _Layer, cos: torch.Tensor, sin: torch.Tensor, head_dim: int,
                         scaling: float):
    """Norm, projections, Qwen3's per-head norms and the rotation: q (pre-scaled), k, v as [B, heads, T, D]."""
    B, T, _ = h.shape
    x = _rms_norm(h, *w.norm)
    q = F.linear(x, *w.q).view(B, T, -1, head_dim)
    k = F.linear(x, *w.k).view(B, T, -1, head_dim)
    v = F.linear(x, *w.v).view(B, T, -1, head_dim).transpose(1, 2)
    if w.qk_norm is not None:
        q, k = _rms_norm(q, w.qk_norm[0], w.qk_norm[2]), _rms_norm(k, w.qk_norm[1], w.qk_norm[2])
    q = apply_rope(q, cos, sin).transpose(1, 2) * scaling
    return q, apply_rope(k, cos, sin).transpose(1, 2), v


def _after_attention(h: torch.Tensor, o: torch.Tensor, w: _Layer) -> torch.Tensor:
    """Output projection and residual, then the SwiGLU MLP and its residual."""
    B, heads, T, D = o.shape
    h = h + F.linear(o.transpose(1, 2).reshape(B, T, heads * D), *w.o)
    x = _rms_norm(h, *w.mlp_norm)
    return h + F.linear(F.silu(F.linear(x, *w.gate)) * F.linear(x, *w.up), *w.down)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D] (pre-scaled) against k, v [B, Hkv, span, D]: each KV head's query group in one product,
    each sequence's bias row [B, span] added; no mask of query x key entries is ever built."""
    B, Hq, _, D = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.reshape(B, kv_heads, Hq // kv_heads, D), k.transpose(-1, -2))
    probs = (scores.float() + key_bias[:, None, None, :]).softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, Hq, 1, D)


class StaticDecoder:
    """Decodes left-padded batches of one model: `decoder(input_ids, attention_mask)` -> [B, max_new_tokens]
    new token ids (rows that stopped are padded with `pad_id` after their stop token)."""

    def __init__(self, model, max_new_tokens: int, stop_ids: list[int], pad_id: int, sampling: Sampling,
                 cuda_graphs: bool | None = None, check_every: int = 16):
        why = unsupported(model)
        if why:
            raise ValueError(f"the static decode loop cannot run this target: {why}")
        self.model, self.max_new_tokens, self.pad_id, self.sampling = model, max_new_tokens, pad_id, sampling
        self.device = next(model.parameters()).device
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), device=self.device, dtype=torch.long)
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.check_every = check_every
        self.layers = [_Layer.of(layer) for layer in model.model.layers]
        attn = model.model.layers[0].self_attn
        self.kv_heads, self.head_dim, self.scaling = model.config.num_key_value_heads, attn.head_dim, attn.scaling
        # On GPUs the decode step's small element-wise passes (norms, rotation, softmax, SwiGLU) are most of
        # its time run one kernel each; inductor fuses them. Compiled for the one-token step only: the prefill,
        # once a batch, runs them eagerly.
        compiled = (lambda f, **kw: torch.compile(f, **kw)) if self.cuda_graphs else (lambda f, **kw: f)
        self._decode_qkv = compiled(_queries_keys_values)
        self._decode_after = compiled(_after_attention)
        self._attend = compiled(_decode_attention, dynamic=True)   # its span grows bucket by bucket

    # ------------------------------------------------------------------ the forward pass
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, *, prefill_mask: torch.Tensor | None = None,
                 slot: torch.Tensor | None = None, span: int = 0) -> torch.Tensor:
        """Hidden states -> last position's logits [B, V]. Prefill (`prefill_mask` [B, 1, T, T]): the T prompt
        tokens fill slots 0..T-1. Decode: one token per row written at `slot`, attending slots < span."""
        model = self.model.model
        h = model.embed_tokens(ids)
        cos, sin = model.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)   # over the heads of [B, T, heads, D]
        T = ids.shape[1]
        for w, cache_k, cache_v in zip(self.layers, self.cache_k, self.cache_v):
            if prefill_mask is not None:
                q, k, v = _queries_keys_values(h, w, cos, sin, self.head_dim, self.scaling)
                cache_k[:, :, :T], cache_v[:, :, :T] = k, v
                group = q.shape[1] // self.kv_heads   # the heads repeated, so a fused kernel takes the mask
                o = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                   attn_mask=prefill_mask, scale=1.0)
                h = _after_attention(h, o, w)
            else:
                q, k, v = self._decode_qkv(h, w, cos, sin, self.head_dim, self.scaling)
                cache_k.index_copy_(2, slot, k)
                cache_v.index_copy_(2, slot, v)
                o = self._attend(q, cache_k[:, :, :span], cache_v[:, :, :span], self.key_bias[:, :span])
                h = self._decode_after(h, o, w)
        return self.model.lm_head(model.norm(h[:, -1]))

    # ------------------------------------------------------------------ one decode step (captured on CUDA)
    def _step(self, span: int) -> None:
        """Feeds the last chosen token at `slot`, chooses the next, advances the counters: all on the device."""
        self.key_bias.index_fill_(1, self.slot, 0.0)
        logits = self._forward(self.token[:, None], self.position, slot=self.slot, span=span)
        self._emit(logits)
        self.slot.add_(1)
        self.position.add_(1)

    def _emit(self, logits: torch.Tensor) -> None:
        token = torch.where(self.finished, self.pad_id, self.sampling.choose(logits))
        self.out.index_copy_(1, self.column, token[:, None])
        self.finished |= torch.isin(token, self.stop_ids)
        self.token.copy_(token)
        self.column.add_(1)

    def _graph(self, span: int) -> torch.cuda.CUDAGraph:
        """The step for this bucket, captured after one warm-up run whose effects on the counters are undone
        (its cache and output writes are rewritten by the replay that follows, at the same slot and column)."""
        state = [self.slot, self.position, self.column, self.finished, self.token]
        saved = [t.clone() for t in state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step(span)
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(state, saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(span)
        return graph

    # ------------------------------------------------------------------ a batch
    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        device, (B, width) = self.device, input_ids.shape
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device).bool()
        # The last token chosen is never fed back; whole buckets, so every span the attention reads is a multiple
        # of 64 slots (an odd one sent cuBLAS's batched products to a kernel at half their speed on an H100).
        slots = BUCKET * math.ceil((width + self.max_new_tokens - 1) / BUCKET)
        dtype = self.model.lm_head.weight.dtype
        shape = (B, self.kv_heads, slots, self.head_dim)
        # Zeros, not empty: an unwritten slot's -inf bias masks a finite score, but NaN + -inf is NaN.
        self.cache_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.cache_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        # Unwritten slots and left padding get -inf; a slot turns 0 when its token is written.
        self.key_bias = torch.full((B, slots), -math.inf, device=device)
        self.key_bias[:, :width].masked_fill_(attention_mask, 0.0)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        prefill_mask = causal[None, None] & attention_mask[:, None, None, :]
        # A left-padded row's pads attend to nothing; give them their own slot so softmax stays finite.
        prefill_mask |= torch.eye(width, dtype=torch.bool, device=device)[None, None]
        lengths = attention_mask.sum(-1)
        positions = (torch.arange(width, device=device)[None] - (width - lengths)[:, None]).clamp(min=0)
        self.out = torch.full((B, self.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.token = torch.empty(B, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self._emit(self._forward(input_ids, positions, prefill_mask=prefill_mask))
        del prefill_mask   # [B, 1, T, T]: freed before the decode steps allocate theirs
        self.slot = torch.full((1,), width, dtype=torch.long, device=device)
        self.position = lengths[:, None].clone()
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        for step in range(1, self.max_new_tokens):
            if step % self.check_every == 0 and bool(self.finished.all()):
                break
            span = BUCKET * math.ceil((width + step) / BUCKET)   # slots 0 .. width + step - 1, in whole buckets
            if not self.cuda_graphs:
                self._step(span)
                continue
            if span not in graphs:
                graphs[span] = self._graph(span)
            graphs[span].replay()
        out = self.out
        del self.cache_k, self.cache_v, self.key_bias, self.out, graphs
        return out
