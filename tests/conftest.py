"""Shared fixtures. The tiny target (a tokenizer and a Qwen3 pretrained briefly on the bundled chats)
is built once and kept under .cache/test-tiny/<key>: the key hashes what determines its bytes (the
builder's source, the bundled data, the seed, the library versions), so a change to any of them
builds a fresh one and an unchanged tree reuses it across test sessions."""
import fcntl
import hashlib
import os
from pathlib import Path

import pytest
import tokenizers
import torch
import torch.distributed as dist
import transformers

import dflash_core.target.tiny as tiny
from tests.launching import REPO


def _tiny_key(seed: int = 0) -> str:
    digest = hashlib.sha256()
    sources = [Path(tiny.__file__), tiny.BUNDLED_DATASET, *sorted((REPO / "dflash_core" / "data").glob("*.py"))]
    for source in sources:
        digest.update(source.read_bytes())
    digest.update(f"{seed} {torch.__version__} {transformers.__version__} {tokenizers.__version__}".encode())
    return digest.hexdigest()[:16]


def _build_tiny_target(family: str = tiny.DEFAULT_FAMILY) -> Path:
    name = _tiny_key() if family == tiny.DEFAULT_FAMILY else f"{family}-{_tiny_key()}"
    out_dir = REPO / ".cache" / "test-tiny" / name
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time: a concurrent session waits here, then finds it complete.
    with open(out_dir.with_name(f"{out_dir.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return tiny.build_tiny_target(out_dir, family=family)


def pytest_configure(config):
    """pytest -n N (xdist): before the workers start, build the tiny target here with every core
    (in a worker it is built beside the other worker's tests, or keeps it waiting idle). Then the
    workers share the cores: each gets its part of them as OpenMP threads (two threads per worker
    made the overfit test 9 s instead of 3 beside a busy core); they inherit the environment."""
    workers = getattr(config.option, "numprocesses", None)
    if workers and workers > 1 and "PYTEST_XDIST_WORKER" not in os.environ:
        _build_tiny_target()
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))


@pytest.fixture(scope="session")
def tiny_target_dir():
    """Directory of the tiny locally built Qwen3 target (tokenizer + briefly pretrained weights)."""
    return _build_tiny_target()


@pytest.fixture(scope="module")
def world():
    """A gloo process group of this process alone: what a DrafterTrainer built in a test reduces over."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: two intra-op threads only add contention when other jobs share the cores (the
    linear-attention fallback's small triangular solves ran 50x slower with two threads on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """Forget every graph an earlier test of this worker compiled: the drafter's compiled callables are
    process-wide, so a test that counts its own compiles would count 0 where one before it (xdist's
    order varies) compiled the same shapes."""
    torch._dynamo.reset()
    yield


@pytest.fixture(autouse=True)
def fresh_dflash_logger():
    """Commands run in-process (run_main) set up the `dflash` logger for a console: handlers bound to
    that test's captured stderr, no propagation. Restore it after each test, so caplog sees records
    and no handler writes to a closed stream."""
    import logging
    logger = logging.getLogger("dflash")
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level
    yield
    logger.handlers[:] = handlers
    logger.propagate, logger.level = propagate, level


@pytest.fixture(scope="session")
def served_qwen3(tiny_target_dir, tmp_path_factory):
    """One real `vllm serve` of the tiny Qwen3 target with a fitted export (speculative) and one
    without speculation, for the whole session (tests/served.py). DFLASH_TEST_EXPORT=DIR serves
    that export instead (e.g. `make train`'s, for the engines' equality test)."""
    from tests import served
    served.require_vllm_env()
    root = tmp_path_factory.mktemp("served-qwen3")
    export = Path(os.environ.get("DFLASH_TEST_EXPORT") or served.fit_export(tiny_target_dir, root / "export"))
    servers = [served.serve(tiny_target_dir, export, root / "speculative.log"),
               served.serve(tiny_target_dir, None, root / "plain.log")]
    try:
        for server in servers:   # both load side by side
            server.launch()
        speculative, plain = (server.wait_ready() for server in servers)
        yield served.Served(tiny_target_dir, export, speculative, plain)
    finally:
        for server in servers:
            server.stop()
