"""Where does a multi-GPU launch stall? Times each start-up step of launcher.train in isolation.

    torchrun --standalone --nproc-per-node 2 scripts/gpu_debug_init.py [--no-device-id]

Two launches on nvidia-h200-x2 (torch 2.11) printed nothing until they timed out, before any rank
logged its first line; this script narrows that down to one call (what it found: docs/perf_notes.md,
"Changes", the first session's open questions).
"""
import argparse
import faulthandler
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[rank{os.environ.get('RANK')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-device-id", action="store_true", help="lazy NCCL init (no device_id)")
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args()
    # A stalled call prints every thread's stack instead of waiting out the timeout silently.
    faulthandler.dump_traceback_later(args.timeout + 10, exit=True)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)
    import socket
    say(f"hostname {socket.gethostname()} resolves to {socket.gethostbyname(socket.gethostname())}; "
        f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}")
    say("init_process_group(nccl)")
    dist.init_process_group("nccl", timeout=timeout, device_id=None if args.no_device_id else device)
    world = dist.get_world_size()
    say("new_group(gloo, world)")
    control = dist.new_group(backend="gloo", timeout=timeout)
    say("broadcast_object_list over gloo")
    box = [rank]
    dist.broadcast_object_list(box, src=0, group=control)
    say(f"new_group(nccl, [0]) and new_group(nccl, [1..{world - 1}])")
    first = dist.new_group([0], timeout=timeout)
    rest = dist.new_group(list(range(1, world)), timeout=timeout)
    say("all_reduce on the subgroup")
    x = torch.ones(4, device=device)
    dist.all_reduce(x, group=first if rank == 0 else rest)
    torch.cuda.synchronize()
    say("P2P header 0 -> 1")
    header = torch.arange(10, device=device)
    if rank == 0:
        dist.isend(header, 1).wait()
    elif rank == 1:
        dist.irecv(header, 0).wait()
    torch.cuda.synchronize()
    say(f"done: received {header.tolist()[:3]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
