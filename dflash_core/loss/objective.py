"""One DFlash training step on a micro-batch, and the simulated acceptance evaluation.

drafter_step returns the weighted cross-entropy SUM and the weight sum; the caller divides
by the weight sum of the whole global batch (all drafter ranks, all accumulation steps), so
the result does not depend on how the batch was split.
"""

from dataclasses import dataclass, fields, replace

import torch

from .anchors import all_valid_anchors, sample_anchors
from .head_loss import head_loss
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


_SCALARS = ("loss_sum", "weight_sum", "tau_sum", "tau_count", "anchor_slots", "tokens", "walk_tokens", "walk_steps")


@dataclass
class StepCounts:
    """Sums that add across micro-batches, accumulation steps and drafter ranks. Training,
    held-out evaluation and `evaluate_tau` all report these; `summary()` turns them into means."""
    loss_sum: torch.Tensor      # weighted CE sum (detached)
    weight_sum: torch.Tensor    # sum of the loss weights
    tau_sum: torch.Tensor       # sum over valid blocks of 1 + leading correct slots
    tau_count: torch.Tensor     # valid blocks (real anchors)
    anchor_slots: torch.Tensor  # anchor slots computed, valid or padding
    tokens: torch.Tensor        # non-padding context tokens (set by the caller)
    walk_tokens: torch.Tensor   # held-out only: tokens that decoding the supervised spans would commit ...
    walk_steps: torch.Tensor    # ... and the verify steps it would take (decoding_walk)
    slot_correct: torch.Tensor  # [Bs] argmax hits over supervised positions (slot 0 stays 0)
    slot_weight: torch.Tensor   # [Bs] supervised positions per slot

    @classmethod
    def zeros(cls, block_size, device=None):
        scalar = torch.zeros((), dtype=torch.float64, device=device)
        slots = torch.zeros(block_size, dtype=torch.float64, device=device)
        return cls(*[scalar] * len(_SCALARS), slots, slots)

    def __add__(self, other):
        return StepCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def pack(self):
        """One float64 vector [len(_SCALARS) + 2 * Bs]: a single all-reduce carries everything."""
        scalars = torch.stack([torch.as_tensor(getattr(self, name)).double().reshape(()) for name in _SCALARS])
        return torch.cat([scalars, self.slot_correct.double(), self.slot_weight.double()])

    @classmethod
    def unpack(cls, packed):
        n = len(_SCALARS)
        correct, weight = packed[n:].chunk(2)
        return cls(*packed[:n].unbind(), correct, weight)

    def all_reduce(self, group=None):
        import torch.distributed as dist
        packed = self.pack()
        dist.all_reduce(packed, group=group)
        return StepCounts.unpack(packed)

    def summary(self):
        """Means: loss, tau (over anchors), decode_tau (over the verify steps of decoding_walk: what
        speculative decoding of the same text reports), per-slot accuracy acc_k (k = 1..Bs-1) and its
        mean, EAL = 1 + sum_k prod_{i<=k} acc_i, and anchor_fill = valid anchor slots / all slots."""
        acc = (self.slot_correct[1:] / self.slot_weight[1:].clamp(min=1)).double()
        return {
            "loss": float(self.loss_sum / self.weight_sum.clamp(min=1e-12)),
            "tau": float(self.tau_sum / self.tau_count.clamp(min=1)),
            "decode_tau": float(self.walk_tokens / self.walk_steps.clamp(min=1)),
            "acc": float(acc.mean()),
            "acc_k": acc.tolist(),
            "eal": float(1 + torch.cumprod(acc, dim=0).sum()),
            "anchor_fill": float(self.tau_count / self.anchor_slots.clamp(min=1)),
        }


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # weighted CE sum with its graph; not normalised (see module docstring)
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


def _run_blocks(drafter, head, input_ids, loss_mask, position_ids, features, anchors, keep, settings: StepSettings):
    """Drafter forward on the given blocks, then the loss in chunks of `settings.chunk_blocks` blocks
    (head_loss.head_loss), so the [N*Bs, V] logits never exist at once."""
    cfg = drafter.config
    block_ids = block_input_ids(input_ids, anchors, cfg.block_size, cfg.mask_token_id)
    h = drafter(features, head.embed(block_ids), anchors, keep, position_ids=position_ids, backend=settings.backend,
                compiled=settings.compiled)
    h = h.view(*anchors.shape, cfg.block_size, -1)
    labels, weights = block_labels(input_ids, loss_mask, anchors, keep, cfg.block_size, position_ids)
    # Slot 0 holds the anchor, given and never drafted (weight 0): the LM head never forms its logits,
    # 1/Bs of the head's products and of its loss passes.
    drafted = slice(1, None)
    loss_sum, weight_sum, correct = head_loss(h[:, :, drafted], head, labels[..., drafted], weights[..., drafted],
                                              loss=settings.loss, gamma=settings.gamma,
                                              dpace_alpha=settings.dpace_alpha, chunk_blocks=settings.chunk_blocks,
                                              compiled=settings.compiled)
    correct = torch.cat([torch.zeros_like(correct[..., :1]), correct], dim=-1)
    return loss_sum, weight_sum, correct, weights


