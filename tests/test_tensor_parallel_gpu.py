"""A 2-GPU tensor-parallel target unit over NCCL (skipped without 2 GPUs; run through the device
tool): captured states equal the unsharded target's within bf16 tolerance, and its tokens/s.

Qwen3-8B's shape with random weights (the same seed on both GPUs), layers up to the second captured
one kept, S = 4096. This file is also the worker script (`__main__` below)."""
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.launching import torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
LAYER_IDS, SEQ = [1, 9], 4096


def test_two_gpu_unit_equals_the_unsharded_target(tmp_path):
    proc = torchrun(2, __file__, str(tmp_path), module=None, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "tp.json").read_text())
    print(json.dumps(result))
    assert result["relative_error"] < 2e-2   # bf16: two summation orders of the same products


def _worker(out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_core.target.capture import random_target
    from dflash_core.target.shapes import config_from_shape
    from launcher.distributed.tensor_parallel import shard_target

    rank = int(__import__("os").environ["RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=300), device_id=device)
    config = config_from_shape("qwen3-8b")
    ids = torch.randint(0, 100_000, (1, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    reference = None
    if rank == 0:   # the unsharded unit, the same seed
        whole = random_target(config, layer_ids=LAYER_IDS, device=device, dtype=torch.bfloat16, seed=0)
        reference = whole.capture(ids).float()
        del whole
        torch.cuda.empty_cache()
    target = random_target(config, layer_ids=LAYER_IDS, device=device, dtype=torch.bfloat16, seed=0)
    shard_target(target, dist.group.WORLD, device)
    sharded = target.capture(ids).float()
    for _ in range(3):
        target.capture(ids)
    torch.cuda.synchronize(device)
    dist.barrier()
    started, reps = time.perf_counter(), 10
    for _ in range(reps):
        target.capture(ids)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / reps
    if rank == 0:
        error = float((sharded - reference).norm() / reference.norm())
        result = {"relative_error": error, "max_abs_diff": float((sharded - reference).abs().max()),
                  "ms_per_capture": 1e3 * seconds, "kept_layers": target.num_kept_layers,
                  "tokens_per_s_per_unit": SEQ / seconds, "tokens_per_s_per_gpu": SEQ / seconds / 2}
        (Path(out_dir) / "tp.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
