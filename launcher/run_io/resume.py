"""Where a run starts: which checkpoint it continues, and whether the current config may continue it.

Every checkpoint's meta.json records what it was trained with: the drafter's shape (`model`), what
decides the order of the micro-batches (`stream`), how many it trained, and the whole resolved config.
On resume the shape must match (the weights would not fit, or would be trained for another block size
or feature set) and so must the data order, fixed by the seed, the data and the micro-batch size: any
change there would train some micro-batches twice and others never. The micro-batches per step, P =
drafter ranks x grad_accum, may change (another drafter count): the resumed run goes on at the first
micro-batch the checkpoint did not train, P per step (launcher/distributed/schedule.py, `resumed_at`);
each micro-batch is still trained once and in order, but an optimiser step then averages over another
number of them, which the run says once. (Another drafter count with the same P, e.g. t1d2 -> t1d1
with grad_accum 1 -> 2, continues exactly.) Other changes (learning rate, steps, ...) are listed in a
warning.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_core.data.records import file_fingerprint
from dflash_core.target.families import text_config
from launcher.config import flat_config
from launcher.job import Job
from launcher.run_io import checkpoint

log = logging.getLogger("dflash")
# Keys that name this launch, not what is trained.
_PER_LAUNCH = ("run.dir", "run.resume", "fault.")
# Data keys that do not change which samples the stream holds (packing is recorded resolved).
_NOT_STREAM = ("cache_dir", "packing", "num_proc")


class ResumeError(ValueError):
    """The run cannot start from the checkpoint(s) it finds; the message says what to do instead."""


@dataclass(frozen=True)
class Launch:
    """Which torchrun job and attempt this is (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT)."""
    job: str = ""
    attempt: int = 0

    def restarts(self, lineage: dict | None) -> bool:
        """This is a later attempt (--max-restarts) of the torchrun job that started `lineage`."""
        return (bool(self.job) and lineage is not None and lineage.get("job") == self.job
                and self.attempt > lineage.get("attempt", 0))

    def start_lineage(self, root: Path, parent: str | None = None) -> None:
        checkpoint.start_lineage(root, parent, job=self.job, attempt=self.attempt)


@dataclass(frozen=True)
class ResumePoint:
    step: int = 0                  # first optimiser step this run executes
    path: str | None = None        # checkpoint it restores
    finished: str | None = None    # why there is nothing to train (train.steps at or below the checkpoint's)
    trained: int = 0               # training micro-batches the checkpoint's lineage consumed


_PER_STEP = "micro-batches per step"
_TRAINED = "trained micro-batches"


def record(job: Job, step: int) -> dict:
    """What meta.json records about the config a checkpoint of `step` steps was trained with."""
    sched = job.schedule
    model = {f"drafter.{key}": value for key, value in asdict(job.drafter).items()}
    model["target.model_type"] = text_config(job.target.hf_config).model_type
    stream = {_PER_STEP: sched.train_per_step, "train.micro_batch_size": job.train.micro_batch_size,
              "run.seed": job.run.seed, "data.packing": job.packing, "held-out split": sched.eval_batches > 0,
              **{f"data.{key}": value for key, value in asdict(job.data).items() if key not in _NOT_STREAM}}
    return {"model": model, "stream": stream, _TRAINED: sched.trained_before(step),
            "data_files": data_fingerprints(job.data_sources()),
            "split": {"drafter ranks": sched.num_drafters, "train.grad_accum": sched.grad_accum},
            "config": flat_config(job.cfg)}


def data_fingerprints(sources: list[Path]) -> dict[str, str]:
    """Each dataset source's content fingerprint (size and sha256 of its bytes), by path: a file
    replaced under the same path between a run and its resume is told by its content."""
    return {str(path): file_fingerprint(path) for path in sources}


def _check_data_files(meta: dict, now: dict, path: Path, step: int) -> None:
    saved = meta.get("data_files") or {}   # checkpoints written before fingerprints were recorded: not compared
    changed = [file for file, fingerprint in now["data_files"].items()
               if file in saved and saved[file] != fingerprint]
    if changed:
        raise ResumeError(f"cannot resume from {path} at step {step}: the content of {', '.join(changed)} changed "
                          f"since the checkpoint was trained on it (same path, other bytes: "
                          f"checkpoint {saved[changed[0]]}, now {now['data_files'][changed[0]]}); the stream would "
                          f"go on over data it never started on: restore the file, or start fresh in another run.dir")


def _changes(saved: dict, now: dict, skip=()) -> list[str]:
    keys = [k for k in dict.fromkeys([*saved, *now]) if not k.startswith(skip)]
    return [f"{key}: checkpoint {_recorded(saved, key)}, now {_recorded(now, key)}" for key in keys
            if saved.get(key) != now.get(key)]


def _recorded(record: dict, key: str) -> str:
    # A key one side lacks is a setting added or removed since (e.g. drafter.cuda_graph, issue 42), not a null.
    return repr(record[key]) if key in record else "no such setting"


def trained(meta: dict, per_step: int) -> int:
    """The training micro-batches the lineage of a checkpoint's meta.json consumed. Recorded since runs may
    change the micro-batches per step; before, every step consumed the same number: the checkpoint's, or
    where it records none, this run's `per_step`."""
    if _TRAINED in meta:
        return meta[_TRAINED]
    return meta["step"] * meta.get("stream", {}).get(_PER_STEP, per_step)


