"""Drafter role: receive -> anchors + mask -> forward/backward -> DP all-reduce -> optimiser step."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dflash_core.attention import compile_count, resolve_backend
from dflash_core.export import export_drafter
from dflash_core.frozen_head import FrozenTargetHead
from dflash_core.model import DFlashDrafter
from dflash_core.objective import acceptance_summary, default_gamma, drafter_step, evaluate_tau
from launcher import checkpoint
from launcher.channel import HIDDEN_DTYPE, Receiver
from launcher.context import Context
from launcher.fault import maybe_fail
from launcher.lr_schedule import lr_multiplier
from launcher.plots import plot_run
from launcher.rundir import SeqLog
from launcher.setup_models import compute_dtype, drafter_config, target_dir

log = logging.getLogger("dflash")


def _item_generator(device: torch.device, seed: int, index: int) -> torch.Generator:
    # Anchors depend only on (seed, micro-batch index): resume replays them exactly, no RNG state needed.
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)


class DrafterTrainer:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        cfg = ctx.cfg
        self.dcfg = drafter_config(cfg)
        self.device = ctx.device
        self.amp_dtype = compute_dtype("auto", self.device)
        torch.manual_seed(cfg.run.seed)
        self.drafter = DFlashDrafter(self.dcfg).to(self.device).compile_layers(self.compiles_layers(cfg, self.device))
        if cfg.target.random_weights:
            self.head = FrozenTargetHead.random(self.dcfg.vocab_size, self.dcfg.hidden_size, seed=cfg.run.seed,
                                                device=self.device, dtype=self.amp_dtype)
        else:
            self.head = FrozenTargetHead.from_target_dir(target_dir(cfg), device=self.device, dtype=self.amp_dtype)
        self.model = DistributedDataParallel(
            self.drafter, process_group=ctx.groups.drafters,
            device_ids=[self.device.index] if self.device.type == "cuda" else None)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=self.device.type == "cuda")
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(o, cfg.train.steps))
        d = cfg.drafter
        self.step_kwargs = dict(num_anchors=d.num_anchors, loss_type=d.loss,
                                gamma=d.gamma if d.gamma is not None else default_gamma(d.block_size),
                                alpha=d.dpace_alpha, backend=d.backend, chunk_blocks=d.chunk_blocks,
                                feature_noise_std=d.feature_noise_std)
        self.is_lead = ctx.rank == ctx.topo.lead_drafter
        self.wait_s = self.compute_s = 0.0

    @staticmethod
    def compiles_layers(cfg, device: torch.device) -> bool:
        """drafter.compile=auto: with the flex backend at one static length (data.fixed_length);
        varying lengths would compile the layers once per length."""
        if cfg.drafter.compile == "auto":
            return resolve_backend(cfg.drafter.backend, device) == "flex" and cfg.data.fixed_length is not None
        return bool(cfg.drafter.compile)

    def autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=self.amp_dtype)
        return contextlib.nullcontext()

    def state(self, step: int) -> dict:
        return {"step": step, "model": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": checkpoint.rng_state(),
                "drafter_config": dataclasses.asdict(self.dcfg)}

    def load_state(self, state: dict) -> None:
        self.drafter.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])

    def train_step(self, payloads) -> tuple[torch.Tensor, float]:
        """One optimiser step over this rank's micro-batches; returns the globally reduced stats and the
        gradient norm before clipping."""
        bs = self.dcfg.block_size
        stats = torch.zeros(5 + 2 * bs, dtype=torch.float64, device=self.device)
        for a, p in enumerate(payloads):
            last = a == len(payloads) - 1
            with (contextlib.nullcontext() if last else self.model.no_sync()), self.autocast():
                out = drafter_step(self.model, self.head, p.input_ids, p.loss_mask, p.hidden,
                                   generator=_item_generator(self.device, self.ctx.cfg.run.seed, p.item.index),
                                   **self.step_kwargs)
                out.loss_sum.backward()
            stats[:4] += torch.stack([out.loss_sum.detach(), out.weight_sum, out.tau_sum, out.tau_count]).double()
            stats[4] += p.num_tokens
            stats[5:5 + bs] += out.slot_correct.double()
            stats[5 + bs:] += out.slot_weight.double()
        dist.all_reduce(stats, group=self.ctx.groups.drafters)
        # DDP averaged the gradients of the unnormalised loss sums over D ranks: rescale so the step
        # optimises (global weighted CE sum) / (global weight sum).
        scale = self.ctx.topo.num_drafters / max(stats[1].item(), 1e-9)
        for param in self.drafter.parameters():
            if param.grad is not None:
                param.grad.mul_(scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.ctx.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats, float(grad_norm)

    def warm_up(self, rows: int, seq_len: int, evaluates: bool) -> float:
        """Compile the attention kernels for the run's one static shape before the stream starts,
        so no target waits on a first-step compilation under the short run.timeout_s. Leaves
        weights, gradients and RNG states untouched."""
        start = time.perf_counter()
        generator = torch.Generator(device=self.device).manual_seed(0)
        ids = torch.randint(0, self.dcfg.mask_token_id, (rows, seq_len), generator=generator, device=self.device)
        mask = torch.ones(rows, seq_len, dtype=torch.long, device=self.device)
        hidden = torch.randn(rows, seq_len, self.dcfg.num_features * self.dcfg.hidden_size, generator=generator,
                             device=self.device).to(HIDDEN_DTYPE)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            with self.model.no_sync(), self.autocast():
                drafter_step(self.model, self.head, ids, mask, hidden, generator=generator,
                             **self.step_kwargs).loss_sum.backward()
            self.optimizer.zero_grad(set_to_none=True)
            if evaluates:
                self.evaluate_local(ids, mask, hidden)
        return time.perf_counter() - start

    @torch.no_grad()
    def evaluate_local(self, input_ids, loss_mask, hidden) -> dict:
        self.drafter.eval()
        with self.autocast():
            result = evaluate_tau(self.drafter, self.head, input_ids, loss_mask, hidden,
                                  backend=self.step_kwargs["backend"], num_anchors=self.step_kwargs["num_anchors"],
                                  chunk_blocks=self.step_kwargs["chunk_blocks"])
        self.drafter.train()
        return result

    @torch.no_grad()
    def evaluate(self, payloads) -> dict:
        bs = self.dcfg.block_size
        sums = torch.zeros(4 + 2 * bs, dtype=torch.float64, device=self.device)
        for p in payloads:
            r = self.evaluate_local(p.input_ids, p.loss_mask, p.hidden)
            sums += torch.tensor([r["loss_sum"], r["weight_sum"], r["tau_sum"], r["tau_count"], *r["slot_correct"],
                                  *r["slot_weight"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums, group=self.ctx.groups.drafters)
        return {"loss": float(sums[0] / sums[1].clamp_min(1e-9)),
                **_summarise(sums[2], sums[3], sums[4:4 + bs], sums[4 + bs:])}


def _summarise(tau_sum, tau_count, correct, weight) -> dict:
    summary = acceptance_summary(correct, weight, tau_sum, tau_count)
    acc_k = summary.pop("acc")
    return {**summary, "acc": sum(acc_k) / len(acc_k), "acc_k": acc_k}


class _RunStats:
    """The drafter loop's bookkeeping: losses, tokens and waiting, in total and per log window."""

    LOSS_WINDOW = 10  # steps averaged for the start and end loss of the summary

    def __init__(self):
        self.started = time.perf_counter()
        self.losses: list[float] = []
        self.tokens = 0.0
        self.progress = [(self.started, 0.0)]  # (time, tokens so far) after each step
        self._window = (self.started, 0.0, 0.0)  # (start, tokens, seconds waiting) since the last log line

    def add_step(self, loss: float, tokens: float, *, waited: float) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        self.progress.append((time.perf_counter(), self.tokens))
        start, window_tokens, window_wait = self._window
        self._window = (start, window_tokens + tokens, window_wait + waited)

    def window_rates(self, *, reset: bool) -> dict:
        now = time.perf_counter()
        start, tokens, waited = self._window
        elapsed = max(now - start, 1e-9)
        if reset:
            self._window = (now, 0.0, 0.0)
        return {"tokens_per_s": tokens / elapsed, "idle_fraction": waited / elapsed}

    def steady_rate(self) -> float:
        """Tokens/s over the second half of the steps: compilation and pipeline fill stay out of it."""
        (t0, n0), (t1, n1) = self.progress[len(self.progress) // 2], self.progress[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def result(self) -> dict:
        wall = time.perf_counter() - self.started
        head, tail = self.losses[:self.LOSS_WINDOW], self.losses[-self.LOSS_WINDOW:]
        return {"wall_s": wall, "tokens": self.tokens, "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
                "steady_tokens_per_s": self.steady_rate(),
                "first_loss": sum(head) / len(head) if head else None,
                "last_loss": sum(tail) / len(tail) if tail else None}


def run_drafter(ctx: Context) -> dict:
    cfg, topo, sched = ctx.cfg, ctx.topo, ctx.schedule
    trainer = DrafterTrainer(ctx)
    ckpt_root = ctx.run_dir / "checkpoints"
    if ctx.resume_from is not None:
        trainer.load_state(checkpoint.load(ctx.resume_from)[1])
    compile_s = None   # the warm-up, or else the first step: when this process compiles
    if cfg.run.warm_up is True or (cfg.run.warm_up == "auto" and cfg.data.fixed_length is not None):
        compile_s = trainer.warm_up(cfg.train.micro_batch_size, cfg.data.fixed_length, sched.eval_batches > 0)
        log.info("warm-up compiled the step for [%d, %d] in %.1fs (flex compiles: %d)",
                 cfg.train.micro_batch_size, cfg.data.fixed_length, compile_s, compile_count())
    dist.barrier(group=ctx.groups.startup)
    drafter_index = topo.drafter_index(ctx.rank)
    receiver = Receiver(sched.items_for_drafter(drafter_index, ctx.start_step), topo.unit_leader,
                        ctx.comm_device, ctx.device)
    sink = None
    if trainer.is_lead:
        from launcher.metrics import MetricsSink
        sink = MetricsSink(ctx.run_dir, cfg.train.steps, ctx.start_step, cfg.run.progress)
    seq_log = SeqLog(ctx.run_dir, ctx.rank)
    run_stats = _RunStats()
    for step in range(ctx.start_step, cfg.train.steps):
        maybe_fail(cfg.fault, ctx.rank, step)
        t0 = time.perf_counter()
        payloads = [next(receiver) for _ in range(cfg.train.grad_accum)]
        t1 = time.perf_counter()
        stats, grad_norm = trainer.train_step(payloads)
        t2 = time.perf_counter()
        trainer.wait_s += t1 - t0
        trainer.compute_s += t2 - t1
        if step == ctx.start_step:
            if compile_s is None:
                compile_s = t2 - t1
            log.info("first step took %.1fs (includes compilation); flex compiles so far: %d", t2 - t1,
                     compile_count())
        for p in payloads:
            seq_log.write("trained", p.item)
        loss = (stats[0] / stats[1].clamp_min(1e-9)).item()
        run_stats.add_step(loss, stats[4].item(), waited=t1 - t0)
        if sink is not None:
            bs = trainer.dcfg.block_size
            write = (step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.train.steps
            record = {"step": step + 1, "loss": loss, "lr": trainer.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                      **run_stats.window_rates(reset=write),
                      **_summarise(stats[2], stats[3], stats[5:5 + bs], stats[5 + bs:])}
            sink.step(record, write)
        if sched.evaluates_after(step):
            evals = [next(receiver) for _ in range(sched.eval_batches)]
            result = trainer.evaluate(evals)
            for p in evals:
                seq_log.write("evaluated", p.item)
            if sink is not None:
                sink.eval({"step": step + 1, **result})
        done = step + 1
        if trainer.is_lead and (done == cfg.train.steps or (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0)):
            path = checkpoint.save(ckpt_root, done, trainer.state(done), cfg.run.keep_checkpoints)
            log.info("checkpoint %s", path)
    receiver.close([topo.unit_leader(u) for u in range(topo.num_units)])
    seq_log.close()
    result = {**run_stats.result(), "recv_wait_s": trainer.wait_s, "step_s": trainer.compute_s,
              "items": len(receiver.received), "compiles": compile_count(), "compile_s": compile_s}
    if trainer.is_lead:
        sink.close()
        log.info("curves: %s", plot_run(ctx.run_dir))
        if cfg.run.export:
            export_drafter(trainer.drafter, ctx.run_dir / "export", overwrite=True)  # a resumed run exports again
            log.info("exported the drafter to %s", ctx.run_dir / "export")
    return result
