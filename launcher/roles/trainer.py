"""The drafter's training state and its one optimiser step, on one rank of the drafter group.

Public surface (the drafter loop and the benchmark use nothing else): `DrafterTrainer(job, group)`,
`train_step(batches)` -> `LaunchedStep` (`.result()`), `evaluate(batches)`, `warm_up()`,
`checkpoint_pieces()` / `checkpoint_state()` / `restore()`, `updated_drafter()`.

A step never waits for the GPU: every value the host wants (loss, counts, gradient norm, whether
the update was skipped) is copied out behind the step's own kernels and read with
`LaunchedStep.result()`, which waits for that step only. The caller launches step N + 1 before it
reads step N, so the next step's inputs, anchors and masks are queued while the GPU still runs
step N's update: the GPU never idles between steps waiting for the host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist

from dflash_core.drafter import dflash2, from_target
from dflash_core.drafter.dflash2 import DFlash2Config, build_drafter
from dflash_core.drafter.model import DFlashDrafter, fixed_weights
from dflash_core.kernels import fp8
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.loss.objective import StepCounts, drafter_step, evaluate_tau
from dflash_core.serving.export import load_exported
from launcher.distributed.channel import HIDDEN_DTYPE, FeatureBatch
from launcher.distributed.sharded_adamw import ShardedAdamW
from launcher.job import Job, WarmStart
from launcher.roles.lr_schedule import lr_multiplier
from launcher.run_io import checkpoint


def anchor_generator(device: torch.device, seed: int, index: int) -> torch.Generator:
    # Anchors depend only on (seed, micro-batch index): resume replays them exactly, no RNG state needed.
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


def clip_multiplier(norm: torch.Tensor, scale: float | torch.Tensor,
                    max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The one factor m such that gradients * m are the gradients (of L2 norm `norm`) scaled by
    `scale`, then clipped to max_norm; and the scaled norm before clipping. Both 0-d tensors: no host
    sync, no pass that writes the gradients (the AdamW step applies m, see DrafterTrainer._update)."""
    norm = norm * scale
    return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0) * scale


@dataclasses.dataclass
class StepResult:
    counts: StepCounts     # reduced over every drafter rank and accumulation step (host tensors)
    grad_norm: float       # before clipping
    skipped: bool          # non-finite loss or gradient norm: no update was made
    busy_s: float          # the step's own time on its device (CUDA events; host time elsewhere)


class LaunchedStep:
    """A step whose kernels are queued. Its values travel to pinned host memory behind those
    kernels (no wait); `result()` waits for them alone, not for work queued after them."""

    def __init__(self, counts: StepCounts, grad_norm: torch.Tensor, skipped: torch.Tensor, started):
        self._selector = counts.selector
        values = torch.cat([counts.pack(), grad_norm.double().reshape(1), skipped.double().reshape(1)])
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event(enable_timing=True)
            self._done.record()
        else:
            self._host, self._done = values, time.perf_counter()
        self._started = started

    def result(self) -> StepResult:
        if isinstance(self._done, torch.cuda.Event):
            self._done.synchronize()
            busy_s = self._started.elapsed_time(self._done) / 1e3
        else:
            busy_s = self._done - self._started
        values = self._host
        return StepResult(StepCounts.unpack(values[:-2], self._selector), float(values[-2]), bool(values[-1]), busy_s)


