"""One DFlash (or DFlash 2) training step on a micro-batch, and the simulated acceptance evaluation.

drafter_step returns the weighted cross-entropy SUM (with drafter.kl_weight > 0 partly KL from the target's
distribution, head_loss.py; a DFlash 2's plus drafter.selector_weight times its selector term's,
selector_loss.py) and the weight sum; the caller divides
by the weight sum of the whole global batch (all drafter ranks, all accumulation steps), so
the result does not depend on how the batch was split.
"""

from dataclasses import dataclass, replace

import torch

from ..drafter.dflash2 import DFlash2Config
from .anchors import all_valid_anchors, sample_anchors
from .head_loss import HeadLoss, head_loss
from .selector_loss import SelectorTerms, leading, selector_terms, selector_walk_hits
from .settings import StepSettings

# Decay constants of the DFlash recipe, indexed by block size.
_KNOWN_GAMMAS = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size):
    """gamma for the dflash slot decay exp(-(k-1)/gamma): 4 for Bs=8, 5 for 10, 7 for 16.
    Other sizes: piecewise-linear through those points, extrapolated with the nearest
    segment's slope (Bs=4 -> 2, Bs=32 -> 12.33), never below 1."""
    sizes = sorted(_KNOWN_GAMMAS)
    if block_size in _KNOWN_GAMMAS:
        return _KNOWN_GAMMAS[block_size]
    upper = next((s for s in sizes[1:] if s > block_size), sizes[-1])
    lower = sizes[sizes.index(upper) - 1]
    slope = (_KNOWN_GAMMAS[upper] - _KNOWN_GAMMAS[lower]) / (upper - lower)
    return max(1.0, _KNOWN_GAMMAS[lower] + slope * (block_size - lower))


_SCALARS = ("loss_sum", "weight_sum", "tau_sum", "tau_count", "anchor_slots", "tokens", "walk_tokens", "walk_steps",
            "selector_loss_sum", "recall_hits", "selector_hits", "unary_tau_sum", "oracle_tau_sum",
            "unary_walk_tokens", "unary_walk_steps", "oracle_walk_tokens", "oracle_walk_steps")
# The drafted walks held-out evaluation follows (decoding_walk), by the prefix of their StepCounts fields:
# the one serving drafts ("": DFlash's unary top-1, DFlash 2's selector walk), and DFlash 2's unary-only
# walk and oracle (the target's token anywhere in the top-K counts as drafted).
WALKS = ("", "unary_", "oracle_")