def _resplit(meta: dict, now: dict, path: Path, evaluates: bool) -> None:
    """Said once: what a resume at another split (drafter ranks x train.grad_accum) does not continue as
    the checkpoint's run would have."""
    saved, split = (" x ".join(str(v) for v in side.get("split", {}).values()) for side in (meta, now))
    before, after = meta["stream"][_PER_STEP], now["stream"][_PER_STEP]
    ranks = now["split"]["drafter ranks"]
    notes = []
    if before != after:
        keep = (f"; train.grad_accum={before // ranks} keeps {before} per step" if before % ranks == 0 else "")
        notes.append(f"the stream goes on at micro-batch {trained(meta, after)}, every micro-batch still trained once "
                     f"and in order, but each optimiser step now averages {after} of them, not {before} (the "
                     f"learning-rate schedule still counts steps), so the loss curve goes on as a run of this split "
                     f"would{keep}")
    saved_ranks = meta.get("split", {}).get("drafter ranks", ranks)
    if evaluates and ranks != saved_ranks:
        notes.append(f"held-out evaluations cover {ranks} x train.eval_batches micro-batches, not {saved_ranks} x")
    if notes:
        log.warning("resuming from %s at drafter ranks x train.grad_accum = %s where the checkpoint trained at %s: %s",
                    path, split, saved or "another split", "; ".join(notes))


def check(meta: dict, job: Job, path: Path) -> None:
    """ResumeError unless the current config can continue the checkpoint at `path`; other changes warned."""
    if "model" not in meta:
        log.warning("checkpoint %s records no config (written before resumes were checked): not compared", path)
        return
    now, step = json.loads(json.dumps(record(job, meta["step"]))), meta["step"]   # compared as meta.json stores it
    shape = _changes(meta["model"], now["model"])
    if shape:
        raise ResumeError(f"cannot resume from {path}: the drafter's shape differs from the checkpoint's "
                          f"({'; '.join(shape)}); resume with the checkpoint's settings, or train this shape in "
                          f"another run.dir")
    stream = _changes(meta["stream"], now["stream"], skip=(_PER_STEP,))
    if stream:
        raise ResumeError(f"cannot resume from {path} at step {step}: {'; '.join(stream)}: the micro-batches after "
                          f"the checkpoint would not continue its data order (some samples trained twice, others "
                          f"never); resume with the checkpoint's values, or start fresh in another run.dir")
    _resplit(meta, now, path, job.schedule.eval_batches > 0)
    _check_data_files(meta, now, path, step)
    others = _changes(meta["config"], now["config"], skip=_PER_LAUNCH + tuple(now["model"]) + tuple(now["stream"]))
    if others:
        log.warning("resuming from %s with changed settings: %s", path, "; ".join(others))


def _explicit(setting: str, run_dir: Path, launch: Launch) -> tuple[Path, int]:
    """run.resume=<checkpoint>: into a run dir with no checkpoints of another history. A restart of the
    job that started from it (its lineage's parent) continues that job's own latest checkpoint."""
    root, source = run_dir / "checkpoints", Path(setting).resolve()
    lineage = checkpoint.read_lineage(root)
    if lineage is not None and lineage.get("parent") == str(source):
        own = checkpoint.load_latest(root)
        if own is not None:
            log.warning("run.resume=%s: this run.dir continues it already; resuming from its own latest %s",
                        setting, own[0])
            return own
        return source, checkpoint.verify(source)
    latest = checkpoint.pointed(root)
    if latest is not None and latest.resolve() == source:   # the dir's own latest, named explicitly
        return source, checkpoint.verify(source)
    if checkpoint.complete(root):
        raise ResumeError(f"run.resume={setting}: run.dir={str(run_dir)!r} already holds the checkpoints of another "
                          f"training history (latest {latest.name if latest else 'unknown'}), which later saves "
                          f"would mix with: resume into another run.dir, or move or delete {root}")
    step = checkpoint.verify(source)
    launch.start_lineage(root, parent=str(source))
    return source, step


def choose(job: Job, run_dir: Path, launch: Launch = Launch()) -> ResumePoint:
    """The lead drafter's decision (the other ranks receive it): start fresh, continue this run dir's
    latest checkpoint, or continue run.resume's checkpoint; refused with a clear error when that
    would mix training histories or change what the checkpoint was trained with."""
    setting, root = job.run.resume, run_dir / "checkpoints"
    if setting == "never":
        existing = checkpoint.complete(root)
        if not existing:
            launch.start_lineage(root)
            return ResumePoint()
        if not launch.restarts(checkpoint.read_lineage(root)):
            raise ResumeError(f"run.resume=never: run.dir={str(run_dir)!r} already holds checkpoints "
                              f"({', '.join(p.name for p in existing)}); to start fresh pick another run.dir, or "
                              f"move or delete {root}; run.resume=auto continues them")
        log.warning("run.resume=never: attempt %d of torchrun job %s continues the checkpoints its first attempt "
                    "started", launch.attempt, launch.job)
        setting = "auto"
    if setting == "auto":
        found = checkpoint.load_latest(root)
        if found is None:
            if checkpoint.complete(root):
                raise ResumeError(f"run.dir={str(run_dir)!r} holds checkpoints but none of them loads (see the "
                                  f"warnings above): run.resume=<a good checkpoint>, or move or delete {root}")
            if checkpoint.read_lineage(root) is None:
                launch.start_lineage(root)
            return ResumePoint()
        path, step = found
    else:
        path, step = _explicit(setting, run_dir, launch)
    meta = checkpoint.read_meta(path)
    check(meta, job, path)
    finished = None
    if step >= job.train.steps:
        finished = (f"the checkpoint {path} is at step {step} and train.steps={job.train.steps}: nothing to "
                    f"train (raise train.steps to train further)")
    return ResumePoint(step, str(path), finished, trained(meta, job.schedule.train_per_step))
