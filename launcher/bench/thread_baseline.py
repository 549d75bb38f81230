"""The OLD one-process design, kept only as a benchmark baseline: the frozen target on the main
thread and one Python thread per drafter, fed through queue.Queue, every thread calling the same
compiled flex_attention. This is the layout whose cross-thread torch.compile races motivated the
process-per-GPU launcher (see /work/shared/design.md, "Isolation").

Every exception in a drafter thread is caught, counted by type and message, and the thread goes on
with its next micro-batch, so the result says how often a step failed, not just that one did.
`fx_noise` adds a thread that runs torch.fx.symbolic_trace on a small module in a loop: FX's
tracing flag is process-global, and compiled calls made while it is set fail ("Detected that you
are using FX to symbolically trace a dynamo-optimized function").

    python -m launcher.bench.thread_baseline --spec spec.json --out result.json

spec.json: {"target_dir", "drafter_config" (DrafterConfig or DFlash2Config fields), "seq_len", "num_anchors",
"chunk_blocks", "items_per_thread", "target_device", "drafter_devices" (one per thread),
"backend", "fx_noise", "timeout_s", "seed", "lr"}. launcher/bench/__main__.py writes it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections import Counter

import torch

_DONE = None


def _failure_key(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:160] if lines else ''}"


class _FxNoise(threading.Thread):
    """torch.fx.symbolic_trace of a small module in a loop: the incident's trigger."""

    def __init__(self):
        super().__init__(daemon=True, name="fx-noise")
        self.stop = threading.Event()
        self.traces = 0
        self.errors = Counter()

    def run(self):
        import torch.fx

        class Small(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 8)

            def forward(self, x):
                return torch.relu(self.linear(x)) + 1

        module = Small()
        while not self.stop.is_set():
            try:
                torch.fx.symbolic_trace(module)
                self.traces += 1
            except Exception as exc:  # noqa: BLE001 - counted, never fatal
                self.errors[_failure_key(exc)] += 1


class _DrafterThread(threading.Thread):
    def __init__(self, index, device, drafter, head, spec, start_barrier):
        super().__init__(daemon=True, name=f"drafter-{index}")
        self.index, self.device, self.drafter, self.head, self.spec = index, device, drafter, head, spec
        self.inbox: queue.Queue = queue.Queue(maxsize=2)   # bounded: backpressure like the channel
        self.start_barrier = start_barrier
        self.done_steps: list[tuple[float, int]] = []       # (finish time, tokens) per successful step
        self.failures = Counter()
        self.attempted = 0
        self.finished = False

    def run(self):
        from dflash_core.loss.objective import drafter_step
        from launcher.config.schema import DrafterSettings
        from launcher.resolve import step_settings

        spec, device = self.spec, self.device
        cuda = device.type == "cuda"
        optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=spec["lr"], betas=(0.9, 0.95), fused=cuda)
        generator = torch.Generator(device=device).manual_seed(spec["seed"] + self.index)
        # The config's default step settings with the spec's anchors, chunks and backend; eager.
        settings = step_settings(DrafterSettings(block_size=self.drafter.config.block_size,
                                                 num_anchors=spec["num_anchors"], chunk_blocks=spec["chunk_blocks"]),
                                 spec["backend"], compiled=False, device=device)
        autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
        with torch.cuda.device(device) if cuda else contextlib.nullcontext():
            self.start_barrier.wait()
            while True:
                item = self.inbox.get()
                if item is _DONE:
                    break
                self.attempted += 1
                try:
                    input_ids, loss_mask, hidden = (t.to(device, non_blocking=True) for t in item)
                    with autocast():
                        out = drafter_step(self.drafter, self.head, input_ids, loss_mask, hidden, settings,
                                           generator=generator)
                    (out.loss_sum / out.counts.weight_sum.clamp_min(1e-9)).backward()
                    torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
                    optimizer.step()
                    if cuda:
                        torch.cuda.synchronize(device)
                    self.done_steps.append((time.perf_counter(), input_ids.numel()))
                except Exception as exc:  # noqa: BLE001 - the point: count failures, keep going
                    self.failures[_failure_key(exc)] += 1
                finally:
                    optimizer.zero_grad(set_to_none=True)
        self.finished = True


def _steady_rate(events: list[tuple[float, int]]) -> float:
    """Tokens/s over the second half of the successful steps (all threads, by finish time)."""
    events = sorted(events)
    if len(events) < 3:
        return 0.0
    mid = len(events) // 2
    (t0, _), (t1, _) = events[mid], events[-1]
    return sum(n for _, n in events[mid + 1:]) / (t1 - t0) if t1 > t0 else 0.0


