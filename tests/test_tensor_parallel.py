"""Tensor-parallel target units: plan mapping, validation, and sharded == unsharded captures.

The multi-process checks run real torchrun jobs on CPU (gloo). This file is also the worker
script of the equality test (`__main__` below), so no helper module is needed.
"""
import sys
from pathlib import Path

import pytest
import torch

from tests.launching import torchrun

LAYER_IDS = [0, 2, 3]  # 3 is the last layer: captured after the final norm, which stays replicated
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32; measured max |diff| ~2e-6 on values up to ~4


def _inputs() -> torch.Tensor:
    return torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- single process
def test_layer_plan_from_qwen3_config():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import Qwen3Config

    from launcher.distributed.tensor_parallel import layer_plan
    plan = layer_plan(Qwen3Config())
    assert {k for k, v in plan.items() if isinstance(v, ColwiseParallel)} == {
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
    assert {k for k, v in plan.items() if isinstance(v, RowwiseParallel)} == {"self_attn.o_proj", "mlp.down_proj"}
    assert "self_attn.q_norm" not in plan  # replicated norms are left alone at inference


def test_layer_plan_per_family_and_unknown_style():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import GptOssConfig, Qwen3Config, Qwen3MoeConfig

    from launcher.distributed.tensor_parallel import TensorParallelError, layer_plan, plan_strings
    gpt_oss = layer_plan(GptOssConfig())  # transformers has no layer plan: the family's own, attention only
    assert set(gpt_oss) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert isinstance(gpt_oss["self_attn.o_proj"], RowwiseParallel)
    _, replicated = plan_strings(Qwen3MoeConfig())  # experts stay whole, attention is split
    assert set(replicated) == {"mlp.experts", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert isinstance(layer_plan(Qwen3MoeConfig())["self_attn.q_proj"], ColwiseParallel)
    packed = Qwen3Config()
    packed.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(TensorParallelError, match="packed_colwise"):
        layer_plan(packed)


def test_heads_must_divide():
    from transformers import Qwen3Config

    from launcher.distributed.tensor_parallel import TensorParallelError, check_divisible
    config = Qwen3Config(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    check_divisible(config, 2)
    with pytest.raises(TensorParallelError, match="tp_size=4 .*num_key_value_heads=2"):
        check_divisible(config, 4)


def test_config_validation():
    from launcher.config import ConfigError, compose_config
    from launcher.resolve import check_combinations
    check_combinations(compose_config(["target.parallel=tensor", "target.tp_size=2"]))
    with pytest.raises(ConfigError, match="target.parallel='pipeline'"):
        compose_config(["target.parallel=pipeline"])
    with pytest.raises(ConfigError, match="target.tp_size=2.*replicate"):
        check_combinations(compose_config(["target.tp_size=2"]))


# ----------------------------------------------------------------------------- multi-process
@pytest.mark.multiproc
def test_unit_of_two_matches_unsharded_target(tmp_path, tiny_target_dir):
    """Ranks 0-1 form a unit inside a world of 3 (rank 2 stays out of the mesh, like a drafter)."""
    proc = torchrun(3, __file__, str(tmp_path), str(tiny_target_dir), module=None, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]

    from dflash_core.target import load_target
    reference = load_target(tiny_target_dir, layer_ids=LAYER_IDS, dtype=torch.float32).capture(_inputs())
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert not (tmp_path / "rank2.pt").exists()
    assert rank0.shape == reference.shape == (2, 40, 128 * len(LAYER_IDS))
    torch.testing.assert_close(rank0, reference, **TOLERANCE)
    assert torch.equal(rank0, rank1)  # the all-reduce leaves every rank of the unit the same replica


@pytest.mark.multiproc
def test_t2d1_tensor_parallel_trains(tmp_path, tiny_target_dir):
    run_dir = tmp_path / "run"
    proc = torchrun(3, "topology=t2d1", "target.parallel=tensor", "target.tp_size=2", f"run.dir={run_dir}",
                    f"target.path={tiny_target_dir}", "train.steps=4", "run.progress=false",
                    f"data.cache_dir={tmp_path / 'tok'}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (run_dir / "summary.json").is_file()
    for rank in (0, 1):
        log = (run_dir / "logs" / f"target{rank}.log").read_text()
        assert "target sharded over unit ranks [0, 1] (tp_size 2)" in log
    sent = {rank: [line for line in (run_dir / "seq" / f"rank{rank}.log").read_text().splitlines()
                   if line.startswith("sent")] for rank in (0, 1)}
    assert sent[0] and not sent[1]  # only the unit leader sends; rank 1 computed the same forwards in step


# ----------------------------------------------------------------------------- worker
def _worker(out_dir: str, target_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from dflash_core.target import load_target
    from launcher.distributed.tensor_parallel import shard_target
    from launcher.distributed.topology import Topology, build_groups

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    groups = build_groups(Topology(num_targets=2, num_drafters=1, tp_size=2), rank, timeout_s=60)
    if rank < 2:
        target = load_target(target_dir, layer_ids=LAYER_IDS, dtype=torch.float32)
        shard_target(target, groups.unit, torch.device("cpu"))
        torch.save(target.capture(_inputs()), Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