def _counts(loss_sum, weight_sum, correct, weights, keep):
    """StepCounts of one forward's blocks (tokens left 0: the caller knows the padding), and each
    block's accepted slots ([B, N]: leading correct slots after slot 0, greedy verification)."""
    supervised = weights > 0
    hit = correct & supervised
    accepted = torch.cumprod(hit[..., 1:].long(), dim=-1).sum(dim=-1)
    scalars = [loss_sum, weight_sum, ((1 + accepted) * keep).sum(), keep.sum(), keep.numel(), 0, 0, 0]
    counts = StepCounts(*[_scalar(x, keep.device) for x in scalars], hit.sum(dim=(0, 1)).double(),
                        supervised.sum(dim=(0, 1)).double())
    return counts, accepted


def _scalar(value, device) -> torch.Tensor:
    """A float64 0-d tensor on `device`. A Python number is filled in on the device: copying it from
    pageable host memory would make the host wait for all the work queued before it."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.full((), value, dtype=torch.float64, device=device)


def drafter_step(drafter, head, input_ids, loss_mask, hidden, settings: StepSettings, *, position_ids=None,
                 generator=None, fixed_anchors=None) -> StepOutput:
    """Forward + loss for one micro-batch. input_ids/loss_mask [B, S], hidden [B, S, L*H].
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
    features = hidden
    if settings.feature_noise_std > 0:
        features = hidden + settings.feature_noise_std * torch.randn_like(hidden)
    loss_sum, weight_sum, correct, weights = _run_blocks(drafter, head, input_ids, loss_mask, position_ids, features,
                                                         anchors, keep, settings)
    return StepOutput(loss_sum, _counts(loss_sum, weight_sum, correct, weights, keep)[0])


def held_out_settings(settings: StepSettings, block_size: int) -> StepSettings:
    """The settings evaluate_tau scores with: the step's forward (backend, compilation, anchors per
    forward, chunks), the dflash weighting at the block size's default gamma whatever the training
    loss (held-out losses compare across runs). evaluate_tau adds no feature noise."""
    return replace(settings, loss="dflash", gamma=default_gamma(block_size), dpace_alpha=0.0)


@torch.no_grad()
def evaluate_tau(drafter, head, input_ids, loss_mask, hidden, settings: StepSettings, *,
                 position_ids=None) -> StepCounts:
    """Simulated acceptance with an anchor at every valid position, `settings.num_anchors` blocks per
    forward (the training count reuses the compiled shapes), scored with held_out_settings, and the
    decoding walk over those anchors' acceptance (walk_tokens, walk_steps).
    Held-out rows are normally unpacked (position_ids None); packed rows give the same sums.
    Returns the counts (`.summary()` gives tau, decode_tau, acc, eal, loss) for cross-rank sums."""
    num_anchors, scoring = settings.num_anchors, held_out_settings(settings, drafter.config.block_size)
    anchors, keep = all_valid_anchors(loss_mask, multiple_of=num_anchors, position_ids=position_ids)
    totals = StepCounts.zeros(drafter.config.block_size, input_ids.device)
    accepted = []
    for start in range(0, anchors.shape[1], num_anchors):
        part = slice(start, start + num_anchors)
        # Freshly laid-out chunks: a slice's strides depend on this batch's anchor count, and compiled
        # code (flex masks, compiled layers) guards on them, so slices would recompile per batch.
        # (.contiguous() is not enough: it keeps the stride of a size-1 dimension.)
        chunk_anchors, chunk_keep = (t[:, part].clone(memory_format=torch.contiguous_format)
                                     for t in (anchors, keep))
        loss_sum, weight_sum, correct, weights = _run_blocks(
            drafter, head, input_ids, loss_mask, position_ids, hidden, chunk_anchors, chunk_keep, scoring)
        counts, chunk_accepted = _counts(loss_sum, weight_sum, correct, weights, chunk_keep)
        totals = totals + counts
        accepted.append(chunk_accepted)
    tokens, steps = decoding_walk(anchors, keep, torch.cat(accepted, dim=1), loss_mask, position_ids)
    totals.walk_tokens, totals.walk_steps = (_scalar(float(x), input_ids.device) for x in (tokens, steps))
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