class DrafterTrainer:
    def __init__(self, job: Job, group: dist.ProcessGroup):
        self.job, self.group = job, group
        self.device, self.dcfg, seed = job.device, job.drafter, job.run.seed
        self.amp_dtype = job.step.compute_dtype
        torch.manual_seed(seed)
        self.drafter = build_drafter(self.dcfg).to(self.device)
        if job.target.random_weights:
            self.head = FrozenTargetHead.random(self.dcfg.vocab_size, self.dcfg.hidden_size, seed=seed,
                                                device=self.device, dtype=self.amp_dtype)
        else:
            self.head = FrozenTargetHead.from_target_dir(job.target.path, device=self.device, dtype=self.amp_dtype)
        if job.step.matmul_precision == "fp8":   # before the optimiser: it holds the converted layers' weights
            fp8.convert_linears(self.drafter, job.step.fp8_recipe)
            self.head.use_fp8()
        o = job.optim
        # fp32 masters sharded over the drafter ranks; the drafter computes on the bf16 copies the update
        # writes (on GPU); it also sums the ranks' gradients (launcher/distributed/sharded_adamw.py).
        self.optimizer = ShardedAdamW(self.drafter, group, compute_dtype=self.amp_dtype, lr=o.lr,
                                      betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        # Each step's forward waits for the last update's all-gathered weights layer by layer, not all at once.
        self.drafter.weights_ready = self.optimizer.wait_for_weights
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(o, job.train.steps))
        # Context tokens trained on by every drafter rank, over the whole lineage (on the device: no step reads it).
        self._tokens_seen = torch.zeros((), dtype=torch.float64, device=self.device)

    def _zero_counts(self) -> StepCounts:
        return StepCounts.zeros(self.dcfg.block_size, self.device, selector=isinstance(self.dcfg, DFlash2Config))

    def autocast(self):
        if self.amp_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @property
    def tokens_seen(self) -> int:
        return int(self._tokens_seen)

    def _step_start(self):
        """What a step's device time is measured from: a CUDA event queued now, or the host clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def updated_drafter(self) -> DFlashDrafter:
        """The drafter with every weight of the last update in place, for reading its parameters outside a
        forward (the export): with several drafter ranks the update's all-gathers may still be in flight."""
        self.optimizer.wait_for_weights()
        return self.drafter

    def checkpoint_pieces(self, writing: bool = True) -> list[checkpoint.Piece]:
        """This rank's shard of the fp32 weights and AdamW moments (ShardedAdamW.checkpoint_pieces)."""
        return self.optimizer.checkpoint_pieces(writing)

    def checkpoint_state(self, step: int) -> dict:
        """The rest of the checkpoint's state (trainer.json), as JSON values; the same on every drafter rank
        but the RNG states, which are this rank's (the lead's are written)."""
        return {"step": step, "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": checkpoint.rng_state(), "drafter_config": dataclasses.asdict(self.dcfg),
                "tokens_seen": self.tokens_seen,
                "shapes": {name: list(param.shape) for name, param in self.drafter.named_parameters()}}

    def start_from(self, source: WarmStart) -> None:
        """The drafter's weights from an export (drafter.init_from); the optimiser's moments, its step count
        and the schedule stay those of a fresh run. A DFlash export starting a DFlash 2 gives its backbone;
        the convolutions and the selector keep their identity start, so step 0 drafts what the export does."""
        exported = load_exported(source.path)
        new_parts = dflash2.parameter_names(self.dcfg) if isinstance(self.dcfg, DFlash2Config) and not isinstance(
            exported.config, DFlash2Config) else ()
        fixed = fixed_weights(self.dcfg)   # ones in the export (resolve.warm_start checked), not trained here
        weights = {name: value for name, value in exported.state_dict().items() if name not in fixed}
        self.optimizer.load_model_state_dict(weights, keep=new_parts)

    def start_from_target(self, target_dir) -> list[int]:
        """The drafter's layers from the target's last ones (drafter.init=target; resolve checked the shapes);
        DFlash 2's convolutions and selector keep their identity start. Returns the target layers copied."""
        names = [name for name, _ in self.drafter.named_parameters()]
        self.optimizer.load_model_state_dict(from_target.target_start(self.dcfg, target_dir, names),
                                             keep=dflash2.parameter_names(self.dcfg)
                                             if isinstance(self.dcfg, DFlash2Config) else ())
        return from_target.copied_layers(self.dcfg)

    def restore(self, path, group: dist.ProcessGroup | None) -> None:
        """Continue the checkpoint at `path`, whatever drafter count wrote it: this rank's shard is read
        from the ranks' files that hold it (collective over `group`: the Checkpointer's)."""
        state = checkpoint.read_state(path)
        checkpoint.read_pieces(path, self.checkpoint_pieces(writing=False), group)
        self.optimizer.loaded()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        self._tokens_seen.fill_(state.get("tokens_seen", 0))

    def train_step(self, batches: list[FeatureBatch]) -> LaunchedStep:
        """One optimiser step over this rank's micro-batches, queued without waiting for the device.
        A non-finite global loss or gradient norm (every rank sees the same reduced values) skips
        the update on every rank alike: the AdamW step leaves weights, moments and step count as
        they were where `skipped` is set, so the decision needs no host read either."""
        started = self._step_start()
        counts = self._zero_counts()
        for a, batch in enumerate(batches):
            self.optimizer.begin_backward(first=a == 0, last=a == len(batches) - 1)
            with self.autocast():
                out = drafter_step(self.drafter, self.head, batch.input_ids, batch.loss_mask, batch.hidden,
                                   self.job.step, position_ids=batch.position_ids,
                                   generator=anchor_generator(self.device, self.job.run.seed, batch.index))
                out.loss_sum.backward()
            counts = counts + out.counts
            counts.tokens = counts.tokens + batch.num_tokens
        self.optimizer.end_backward()
        counts = counts.all_reduce(self.group)
        self._tokens_seen += counts.tokens
        # The gradients hold the global sums of d(weighted CE sum): the step optimises
        # (global weighted CE sum) / (global weight sum).
        norm, multiplier = clip_multiplier(self.optimizer.grad_norm(), 1.0 / counts.weight_sum.clamp(min=1e-9),
                                           self.job.optim.grad_clip)
        skipped = ~(torch.isfinite(norm) & torch.isfinite(counts.loss_sum))
        self._update(multiplier, skipped)
        self.scheduler.step()   # the learning rate stays a function of the step, skipped or not
        self.optimizer.zero_grad(set_to_none=True)
        return LaunchedStep(counts, norm, skipped, started)

    def _update(self, multiplier: torch.Tensor, skipped: torch.Tensor) -> None:
        """AdamW on gradients * multiplier, or no update at all where `skipped`. The kernel (on CUDA
        dflash_core/kernels/fused_adamw.py's, on CPU torch's fused one given AMP's grad_scale and found_inf)
        scales each gradient as it reads it and does nothing where `skipped`, sparing a separate pass
        over every gradient (the whole drafter's worth of them) and a host read of the skip decision."""
        self.optimizer.step_scaled(multiplier, skipped)

    def warm_up(self, rows: int, seq_len: int, evaluates: bool) -> float:
        """Compile the step for the run's one static shape before the stream starts, so no target
        waits on a first-step compilation under the short run.timeout_s. Leaves weights,
        gradients and RNG states untouched."""
        start = time.perf_counter()
        generator = torch.Generator(device=self.device).manual_seed(0)
        ids = torch.randint(0, self.dcfg.mask_token_id, (rows, seq_len), generator=generator, device=self.device)
        hidden = torch.randn(rows, seq_len, self.job.target.feature_width, generator=generator,
                             device=self.device).to(HIDDEN_DTYPE)
        # Inputs of the stream's kinds, strides included (compiled code guards on them).
        batch = FeatureBatch(0, ids, torch.ones_like(ids), torch.arange(seq_len, device=self.device).repeat(rows, 1),
                             hidden, ids.numel())
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            with self.autocast():
                out = drafter_step(self.drafter, self.head, batch.input_ids, batch.loss_mask, batch.hidden,
                                   self.job.step, position_ids=batch.position_ids, generator=generator)
                out.loss_sum.backward()
            self.optimizer.zero_grad(set_to_none=True)
            if evaluates:
                self._evaluate_local(batch)
        return time.perf_counter() - start

    @torch.no_grad()
    def _evaluate_local(self, batch: FeatureBatch) -> StepCounts:
        self.drafter.eval()
        with self.autocast():
            counts = evaluate_tau(self.drafter, self.head, batch.input_ids, batch.loss_mask, batch.hidden,
                                  self.job.step, position_ids=batch.position_ids)
        self.drafter.train()
        return counts

    @torch.no_grad()
    def evaluate(self, batches: list[FeatureBatch]) -> dict:
        """Held-out simulated acceptance over every drafter rank's batches: StepCounts.summary()."""
        counts = self._zero_counts()
        for batch in batches:
            counts = counts + self._evaluate_local(batch)
        return counts.all_reduce(self.group).summary()
