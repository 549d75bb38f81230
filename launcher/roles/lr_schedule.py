"""Learning-rate multipliers: linear warmup, then cosine, warmup-stable-decay, or constant."""
from __future__ import annotations

import math

from launcher.config.schema import OptimSettings


def lr_multiplier(optim: OptimSettings, total_steps: int):
    warmup = max(1, round(optim.warmup_fraction * total_steps)) if optim.warmup_fraction > 0 else 0
    floor = optim.min_lr_ratio
    decay_start = total_steps - round(optim.decay_fraction * total_steps)

    # `step` is the 0-based optimiser step about to run; the last one runs at the floor.
    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.schedule == "constant":
            return 1.0
        if optim.schedule == "wsd":
            if step < decay_start:
                return 1.0
            frac = (step + 1 - decay_start) / max(1, total_steps - decay_start)
            return 1.0 - (1.0 - floor) * frac
        frac = (step + 1 - warmup) / max(1, total_steps - warmup)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return multiplier
