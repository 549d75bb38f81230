"""Tensor-parallel target units: plan mapping, validation, and a t2d1 launch that trains.

Sharded == unsharded captures, for the embedded tiny target and every family, are one torchrun
job in test_families.py.
"""
import pytest

from tests.launching import torchrun


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

    from launcher.distributed.tensor_parallel import (
        TensorParallelError,
        layer_plan,
        missing_from_every_layer,
        plan_strings,
    )
    gpt_oss = layer_plan(GptOssConfig())  # transformers has no layer plan: the family's own, attention only
    assert set(gpt_oss) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert isinstance(gpt_oss["self_attn.o_proj"], RowwiseParallel)
    # Experts stay whole, attention is split. transformers < 5.25 lists the experts in the layer plan (we
    # drop them); later versions list them in base_model_ep_plan only, and the dense MLP of mlp_only_layers.
    sharded, replicated = plan_strings(Qwen3MoeConfig())
    listed = {key.removeprefix("layers.*.") for key in Qwen3MoeConfig().base_model_tp_plan
              if key.startswith("layers.*.mlp.experts")}
    assert set(replicated) == listed
    assert not any(key.startswith("mlp.experts") for key in sharded)
    assert isinstance(layer_plan(Qwen3MoeConfig())["self_attn.q_proj"], ColwiseParallel)
    # A stack of sparse layers only has no dense MLP: those entries are not a mismatch; others are.
    unused = {"mlp.gate_proj", "mlp.down_proj", "self_attn.q_proj"}
    assert missing_from_every_layer(unused, ("mlp.experts",)) == {"self_attn.q_proj"}
    assert missing_from_every_layer(unused, ()) == unused
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
