"""Each process sees its own GPU only, as cuda:0 (skipped without CUDA; run through the device tool):
the pin must take effect in a process that has not started CUDA yet, and put it on the GPU its local
rank names."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.launching import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_PROGRAM = """
import json, sys, torch
from launcher.distributed.isolation import check_own_gpu, own_gpu
gpu, host_gpus = own_gpu(int(sys.argv[1]), "auto")
torch.cuda.set_device(0)
check_own_gpu(gpu)
print(json.dumps({"gpu": gpu, "host_gpus": host_gpus, "seen": torch.cuda.device_count(),
                  "bus": torch.cuda.get_device_properties(0).pci_bus_id}))
"""


def _pinned(local_rank: int) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", _PROGRAM, str(local_rank)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_local_rank_computes_on_its_own_gpu_as_cuda0():
    count = torch.cuda.device_count()
    for local_rank in range(count + 1):   # one past the last: GPUs are shared round-robin
        pinned = _pinned(local_rank)
        index = local_rank % count
        assert pinned == {"gpu": str(index), "host_gpus": count, "seen": 1,
                          "bus": torch.cuda.get_device_properties(index).pci_bus_id}