@dataclass
class StepCounts:
    """Sums that add across micro-batches, accumulation steps and drafter ranks. Training,
    held-out evaluation and `evaluate_tau` all report these; `summary()` turns them into means.
    tau_sum and walk_*: the drafted walk, which held-out evaluation follows as serving does (DFlash 2:
    the selector's greedy walk); a training step runs no walk (walk_* stay 0) and its tau_sum is the unary
    top-1's."""
    loss_sum: torch.Tensor      # the optimised loss sum (detached): weighted CE (+ selector_weight x selector CE)
    weight_sum: torch.Tensor    # sum of the loss weights
    tau_sum: torch.Tensor       # sum over valid blocks of 1 + leading correct slots
    tau_count: torch.Tensor     # valid blocks (real anchors)
    anchor_slots: torch.Tensor  # anchor slots computed, valid or padding
    tokens: torch.Tensor        # non-padding context tokens (set by the caller)
    walk_tokens: torch.Tensor   # held-out only: tokens that decoding the supervised spans would commit ...
    walk_steps: torch.Tensor    # ... and the verify steps it would take (decoding_walk)
    # DFlash 2 only (0 for DFlash): the selector's weighted K-way CE sum (not times selector_weight), the
    # supervised slots whose label is in the unary top-K and whose teacher-forced selector pick is the label;
    # tau_sum and (held out) walk_* of the unary-only walk and of the oracle walk.
    selector_loss_sum: torch.Tensor
    recall_hits: torch.Tensor
    selector_hits: torch.Tensor
    unary_tau_sum: torch.Tensor
    oracle_tau_sum: torch.Tensor
    unary_walk_tokens: torch.Tensor
    unary_walk_steps: torch.Tensor
    oracle_walk_tokens: torch.Tensor
    oracle_walk_steps: torch.Tensor
    slot_correct: torch.Tensor  # [Bs] unary argmax hits over supervised positions (slot 0 stays 0)
    slot_weight: torch.Tensor   # [Bs] supervised positions per slot
    selector: bool = False      # a DFlash 2's counts: summary() reports the selector's figures too

    @classmethod
    def zeros(cls, block_size, device=None, selector=False):
        scalar = torch.zeros((), dtype=torch.float64, device=device)
        slots = torch.zeros(block_size, dtype=torch.float64, device=device)
        return cls(*[scalar] * len(_SCALARS), slots, slots, selector)

    def __add__(self, other):
        names = (*_SCALARS, "slot_correct", "slot_weight")
        return StepCounts(**{name: getattr(self, name) + getattr(other, name) for name in names},
                          selector=self.selector or other.selector)

    def pack(self):
        """One float64 vector [len(_SCALARS) + 2 * Bs]: a single all-reduce carries everything."""
        scalars = torch.stack([torch.as_tensor(getattr(self, name)).double().reshape(()) for name in _SCALARS])
        return torch.cat([scalars, self.slot_correct.double(), self.slot_weight.double()])

    @classmethod
    def unpack(cls, packed, selector=False):
        n = len(_SCALARS)
        correct, weight = packed[n:].chunk(2)
        return cls(*packed[:n].unbind(), correct, weight, selector)

    def all_reduce(self, group=None):
        import torch.distributed as dist
        packed = self.pack()
        dist.all_reduce(packed, group=group)
        return StepCounts.unpack(packed, self.selector)

    def summary(self):
        """Means: loss, tau (over anchors), decode_tau (over the verify steps of decoding_walk: what
        speculative decoding of the same text reports), per-slot accuracy acc_k (k = 1..Bs-1) of the unary
        top-1 and its mean, EAL = 1 + sum_k prod_{i<=k} acc_i, and anchor_fill = valid anchor slots / all
        slots. A DFlash 2's also: selector_loss (its K-way CE, per loss weight), recall_at_k (the label among
        the unary top-K), selector_acc (the selector's pick after the true predecessor is the label), and
        held-out the unary-only walk's and the oracle walk's tau and decode_tau (unary_*, oracle_*)."""
        acc = (self.slot_correct[1:] / self.slot_weight[1:].clamp(min=1)).double()
        out = {
            "loss": float(self.loss_sum / self.weight_sum.clamp(min=1e-12)),
            "tau": float(self.tau_sum / self.tau_count.clamp(min=1)),
            "decode_tau": float(self.walk_tokens / self.walk_steps.clamp(min=1)),
            "acc": float(acc.mean()),
            "acc_k": acc.tolist(),
            "eal": float(1 + torch.cumprod(acc, dim=0).sum()),
            "anchor_fill": float(self.tau_count / self.anchor_slots.clamp(min=1)),
        }
        if self.selector:
            supervised = self.slot_weight[1:].sum().clamp(min=1)
            out.update(selector_loss=float(self.selector_loss_sum / self.weight_sum.clamp(min=1e-12)),
                       recall_at_k=float(self.recall_hits / supervised),
                       selector_acc=float(self.selector_hits / supervised))
            for walk in WALKS[1:]:
                out[f"{walk}tau"] = float(getattr(self, f"{walk}tau_sum") / self.tau_count.clamp(min=1))
                out[f"{walk}decode_tau"] = float(getattr(self, f"{walk}walk_tokens")
                                                 / getattr(self, f"{walk}walk_steps").clamp(min=1))
        return out


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # the optimised loss sum with its graph; not normalised (see module docstring)
    counts: StepCounts


def block_input_ids(input_ids, anchors, block_size, mask_token_id):
    """[B, N*Bs]: slot 0 = input_ids[a], slots 1.. = mask_token_id."""
    ids = anchors.new_full((*anchors.shape, block_size), mask_token_id)
    ids[..., 0] = input_ids.gather(1, anchors)
    return ids.flatten(1)


