"""Per-process compile isolation: one process publishes its compiled artefacts, another process with
its own cache dir loads them and compiles nothing (an FX-graph cache hit); and each process sees only
its own GPU, as cuda:0, so those artefacts hit on every GPU of a node."""
import os
import subprocess
import sys

import pytest
import torch

from launcher.distributed.isolation import check_own_gpu, own_gpu
from tests.launching import REPO

_PROGRAM = """
import os, sys, torch
from pathlib import Path
os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[1]
from torch._dynamo.utils import counters
from launcher.distributed.isolation import CompileShare
share = CompileShare(Path(sys.argv[1]), {"settings": 1})
loaded = share.load()
torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + x.sin())(torch.randn(64, 64))
# Kernels outside torch's artefacts, laid out as flash-attn-4 and Triton lay out their caches.
kernels = [Path(sys.argv[1], "flash_attn", "fingerprint", "fwd", "kernel.o"),
           Path(sys.argv[1], "triton", "ab12", "k.so")]
if not loaded:
    for kernel in kernels:
        kernel.parent.mkdir(parents=True)
        kernel.write_bytes(b"compiled")
    share.publish()
print(loaded, all(kernel.exists() and kernel.read_bytes() == b"compiled" for kernel in kernels),
      counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""


_FLAT_WEIGHTS_PROGRAM = """
import sys, tempfile, torch, torch.distributed as dist
from pathlib import Path
from torch._dynamo.utils import counters
from launcher.distributed.isolation import isolate
from launcher.distributed.sharded_adamw import ShardedAdamW
isolate("drafter", 0, 1, Path(sys.argv[1]), torch.device("cpu"), 8, 1)
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
net = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.LayerNorm(256),
                          torch.nn.Linear(256, 256, bias=False))
ShardedAdamW(net, dist.group.WORLD, compute_dtype=torch.float32, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
             weight_decay=0.0)   # the weights become views of one flat buffer, as the drafter's do
layer = torch.compile(lambda m, x: m[2](torch.relu(m[1](m[0](x)))), dynamic=False)
layer(net, torch.randn(4, 256)).sum().backward()
print(counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_bypass"])
"""


def test_compiled_regions_over_flat_weight_views_stay_cacheable(tmp_path):
    # The sharded optimiser makes every weight a view of one buffer, so the compiled layer's weight inputs
    # alias each other; the AOT-autograd cache must still take the graph, or every warm start traces it again.
    first, second = (tuple(map(int, _run_in_a_fresh_process(_FLAT_WEIGHTS_PROGRAM, tmp_path).split()[-2:]))
                     for _ in range(2))
    assert first == (0, 0) and second == (1, 0)


def _run_in_a_fresh_process(program: str, *args) -> str:
    """`program`'s standard output. VEC_ISA_OK: skip inductor's per-cache-dir compiler probes for every
    SIMD flavour (~8 s of g++ in each fresh process); only the CPU's own flags are used either way, and
    the caches are what is tested."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "1"}
    return subprocess.run([sys.executable, "-c", program, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=True).stdout


def _compile_in_a_fresh_process(cache_dir):
    loaded, has_kernel, hits, misses = _run_in_a_fresh_process(_PROGRAM, cache_dir).split()
    return loaded == "True", has_kernel == "True", int(hits), int(misses)


def test_published_artefacts_spare_another_process_the_compile(tmp_path):
    assert _compile_in_a_fresh_process(tmp_path / "builder") == (False, True, 0, 1)
    assert list((tmp_path / "shared").glob("drafter-*.bin")) and list((tmp_path / "shared").glob("*.kernels.tar"))
    # The other process finds the graph and the other kernels in its own cache dir.
    assert _compile_in_a_fresh_process(tmp_path / "other") == (True, True, 1, 0)
    assert not (tmp_path / "builder").samefile(tmp_path / "other")


# ------------------------------------------------------------------ one GPU per process, as cuda:0
def _own_gpu_of(monkeypatch, local_rank, host_gpus, visible=None, setting="auto"):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: host_gpus)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return own_gpu(local_rank, setting), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_each_process_sees_its_own_gpu_only(monkeypatch):
    # Every local rank keeps one GPU, round-robin when ranks outnumber GPUs, and sees it as cuda:0.
    assert [_own_gpu_of(monkeypatch, rank, 4) for rank in range(6)] == [
        (("0", 4), "0"), (("1", 4), "1"), (("2", 4), "2"), (("3", 4), "3"), (("0", 4), "0"), (("1", 4), "1")]
    # A job given some of the host's GPUs picks among those, by position.
    assert _own_gpu_of(monkeypatch, 1, 3, visible="2,5,7") == (("5", 3), "5")
    assert _own_gpu_of(monkeypatch, 0, 1, visible="GPU-8c1f") == (("GPU-8c1f", 1), "GPU-8c1f")


def test_no_gpu_or_cpu_setting_leaves_the_environment_alone(monkeypatch):
    assert _own_gpu_of(monkeypatch, 1, 0) == ((None, 0), None)
    assert _own_gpu_of(monkeypatch, 1, 4, visible="0,1,2,3", setting="cpu") == ((None, 0), "0,1,2,3")


def test_a_process_whose_cuda_started_too_early_is_stopped(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 4, raising=False)
    with pytest.raises(RuntimeError, match=r"sees 4 GPUs where it should see only its own \(2\)"):
        check_own_gpu("2")
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 1, raising=False)
    check_own_gpu("2")
