"""Drafter role: receive -> train step (anchors, mask, forward/backward, gradients reduced over the drafter ranks,
sharded optimiser) -> metrics, held-out evaluation, checkpoints -> export."""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

import dflash_core
from dflash_core.drafter.compile import compile_count, report
from dflash_core.serving.export import export_drafter
from dflash_core.serving.model_card import INIT_FROM, SELECTOR_FIGURES, TARGET_IDENTITY, target_identity
from launcher.context import Context
from launcher.distributed.channel import Receiver
from launcher.distributed.isolation import CompileShare, source_digest
from launcher.roles.fault import maybe_fail, poisons, strikes
from launcher.roles.run_stats import RunStats
from launcher.roles.trainer import DrafterTrainer, LaunchedStep
from launcher.run_io import checkpoint, resume
from launcher.run_io.metrics import MetricsSink
from launcher.run_io.plots import plot_run
from launcher.run_io.provenance import card_provenance
from launcher.run_io.rundir import SeqLog
from launcher.run_io.summary import DrafterStats

log = logging.getLogger("dflash")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def _node_builder(ctx: Context) -> int:
    """The drafter rank that compiles first and publishes for the others on its host."""
    host = next(r["host"] for r in ctx.provenance["ranks"] if r["rank"] == ctx.rank)
    return min(r["rank"] for r in ctx.provenance["ranks"] if r["role"] == "drafter" and r["host"] == host)


def _compile_share(ctx: Context) -> CompileShare:
    job = ctx.job
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    key = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
           "sources": source_digest(Path(dflash_core.__file__).parent), "drafter": dataclasses.asdict(job.drafter),
           "step": dataclasses.asdict(job.step), "shape": job.compile.warm_up_shape,
           "evaluates": job.schedule.eval_batches > 0, "flash_attn_4": ctx.provenance["versions"]["flash-attn-4"]}
    return CompileShare(ctx.isolation.cache_dir, key)


def _warm_up(ctx: Context, trainer: DrafterTrainer) -> float | None:
    """Compile the step before the stream starts -> seconds of compiling (not of waiting for the
    builder). Compiled artefacts published earlier (by this run's node builder, or by any earlier run
    with the same compile settings) are loaded first, so only one drafter per node, once, compiles cold."""
    shape = ctx.job.compile.warm_up_shape
    if shape is None:
        return None
    ctx.progress.stage("compiling")
    started = time.perf_counter()
    share = _compile_share(ctx) if ctx.job.compile.compiled else None
    builder = share is not None and ctx.rank == _node_builder(ctx)
    loaded = share is not None and (share.load() if builder else
                                    share.wait_and_load(ctx.job.run.startup_timeout_s))
    waited = time.perf_counter() - started
    trainer.warm_up(*shape, ctx.job.schedule.eval_batches > 0)
    if builder and not loaded:
        log.info("published compiled artefacts: %s", share.publish())
    seconds = time.perf_counter() - started - waited
    log.info("warm-up compiled the step for [%d, %d] in %.1fs (graphs: %d; %s)", *shape, seconds, compile_count(),
             f"loaded published artefacts, {waited:.1f}s to wait for and load them" if loaded
             else "cold" if share else "not compiled")
    return seconds


def _card(ctx: Context, trainer: DrafterTrainer, last_eval: dict | None) -> dict:
    """The export's model card facts."""
    return {"target": str(ctx.job.target.path), TARGET_IDENTITY: target_identity(ctx.job.target.path),
            "data": [str(p) for p in ctx.job.data.paths],
            "steps": ctx.job.train.steps, "tokens_seen": trainer.tokens_seen,
            "heldout_tau": last_eval["decode_tau"] if last_eval else None,
            "heldout_anchor_tau": last_eval["tau"] if last_eval else None,
            **{card: last_eval[key] for key, card in SELECTOR_FIGURES.items() if last_eval and key in last_eval},
            INIT_FROM: ctx.job.start_record(),
            "command": ctx.provenance["launcher_command"] or ctx.provenance["command"],
            "provenance": card_provenance(ctx.provenance)}


@dataclasses.dataclass
class _InFlight:
    """A step whose kernels are queued, and what its log line needs from the moment it was launched."""
    step: int
    launched: LaunchedStep
    payloads: list
    waited: float   # seconds the loop waited for the step's micro-batches
    lr: float       # the learning rate of the step after it (what the log has always shown)


class _Books:
    """Reads launched steps in order, one step behind the launches, and books them: the sequence log,
    the non-finite guard, the run statistics and (on the lead) the metrics sink."""

    def __init__(self, ctx: Context, sink: MetricsSink | None):
        self.ctx, self.sink = ctx, sink
        self.seq_log, self.stats = SeqLog(ctx.run_dir, ctx.rank), RunStats()
        self.bad_steps, self.last_eval = 0, None
        self._in_flight: _InFlight | None = None   # the step launched last, not read yet

    def queue(self, launched: _InFlight) -> None:
        """Hold a just-launched step; read the one before it, which ran while this one was queued."""
        self.flush()
        self._in_flight = launched

    def flush(self) -> None:
        """Read the held step, if any: before evaluation, checkpoints and the end (on every rank alike,
        so a non-finite streak stops every rank at the same step)."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self.read(launched)

    def read(self, launched: _InFlight) -> None:
        """Wait for that step's values (not for steps launched after it), check and log them."""
        result, step, max_bad = launched.launched.result(), launched.step, self.ctx.job.run.max_bad_steps
        for p in launched.payloads:
            self.seq_log.write("trained", p.item)
        self.bad_steps = self.bad_steps + 1 if result.skipped else 0
        if result.skipped:
            log.warning("step %d: non-finite loss or gradient norm (%s); update skipped (%d in a row)", step + 1,
                        result.grad_norm, self.bad_steps)
            if self.bad_steps >= max_bad:
                raise NonFiniteError(f"{self.bad_steps} consecutive non-finite steps, the last at step {step + 1} on "
                                     f"rank {self.ctx.rank} (run.max_bad_steps={max_bad}): lower optim.lr or check "
                                     f"the data; no checkpoint was written from them")
        summary = self.stats.add_step(result, waited=launched.waited)
        if self.sink is not None:
            self.sink.step(step + 1, {"lr": launched.lr, "grad_norm": result.grad_norm,
                                      "skipped_steps": self.stats.skipped, **summary}, self.stats.window_rates)


