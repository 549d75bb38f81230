"""Time the drafter's training steps around a checkpoint save, on one drafter rank (t1d1), and count the
bytes it writes (issue 45; the figures: docs/perf_notes.md, "Checkpoint saves").

    python scripts/time_checkpoint_save.py OUT_DIR            # the Qwen3-8B recipe's drafter, on cuda:0
    python scripts/time_checkpoint_save.py OUT_DIR --tiny     # the tiny drafter on the CPU (a test runs this)

The drafter is the bench's qwen3-8b row's (dflash5 on Qwen3-8B: conf/recipe/qwen3_8b.yaml's, as
tests/test_bench.py checks), trained on random target features (launcher.bench's drafter rows). Each
step is timed alone: launched, its values read, the device synchronised. Measured:
  plain   steps without a save: the median is the step time.
  sync    a save on the step's path: the copy to host, DCP's write and the publication, all waited for
          (what a save cost before saves went to the background, one file per rank as now): the time
          of that step and its save, less the median step.
  async   the save as training makes it (launcher/run_io/checkpoint.py, Checkpointer.save): the copy to
          host queued, the write and publication in a background thread while the next steps run.
          Lost: the save call itself, plus what each of the following steps took beyond the median
          while the write ran (the copy's device time lands in the next step; the write's I/O and
          Python share the host); and how long the background write took.
  bytes   what this rank wrote (its __0_0.distcp) and the whole checkpoint directory.
Writes OUT_DIR/checkpoint_save.json and prints it; the checkpoints go to OUT_DIR/checkpoints and are
removed at the end (~12 GB each at the Qwen3-8B shape) unless --keep.
"""
import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def _arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output directory (the result, the checkpoints, the bench target)")
    p.add_argument("--tiny", action="store_true", help="the tiny drafter on the CPU")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per micro-batch (default: the recipe's 4096)")
    p.add_argument("--anchors", type=int, default=512, help="anchors per micro-batch (default: the recipe's 512)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiling)")
    p.add_argument("--steps", type=int, default=10, help="plain steps timed")
    p.add_argument("--after", type=int, default=10, help="steps timed after the asynchronous save")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer dir (default: build the tiny one into OUT/tokenizer)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq_len, args.anchors = min(args.seq_len, 64), min(args.anchors, 8)
    return args


def _job(args, device: torch.device):
    from dflash_core.target.shapes import SHAPES
    from dflash_core.target.tiny import MODEL_SHAPE, build_tiny_target
    from launcher.bench.inputs import run_overrides, write_bench_target
    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve

    tokenizer = args.tokenizer or build_tiny_target(args.out / "tokenizer", pretrain_steps=0)
    shape = {**MODEL_SHAPE, "vocab_size": 1088} if args.tiny else "qwen3-8b"
    target = write_bench_target(args.out / "target", shape, tokenizer)
    overrides = run_overrides(target_dir=target, data_path=args.out / "unused.jsonl", seq_len=args.seq_len,
                              steps=args.warmup + args.steps + args.after + 2, tiny=args.tiny, anchors=args.anchors,
                              work=args.out, mask_token_id=SHAPES["qwen3-8b"].mask_token_id)
    return resolve(compose_config(overrides + (["run.device=cpu"] if device.type == "cpu" else [])),
                   Topology(num_targets=0, num_drafters=1), device)


class _Steps:
    """Training steps on one random micro-batch, each with a new index (new anchors), timed alone."""

    def __init__(self, trainer, job):
        from launcher.distributed.channel import HIDDEN_DTYPE, FeatureBatch

        device, gen = job.device, torch.Generator(device=job.device).manual_seed(0)
        ids = torch.randint(0, min(job.drafter.vocab_size, 1024), (1, job.data.fixed_length), generator=gen,
                            device=device)
        hidden = torch.randn(1, ids.shape[1], job.target.feature_width, generator=gen, device=device,
                             dtype=HIDDEN_DTYPE)
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0)
        self.batch = FeatureBatch(0, ids, torch.ones_like(ids), positions, hidden, ids.numel())
        self.trainer, self.device, self.index = trainer, device, 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, then=None) -> float:
        """Seconds of one step, and of `then()` after it (a save) when given."""
        self.sync()
        start = time.perf_counter()
        self.trainer.train_step([dataclasses.replace(self.batch, index=self.index)]).result()
        self.index += 1
        if then is not None:
            then()
        self.sync()
        return time.perf_counter() - start


def measure(args) -> dict:
    import torch.distributed as dist

    from launcher.roles.trainer import DrafterTrainer
    from launcher.run_io.checkpoint import Checkpointer

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.tiny else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    job = _job(args, device)
    store = args.out / "pg_store"
    store.unlink(missing_ok=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(str(store), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=600), device_id=device if backend == "nccl" else None)
    try:
        with torch.device(device):
            trainer = DrafterTrainer(job, dist.group.WORLD)
        # As launcher/distributed/topology.py makes it: gloo over the drafter ranks, for the saves alone.
        group = dist.new_group([0], backend="gloo")
        root = args.out / "checkpoints"
        shutil.rmtree(root, ignore_errors=True)
        pieces = trainer.checkpoint_pieces()
        started = time.perf_counter()
        writer = Checkpointer(root, 1, group, pieces)
        buffers_s = time.perf_counter() - started
        step = _Steps(trainer, job)

        def save():
            writer.save(step.index, trainer.checkpoint_pieces(), trainer.checkpoint_state(step.index), {})

        for _ in range(args.warmup):
            step()
        plain = [step() for _ in range(args.steps)]
        median = statistics.median(plain)

        synchronous = step(lambda: (save(), writer.wait()))

        call = []
        async_step = step(lambda: call.append(_timed(save)))
        written_at = time.perf_counter()
        after = [step() for _ in range(args.after)]
        started = time.perf_counter()
        final = writer.close()
        waited = time.perf_counter() - started
        background = time.perf_counter() - written_at + call[0]
        shard = sum(p.stat().st_size for p in final.glob("__0_*.distcp"))
        whole = sum(p.stat().st_size for p in final.iterdir())
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    lost_after = sum(max(0.0, t - median) for t in after)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "shape": "tiny" if args.tiny else "qwen3-8b (dflash5)", "seq_len": args.seq_len, "anchors": args.anchors,
        "params": sum(p.numel() for p in trainer.drafter.parameters()),
        "state_bytes": sum(p.tensor.numel() * p.tensor.element_size() for p in pieces),
        "bytes_per_rank": {"0": shard}, "checkpoint_bytes": whole, "host_buffers_s": buffers_s,
        "step_s": {"median": median, "all": plain},
        "sync": {"step_and_save_s": synchronous, "lost_s": synchronous - median},
        "async": {"save_call_s": call[0], "save_step_s": async_step, "after_steps_s": after,
                  "lost_s": (async_step - median) + lost_after, "lost_after_s": lost_after,
                  "background_write_s": background, "waited_at_end_s": waited},
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    args = _arguments(argv)
    result = measure(args)
    (args.out / "checkpoint_save.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"step {result['step_s']['median'] * 1e3:.1f} ms; lost to a save: synchronous "
          f"{result['sync']['lost_s']:.3f} s, asynchronous {result['async']['lost_s']:.3f} s (the call "
          f"{result['async']['save_call_s']:.3f} s, the write {result['async']['background_write_s']:.1f} s in the "
          f"background); {result['bytes_per_rank']['0'] / 2**30:.2f} GiB written by the rank")


if __name__ == "__main__":
    main()