def block_labels(input_ids, loss_mask, anchors, keep, block_size, position_ids=None):
    """Slot k of a block anchored at a predicts input_ids[a + k].
    -> labels [B, N, Bs] long, weights [B, N, Bs] float =
       keep * (a + k < S) * (k > 0) * loss_mask[a + k] * (a + k in a's document), the last
       factor read from position_ids (position_ids[a + k] == position_ids[a] + k; None: one
       document per row)."""
    batch, num_blocks = anchors.shape
    seq_len = input_ids.shape[1]
    slot = torch.arange(block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + slot
    clamped = positions.clamp(max=seq_len - 1).flatten(1)

    def at_slots(values):
        return values.gather(1, clamped).view(batch, num_blocks, block_size)

    labels = at_slots(input_ids)
    weights = keep.unsqueeze(-1) & (positions < seq_len) & (slot > 0) & at_slots(loss_mask).bool()
    if position_ids is not None:
        slot_positions = at_slots(position_ids)
        weights &= slot_positions == slot_positions[..., :1] + slot
    return labels, weights.float()


@dataclass
class _Blocks:
    """One forward's blocks, scored: what the step's counts and held-out evaluation's walks read."""
    loss_sum: torch.Tensor          # the optimised sum (with its graph when training)
    head: HeadLoss                  # the unary term's (head_loss)
    labels: torch.Tensor            # [B, N, Bs]
    weights: torch.Tensor           # [B, N, Bs] label weights (slot 0: 0)
    hidden: torch.Tensor            # [B, N, Bs, H] final-normed block states
    selector: SelectorTerms | None  # DFlash 2's
    selector_sum: torch.Tensor | float   # its weighted CE sum (detached)


def split_teacher(hidden, settings: StepSettings, hidden_size: int):
    """hidden [B, S, W] -> (the drafter's features, the target's final normed hidden state [B, S, H] or None):
    with settings.with_teacher the target captures its last layer after the others (launcher/resolve.py)."""
    if not settings.with_teacher:
        return hidden, None
    return hidden[..., :-hidden_size], hidden[..., -hidden_size:]


def teacher_rows(teacher, anchors, block_size):
    """The target's final hidden state [B, N, Bs - 1, H] from which it predicts each drafted slot's token:
    slot k of the block anchored at a is input_ids[a + k], predicted at position a + k - 1 (clamped at the
    row's end, where the slot's weight is 0)."""
    batch, num_blocks = anchors.shape
    positions = anchors.unsqueeze(-1) + torch.arange(block_size - 1, device=anchors.device)
    index = positions.clamp(max=teacher.shape[1] - 1).view(batch, -1, 1).expand(-1, -1, teacher.shape[-1])
    return teacher.gather(1, index).view(batch, num_blocks, block_size - 1, teacher.shape[-1])


def _run_blocks(drafter, head, input_ids, loss_mask, position_ids, features, anchors, keep,
                settings: StepSettings, teacher=None) -> _Blocks:
    """Drafter forward on the given blocks, then the loss in chunks of `settings.chunk_blocks` blocks
    (head_loss.head_loss), so the [N*Bs, V] logits never exist at once; a DFlash 2's selector term
    (selector_loss.py) on the candidates head_loss keeps of each slot. teacher [B, S, H]: the target's
    final hidden state, for the KL share of the unary term (settings.kl_weight)."""
    cfg = drafter.config
    block_ids = block_input_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id)
    h = drafter(features, head.embed(block_ids), anchors, keep, position_ids=position_ids, backend=settings.backend,
                compiled=settings.compiled)
    h = h.view(*anchors.shape, cfg.block_size, -1)
    labels, weights = block_labels(input_ids, loss_mask, anchors, keep, cfg.block_size, position_ids)
    # Slot 0 holds the anchor, given and never drafted (weight 0): the LM head never forms its logits,
    # 1/Bs of the head's products and of its loss passes.
    drafted = slice(1, None)
    with_selector = isinstance(cfg, DFlash2Config)
    out = head_loss(h[:, :, drafted], head, labels[..., drafted], weights[..., drafted], loss=settings.loss,
                    gamma=settings.gamma, dpace_alpha=settings.dpace_alpha, chunk_blocks=settings.chunk_blocks,
                    compiled=settings.compiled, top_k=cfg.selector_top_k if with_selector else 0,
                    teacher=None if teacher is None else teacher_rows(teacher, anchors, cfg.block_size),
                    kl_weight=settings.kl_weight)
    if not with_selector:
        return _Blocks(out.loss_sum, out, labels, weights, h, None, 0.0)
    # The predecessor of drafted slot s is the true token at slot s - 1: the anchor's for the first.
    terms = selector_terms(drafter, h[:, :, drafted], out.candidate_logits, out.candidate_ids, labels[..., :-1],
                           detach=settings.selector_detach)
    selector_sum = (out.final * terms.ce).sum()
    return _Blocks(out.loss_sum + settings.selector_weight * selector_sum, out, labels, weights, h, terms,
                   selector_sum.detach())