def run_baseline(spec: dict) -> dict:
    from transformers import AutoConfig

    from dflash_core.drafter.dflash2 import build_drafter, config_from_fields
    from dflash_core.loss.frozen_head import FrozenTargetHead
    from dflash_core.target.capture import random_target

    t_start = time.perf_counter()
    dcfg = config_from_fields(spec["drafter_config"])
    target_device = torch.device(spec["target_device"])
    devices = [torch.device(d) for d in spec["drafter_devices"]]
    dtype = torch.bfloat16 if target_device.type == "cuda" else torch.float32
    target = random_target(AutoConfig.from_pretrained(spec["target_dir"]), layer_ids=dcfg.target_layer_ids,
                           device=target_device, dtype=dtype, seed=spec["seed"])
    heads = {}
    threads = []
    barrier = threading.Barrier(len(devices) + 1)
    for i, device in enumerate(devices):
        if device not in heads:  # frozen, read-only: one copy per device is shared by its threads
            heads[device] = FrozenTargetHead.random(dcfg.vocab_size, dcfg.hidden_size, seed=spec["seed"],
                                                    device=device, dtype=torch.bfloat16 if device.type == "cuda"
                                                    else torch.float32)
        torch.manual_seed(spec["seed"] + i)
        with torch.device(device):
            drafter = build_drafter(dcfg)
        threads.append(_DrafterThread(i, device, drafter, heads[device], spec, barrier))
    print(f"thread baseline: target on {target_device}, {len(devices)} drafter threads on "
          f"{[str(d) for d in devices]}, backend {spec['backend']}, fx_noise {spec['fx_noise']}, "
          f"built in {time.perf_counter() - t_start:.1f}s", flush=True)

    seq_len = spec["seq_len"]
    gen = torch.Generator().manual_seed(spec["seed"])
    first_ids = torch.randint(0, min(dcfg.mask_token_id, 1024), (1, seq_len), generator=gen)
    fallback = (first_ids, target.capture(first_ids).to(torch.bfloat16))   # also the target's warm-up
    if target_device.type == "cuda":
        torch.cuda.synchronize(target_device)
    noise = _FxNoise() if spec["fx_noise"] else None
    for thread in threads:
        thread.start()
    if noise:
        noise.start()
    barrier.wait()
    started = time.perf_counter()
    deadline = started + spec["timeout_s"]
    total = spec["items_per_thread"] * len(threads)
    produced, timed_out = 0, False
    target_failures = Counter()
    for i in range(total):
        input_ids = torch.randint(0, min(dcfg.mask_token_id, 1024), (1, seq_len), generator=gen)
        loss_mask = torch.ones(1, seq_len, dtype=torch.long)
        # The target thread is exposed too: FX's module-call patcher is process-global, so a
        # symbolic_trace in another thread reroutes this forward's nn.Module calls. A failed forward
        # is counted and the item is fed with the states captured before the threads started, so
        # the drafter threads' failure rate is still measured.
        try:
            hidden = target.capture(input_ids).to(torch.bfloat16)
            if target_device.type == "cuda":
                torch.cuda.synchronize(target_device)   # the drafter thread reads it from another thread
        except Exception as exc:  # noqa: BLE001 - counted, never fatal
            target_failures[_failure_key(exc)] += 1
            input_ids, hidden = fallback
        inbox = threads[i % len(threads)].inbox
        while True:
            try:
                inbox.put((input_ids, loss_mask, hidden), timeout=1.0)
                break
            except queue.Full:
                if time.perf_counter() > deadline:
                    timed_out = True
                    break
        if timed_out:
            break
        produced += 1
        if (i + 1) % max(1, total // 5) == 0:
            done = sum(len(t.done_steps) for t in threads)
            failed = sum(sum(t.failures.values()) for t in threads)
            print(f"thread baseline: produced {i + 1}/{total}, steps done {done}, failed {failed}, "
                  f"{time.perf_counter() - started:.1f}s", flush=True)
    for thread in threads:
        with contextlib.suppress(queue.Full):
            thread.inbox.put(_DONE, timeout=max(1.0, deadline - time.perf_counter()))
    for thread in threads:
        thread.join(timeout=max(1.0, deadline - time.perf_counter()))
    wall = time.perf_counter() - started
    if noise:
        noise.stop.set()
        noise.join(timeout=5)
    events = [e for t in threads for e in t.done_steps]
    failures = Counter()
    for thread in threads:
        failures.update(thread.failures)
    tokens = sum(n for _, n in events)
    return {
        "threads": len(threads), "drafter_devices": [str(d) for d in devices], "target_device": str(target_device),
        "backend": spec["backend"], "fx_noise": bool(spec["fx_noise"]), "seq_len": seq_len,
        "items_produced": produced, "steps_attempted": sum(t.attempted for t in threads),
        "steps_done": len(events), "failures": sum(failures.values()), "failure_kinds": dict(failures.most_common()),
        "target_failures": sum(target_failures.values()), "target_failure_kinds": dict(target_failures.most_common()),
        "hung_threads": sum(not t.finished for t in threads), "timed_out": timed_out,
        "fx_traces": noise.traces if noise else 0, "fx_errors": dict(noise.errors) if noise else {},
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "steady_tokens_per_s": _steady_rate(events),
        "per_thread": [{"device": str(t.device), "attempted": t.attempted, "done": len(t.done_steps),
                        "failures": sum(t.failures.values())} for t in threads],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON spec written by python -m launcher.bench")
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    result = run_baseline(spec)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"thread baseline: {result['steps_done']}/{result['steps_attempted']} steps done, {result['failures']} "
          f"failed, {result['target_failures']} target forwards failed, {result['tokens_per_s']:.0f} tokens/s "
          f"({result['steady_tokens_per_s']:.0f} steady)", flush=True)
    for kind, count in result["failure_kinds"].items():
        print(f"thread baseline drafter failure x{count}: {kind}", flush=True)
    for kind, count in result["target_failure_kinds"].items():
        print(f"thread baseline target failure x{count}: {kind}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # A stuck drafter thread (or a compile worker pool) must not keep the benchmark waiting.
    os._exit(0)


if __name__ == "__main__":
    main()