def _train(ctx: Context, trainer: DrafterTrainer, receiver: Receiver, books: _Books,
           checkpoints: checkpoint.Checkpointer, compile_s: float | None) -> float | None:
    """The steps: receive, train, book, evaluate and checkpoint on schedule -> seconds of compiling."""
    job, sched, fault = ctx.job, ctx.job.schedule, ctx.job.fault
    lead = ctx.rank == ctx.topo.lead_drafter
    for step in range(ctx.start_step, job.train.steps):
        if strikes(fault, step):   # test-only (launcher/roles/fault.py)
            checkpoints.settle()
        maybe_fail(fault, ctx.rank, step)
        t0 = time.perf_counter()
        payloads = [next(receiver) for _ in range(sched.grad_accum)]
        t1 = time.perf_counter()
        batches = [p.batch for p in payloads]
        if poisons(fault, ctx.rank, step):
            batches = [dataclasses.replace(b, hidden=torch.full_like(b.hidden, float("nan"))) for b in batches]
        books.queue(_InFlight(step, trainer.train_step(batches), payloads, t1 - t0,
                              trainer.scheduler.get_last_lr()[0]))
        if step == ctx.start_step:
            books.flush()
            compile_s = time.perf_counter() - t1 if compile_s is None else compile_s
            log.info("first step took %.1fs; graphs compiled so far: %d", time.perf_counter() - t1, compile_count())
        done = step + 1
        saves = done == job.train.steps or (job.run.checkpoint_every and done % job.run.checkpoint_every == 0)
        if sched.evaluates_after(step) or saves:
            books.flush()
        if sched.evaluates_after(step):
            evals = [next(receiver) for _ in range(sched.eval_batches)]
            held_out = trainer.evaluate([p.batch for p in evals])
            for p in evals:
                books.seq_log.write("evaluated", p.item)
            if books.sink is not None:
                books.sink.eval(step + 1, held_out)
            books.last_eval = held_out
        if saves:   # waits for the save before it; this one is written while the next steps run
            checkpoints.save(done, trainer.checkpoint_pieces(), trainer.checkpoint_state(done) if lead else {},
                             resume.record(job, done) if lead else None)
    return compile_s


def run_drafter(ctx: Context, sink: MetricsSink | None) -> DrafterStats:
    """The drafter loop; `sink` is the lead drafter's metrics sink (None on the others)."""
    job, topo, sched, run = ctx.job, ctx.topo, ctx.job.schedule, ctx.job.run
    lead = ctx.rank == topo.lead_drafter
    ctx.progress.stage("building_drafter")
    trainer = DrafterTrainer(job, ctx.groups.drafters)
    # Every drafter rank writes its own shard of each checkpoint, in the background (run_io/checkpoint.py).
    checkpoints = checkpoint.Checkpointer(ctx.run_dir / "checkpoints", run.keep_checkpoints, ctx.groups.checkpoints,
                                          trainer.checkpoint_pieces())
    if ctx.resume_from is not None:   # a checkpoint of this run: its weights, not drafter.init_from's
        ctx.progress.stage("restoring_checkpoint")
        trainer.restore(ctx.resume_from, ctx.groups.checkpoints)
    elif job.init_from is not None:
        trainer.start_from(job.init_from)
        log.info("drafter weights from %s (model.safetensors sha256 %s)", job.init_from.path,
                 job.init_from.weights_sha256)
    elif job.start_from_target:
        layers = trainer.start_from_target(job.target.path)
        log.info("drafter layers from the target's layers %s (drafter.init=target)", layers)
    compile_s = _warm_up(ctx, trainer)   # the warm-up, or else the first step: when this process compiles
    graphs_before_stream = compile_count()
    ctx.progress.meet("stream")
    ctx.progress.stage("streaming")
    receiver = Receiver(sched.items_for_drafter(topo.drafter_index(ctx.rank), ctx.start_step), topo.unit_leader,
                        ctx.comm_device, ctx.device)
    books = _Books(ctx, sink)
    try:
        compile_s = _train(ctx, trainer, receiver, books, checkpoints, compile_s)
    except Exception:
        # The save in flight holds a state from before the failure (a failed step is never saved): let it
        # be published before the error ends this process.
        try:
            checkpoints.wait()
        except checkpoint.CheckpointWriteError as exc:
            log.error("%s", exc)
        raise
    checkpoints.close()
    receiver.close([topo.unit_leader(u) for u in range(topo.num_units)])
    books.seq_log.close()
    if lead:
        log.info("curves: %s", plot_run(ctx.run_dir))
        if run.export:
            # A resumed run re-writes its own previous export.
            export_drafter(trainer.updated_drafter(), ctx.run_dir / "export", overwrite=True,
                           card=_card(ctx, trainer, books.last_eval))
            log.info("exported the drafter to %s", ctx.run_dir / "export")
    recompiles = compile_count() - graphs_before_stream if ctx.job.compile.warm_up_shape else None
    return books.stats.result(items=len(receiver.received), compiles=compile_count(), compile_s=compile_s,
                              recompiles=recompiles, compile_report=report(), held_out=books.last_eval)