def _counts(blocks: _Blocks, keep):
    """StepCounts of one forward's blocks (tokens left 0: the caller knows the padding), and each
    block's accepted slots ([B, N]: leading unary top-1 hits after slot 0, greedy verification)."""
    supervised = blocks.weights > 0
    correct = torch.cat([torch.zeros_like(blocks.head.correct[..., :1]), blocks.head.correct], dim=-1)
    hit = correct & supervised
    accepted = leading(hit[..., 1:], supervised[..., 1:])
    selector = blocks.selector is not None
    values = dict(loss_sum=blocks.loss_sum, weight_sum=blocks.head.weight_sum, tau_sum=((1 + accepted) * keep).sum(),
                  tau_count=keep.sum(), anchor_slots=keep.numel())
    if selector:
        drafted, recalled = supervised[..., 1:], blocks.selector.recalled
        values.update(selector_loss_sum=blocks.selector_sum, recall_hits=(recalled & drafted).sum(),
                      selector_hits=(blocks.selector.picked & drafted).sum(), unary_tau_sum=values["tau_sum"],
                      oracle_tau_sum=((1 + leading(recalled, drafted)) * keep).sum())
    counts = StepCounts(**{name: _scalar(values.get(name, 0), keep.device) for name in _SCALARS},
                        slot_correct=hit.sum(dim=(0, 1)).double(), slot_weight=supervised.sum(dim=(0, 1)).double(),
                        selector=selector)
    return counts, accepted


def _scalar(value, device) -> torch.Tensor:
    """A float64 0-d tensor on `device`. A Python number is filled in on the device: copying it from
    pageable host memory would make the host wait for all the work queued before it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.full((), value, dtype=torch.float64, device=device)


def drafter_step(drafter, head, input_ids, loss_mask, hidden, settings: StepSettings, *, position_ids=None,
                 generator=None, fixed_anchors=None) -> StepOutput:
    """Forward + loss for one micro-batch. input_ids/loss_mask [B, S], hidden [B, S, L*H] (and the target's
    final hidden state after them with settings.kl_weight > 0: split_teacher).
    position_ids [B, S]: restart at 0 at every document start of a packed row (None: one
    document per row); no anchor, label, context key or rotary position crosses a document,
    and the row's settings.num_anchors slots are shared by its documents.
    fixed_anchors: optional (anchors, keep) used instead of sampling. Feature noise draws from
    the global RNG of hidden's device. settings.compiled: the drafter's layers and the head-loss
    terms run through torch.compile (on CUDA the head-loss terms of a training step run through
    the Triton kernels of kernels/head_loss.py)."""
    if fixed_anchors is None:
        anchors, keep = sample_anchors(loss_mask, settings.num_anchors, generator, position_ids)
    else:
        anchors, keep = fixed_anchors
    features, teacher = split_teacher(hidden, settings, drafter.config.hidden_size)
    if settings.feature_noise_std > 0:
        features = features + settings.feature_noise_std * torch.randn_like(features)
    blocks = _run_blocks(drafter, head, input_ids, loss_mask, position_ids, features, anchors, keep, settings,
                         teacher)
    return StepOutput(blocks.loss_sum, _counts(blocks, keep)[0])


def held_out_settings(settings: StepSettings, block_size: int) -> StepSettings:
    """The settings evaluate_tau scores with: the step's forward (backend, compilation, anchors per
    forward, chunks), the dflash weighting at the block size's default gamma whatever the training
    loss, and the unary term's CE alone in `loss` (held-out losses compare across runs and drafter kinds;
    DFlash 2's selector term is reported beside it; no KL share). evaluate_tau adds no feature noise."""
    return replace(settings, loss="dflash", gamma=default_gamma(block_size), dpace_alpha=0.0, selector_weight=0.0,
                   kl_weight=0.0)


@torch.no_grad()
def evaluate_tau(drafter, head, input_ids, loss_mask, hidden, settings: StepSettings, *,
                 position_ids=None) -> StepCounts:
    """Simulated acceptance with an anchor at every valid position, `settings.num_anchors` blocks per
    forward (the training count reuses the compiled shapes), scored with held_out_settings, and the
    decoding walk over those anchors' acceptance (walk_tokens, walk_steps). A DFlash 2's drafts are
    the selector's greedy walk, as vLLM drafts them (tau_sum, walk_*); its unary-only walk and the
    oracle walk are counted beside them (unary_*, oracle_*).
    Held-out rows are normally unpacked (position_ids None); packed rows give the same sums.
    Returns the counts (`.summary()` gives tau, decode_tau, acc, eal, loss) for cross-rank sums."""
    cfg = drafter.config
    hidden, _ = split_teacher(hidden, settings, cfg.hidden_size)
    num_anchors, scoring = settings.num_anchors, held_out_settings(settings, cfg.block_size)
    anchors, keep = all_valid_anchors(loss_mask, multiple_of=num_anchors, position_ids=position_ids)
    with_selector = isinstance(cfg, DFlash2Config)
    totals = StepCounts.zeros(cfg.block_size, input_ids.device, selector=with_selector)
    accepted = {walk: [] for walk in (WALKS if with_selector else WALKS[:1])}
    for start in range(0, anchors.shape[1], num_anchors):
        part = slice(start, start + num_anchors)
        # Freshly laid-out chunks: a slice's strides depend on this batch's anchor count, and compiled
        # code (flex masks, compiled layers) guards on them, so slices would recompile per batch.
        # (.contiguous() is not enough: it keeps the stride of a size-1 dimension.)
        chunk_anchors, chunk_keep = (t[:, part].clone(memory_format=torch.contiguous_format)
                                     for t in (anchors, keep))
        blocks = _run_blocks(drafter, head, input_ids, loss_mask, position_ids, hidden, chunk_anchors, chunk_keep,
                             scoring)
        counts, unary_accepted = _counts(blocks, chunk_keep)
        chunk_accepted = {"": unary_accepted}
        if with_selector:
            supervised, labels = blocks.weights[..., 1:] > 0, blocks.labels
            walked = selector_walk_hits(drafter, blocks.hidden[:, :, 1:], blocks.head.candidate_logits,
                                        blocks.head.candidate_ids, labels[..., 0], labels[..., 1:])
            chunk_accepted = {"": leading(walked, supervised), "unary_": unary_accepted,
                              "oracle_": leading(blocks.selector.recalled, supervised)}
            counts.tau_sum = ((1 + chunk_accepted[""]) * chunk_keep).sum().double()
        totals = totals + counts
        for walk, parts in accepted.items():
            parts.append(chunk_accepted[walk])
    for walk, parts in accepted.items():
        tokens, steps = decoding_walk(anchors, keep, torch.cat(parts, dim=1), loss_mask, position_ids)
        setattr(totals, f"{walk}walk_tokens", _scalar(float(tokens), input_ids.device))
        setattr(totals, f"{walk}walk_steps", _scalar(float(steps), input_ids.device))
    return totals


def decoding_walk(anchors, keep, accepted, loss_mask, position_ids=None) -> tuple[int, int]:
    """(tokens committed, verify steps) if each supervised span were decoded speculatively with this
    drafter and a target whose greedy answer is the span (as in data the target regenerated).

    Decoding starts from the span's first token (the target's own, from the prompt's forward), drafts
    the block anchored there, commits the accepted tokens plus the target's next one, and anchors the
    next block at the last committed token, until the span's last token is committed. So it visits
    only the anchors it lands on, and a stretch the drafter misses costs a step per token while one it
    gets right costs a step per block: its tokens / steps is what real decoding reports, lower than
    the mean over all anchors (tau) wherever acceptance is uneven along the text."""
    anchors, keep, accepted, loss_mask = (t.cpu() for t in (anchors, keep, accepted, loss_mask))
    starts_document = torch.zeros_like(loss_mask, dtype=torch.bool)
    starts_document[:, 0] = True
    if position_ids is not None:
        starts_document |= position_ids.cpu() == 0
    tokens = steps = 0
    for row in range(anchors.shape[0]):
        kept = keep[row]
        accepted_at = dict(zip(anchors[row][kept].tolist(), accepted[row][kept].tolist()))
        mask, first = loss_mask[row].tolist(), starts_document[row].tolist()
        for start in sorted(accepted_at):
            if not (first[start] or not mask[start - 1]):
                continue   # inside a span: decoding reaches it from the span's start, or skips it
            position = start
            while position in accepted_at:
                committed = accepted_at[position] + 1
                tokens, steps, position = tokens + committed, steps + 1, position + committed
    return tokens, steps
