"""Every supported target family on a tiny random model of its own: truncated loading, capture
equal to output_hidden_states, packed rows equal to documents forwarded alone, the drafter
config derived from the target, and 2-rank tensor-parallel units equal to the unsharded targets
(every family's and the embedded tiny target, in one job).

This file is also the worker script of the tensor-parallel test (`__main__` below).
"""
import contextlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash_core.drafter.model import default_target_layer_ids
from dflash_core.target.capture import load_target
from dflash_core.target.families import (
    FAMILIES,
    TargetError,
    drafter_config_for_target,
    family_of,
    num_layers_of,
    packing_supported,
    text_config,
)
from dflash_core.target.tiny import TINY_SHAPES, build_tiny_target
from launcher.resolve import embedded_target_path
from tests.launching import torchrun

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = {"rtol": 0, "atol": 1e-5}  # fp32
LAYER_IDS = [0, 2]
# Row 0: three documents filling the row; row 1: one document, then padding as its own segment.
DOCUMENTS = [[9, 26, 5], [17, 23]]  # gpt_oss's sliding window is 8: documents longer and shorter
SEQ_LEN = 40
pytestmark = pytest.mark.usefixtures("one_thread")
BACKENDS = [(family, backend) for family in FAMILIES for backend in FAMILIES[family].attention]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """One random tiny target per family (about a second each, none pretrained)."""
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny_target(root / family, family=family, pretrain_steps=0) for family in FAMILIES}


def _input_ids(seed=0):
    return torch.randint(0, 1000, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _packed_position_ids():
    return torch.stack([torch.cat([torch.arange(length) for length in row]) for row in DOCUMENTS])


def _spans():
    for row, lengths in enumerate(DOCUMENTS):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        yield from ((row, start, start + length) for start, length in zip(starts, lengths))


def test_every_family_has_a_tiny_build_and_a_conf_option():
    assert set(TINY_SHAPES) == set(FAMILIES)
    options = {path.stem for path in (REPO / "conf" / "target").glob("tiny_*.yaml")}
    assert options == {f"tiny_{family}" for family in FAMILIES if family != "qwen3"}  # qwen3 is target=tiny


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_hidden_states(family_dirs, family):
    path = family_dirs[family]
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert family_of(full.config).name == family
    with torch.no_grad():
        hidden_states = full(_input_ids(), output_hidden_states=True).hidden_states
    for layer_ids in (LAYER_IDS, [3]):  # [3]: the last layer, reported after the final norm
        target = load_target(path, layer_ids=layer_ids, dtype=torch.float32)
        expected = torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
        torch.testing.assert_close(target.capture(_input_ids()), expected, **TOLERANCE)
        assert target.num_kept_layers == target.decoder.config.num_hidden_layers == max(layer_ids) + 1
        assert target.num_layers == 4


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_truncation_cuts_the_per_layer_lists(family_dirs, family):
    target = load_target(family_dirs[family], layer_ids=[1], dtype=torch.float32)
    assert len(target.decoder.config.layer_types) == 2 == len(target.decoder.layers)
    assert len(target.config.layer_types) == 4  # the full target's config is left alone


@pytest.mark.parametrize("family", [name for name in FAMILIES if FAMILIES[name].tp_replicated])
def test_capture_runs_no_lm_head_and_no_router_loss(family_dirs, family, monkeypatch):
    target = load_target(family_dirs[family], layer_ids=LAYER_IDS, dtype=torch.float32)
    modeling = sys.modules[type(target.decoder).__module__]

    def forbidden(*args, **kwargs):
        raise AssertionError("capture computed the router's auxiliary loss")
    monkeypatch.setattr(modeling, "load_balancing_loss_func", forbidden)
    assert target.decoder.config.output_router_logits is False
    assert not any("lm_head" in name for name, _ in target.decoder.named_modules())
    assert target.capture(_input_ids()).shape == (2, SEQ_LEN, 2 * target.hidden_size)


@pytest.mark.parametrize("family, backend", BACKENDS)
def test_packed_rows_equal_documents_alone(family_dirs, family, backend):
    target = load_target(family_dirs[family], layer_ids=LAYER_IDS, dtype=torch.float32, attn_implementation=backend)
    assert target.packing[0], target.packing[1]
    input_ids = _input_ids(1)
    packed = target.capture(input_ids, _packed_position_ids())
    unpacked = target.capture(input_ids)
    leaked = 0.0
    for row, start, end in _spans():
        alone = target.capture(input_ids[row:row + 1, start:end])[0]
        torch.testing.assert_close(packed[row, start:end], alone, **TOLERANCE)
        leaked = max(leaked, float((unpacked[row, start:end] - alone).abs().max()))
    assert leaked > 1e-3  # without position ids the documents do see each other: the test can fail


def test_linear_attention_needs_its_state_restarted(family_dirs, monkeypatch):
    """Block-diagonal attention alone is not enough for Qwen3.5: its recurrent layers must restart."""
    target = load_target(family_dirs["qwen3_5"], layer_ids=LAYER_IDS, dtype=torch.float32)
    input_ids, position_ids = _input_ids(1), _packed_position_ids()
    exact = target.capture(input_ids, position_ids)
    monkeypatch.setattr(target._regrouping, "packed", lambda documents: contextlib.nullcontext())
    assert float((target.capture(input_ids, position_ids) - exact).abs().max()) > 1e-3


def test_bad_position_ids_are_clear_errors(family_dirs):
    target = load_target(family_dirs["qwen3_5"], layer_ids=[0], dtype=torch.float32)
    input_ids, position_ids = _input_ids(), _packed_position_ids()
    with pytest.raises(TargetError, match=r"position_ids shape \(2, 39\) differs from input_ids shape \(2, 40\)"):
        target.capture(input_ids, position_ids[:, 1:])
    shifted = position_ids.clone()
    shifted[0, 9:35] += 5
    with pytest.raises(TargetError, match="row 0, token 9 starts a document at position 5"):
        target.capture(input_ids, shifted)


def test_packing_support_is_decided_per_family_and_backend():
    from transformers import GPT2Config, GptOssConfig, Qwen3_5TextConfig
    assert packing_supported(Qwen3_5TextConfig())[0]
    assert "linear_attn state restarted" in packing_supported(Qwen3_5TextConfig())[1]
    assert packing_supported(GptOssConfig())[0]  # eager, its only verified backend
    supported, reason = packing_supported(Qwen3_5TextConfig(), "flash_attention_2")
    assert not supported and "'flash_attention_2'" in reason
    supported, reason = packing_supported(GPT2Config())
    assert not supported and "unsupported target model_type 'gpt2'" in reason


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_config_from_each_family(family_dirs, family):
    from transformers import AutoConfig

    from dflash_core.target.tiny import first_unused_token_id
    path = family_dirs[family]
    config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    mask_token_id = first_unused_token_id(tokenizer, config)
    drafter = drafter_config_for_target(config, num_layers=2, block_size=8, mask_token_id=mask_token_id)
    shape = TINY_SHAPES[family]
    assert drafter.hidden_size == shape["hidden_size"] and drafter.head_dim == shape["head_dim"]
    assert drafter.target_layer_ids == [0, 2] and drafter.num_target_layers == 4
    assert mask_token_id == len(tokenizer) < drafter.vocab_size
    assert drafter.rope_theta == config.rope_parameters["rope_theta"]
    dense = FAMILIES[family].dense_intermediate_key
    assert drafter.intermediate_size == (shape["intermediate_size"] if dense else 3 * shape["hidden_size"])
    with pytest.raises(ValueError, match="include the target's last layer 3: the target has 4 layers"):
        drafter_config_for_target(config, num_layers=2, block_size=8, mask_token_id=mask_token_id,
                                  target_layer_ids=[0, 3])


def test_default_layer_ids_never_take_the_last_layer():
    for num_target_layers in range(2, 81):
        for num_layers in range(1, min(num_target_layers - 1, 8) + 1):
            ids = default_target_layer_ids(num_target_layers, num_layers)
            assert len(set(ids)) == num_layers and 0 <= min(ids) and max(ids) <= num_target_layers - 2, ids
    assert default_target_layer_ids(4, 2) == [0, 2]
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # z-lab's Qwen3.5-9B drafter
    with pytest.raises(ValueError, match="a 2-layer target has only 1 layers before its last one"):
        default_target_layer_ids(2, 2)


def test_composite_qwen3_5_checkpoint_loads_its_text_decoder(tmp_path):
    """Real Qwen3.5/3.6 checkpoints are multimodal: text_config + vision_config, model.language_model.*"""
    from transformers import AutoConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from dflash_core.loss.frozen_head import FrozenTargetHead
    text = {key: value for key, value in TINY_SHAPES["qwen3_5"].items() if key != "model_type"}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128}
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=dict(text, vocab_size=1024),
                                                          vision_config=vision)).eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        hidden_states = model(input_ids=_input_ids(), output_hidden_states=True).hidden_states
    target = load_target(tmp_path, layer_ids=LAYER_IDS, dtype=torch.float32)
    expected = torch.cat([hidden_states[i + 1] for i in LAYER_IDS], dim=-1)
    torch.testing.assert_close(target.capture(_input_ids()), expected, **TOLERANCE)
    assert target.num_kept_layers == 3 and target.num_layers == 4 and target.hidden_size == 128
    head = FrozenTargetHead.from_target_dir(tmp_path, dtype=torch.float32)
    assert torch.equal(head.embed_weight, model.model.language_model.embed_tokens.weight)
    drafter = drafter_config_for_target(AutoConfig.from_pretrained(tmp_path), num_layers=2, block_size=8,
                                        mask_token_id=1000)
    assert (drafter.hidden_size, drafter.vocab_size, drafter.num_target_layers) == (128, 1024, 4)


@pytest.mark.parametrize("shape, family, layer_ids", [("qwen3.5-35b-a3b", "qwen3_5_moe", [1, 10, 19, 28, 37]),
                                                     ("llama3-8b", "llama", [1, 8, 15, 22, 29])])
def test_real_shapes_build_their_family(shape, family, layer_ids):
    from dflash_core.target.capture import random_target
    from dflash_core.target.shapes import config_from_shape
    config = config_from_shape(shape)
    assert family_of(config).name == family
    drafter = drafter_config_for_target(config, num_layers=5, block_size=16, mask_token_id=config.vocab_size - 1)
    assert drafter.target_layer_ids == layer_ids
    target = random_target(config, layer_ids=[1], device="meta", dtype=torch.bfloat16)  # shapes only, no memory
    assert target.num_kept_layers == 2 and target.num_layers == config.num_hidden_layers
    with pytest.raises(KeyError, match="unknown target shape 'qwen9'"):
        config_from_shape("qwen9")


def test_unsupported_family_is_named(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(TargetError, match="unsupported target model_type 'gpt2'.*qwen3_5_moe"):
        load_target(tmp_path, layer_ids=[0], dtype=torch.float32)


# ----------------------------------------------------------------------------- launches
@pytest.mark.multiproc
@pytest.mark.parametrize("family", [family for family in FAMILIES if family != "qwen3"])  # qwen3: test_launch
def test_twenty_steps_train_on_each_family(tmp_path, family):
    """`target=tiny_<family>` builds its target on first use and the real launcher trains on it
    (one drafter: what depends on the family is the target's side; test_launch trains two)."""

    # Built at its own path only (launcher.resolve.embedded_target_path), once: later runs reuse it.
    run_dir, target_dir = tmp_path / "run", REPO / embedded_target_path(family)
    proc = torchrun(2, "topology=t1d1", f"target=tiny_{family}", "train.steps=20",
                    "train.eval_every=0", "optim.lr=3e-3", f"run.dir={run_dir}", f"data.cache_dir={tmp_path / 'tok'}",
                    "run.progress=false")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((target_dir / "tiny_build.json").read_text())["family"] == family
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20
    assert math.isfinite(summary["first_loss"]) and summary["last_loss"] < summary["first_loss"], summary
    # The export serving engines read: the target's layer count and vocabulary, ids short of its last layer.
    target_config = AutoConfig.from_pretrained(target_dir)
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    num_layers, vocab = num_layers_of(target_config), text_config(target_config).vocab_size
    assert exported["num_target_layers"] == num_layers and exported["vocab_size"] == vocab
    assert max(exported["dflash_config"]["target_layer_ids"]) < num_layers - 1


# ----------------------------------------------------------------------------- tensor parallel
TINY_LAYER_IDS = [0, 2, 3]  # 3 is the last layer: captured after the final norm, which stays replicated
TINY_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}  # fp32; measured max |diff| ~2e-6 on values up to ~4


@pytest.mark.multiproc
def test_tensor_parallel_units_equal_the_unsharded_targets(tmp_path, tiny_target_dir, family_dirs):
    """One 3-rank gloo job: ranks 0-1 form a unit (rank 2 stays out of the mesh, like a drafter) and
    shard the embedded tiny target, then every family in turn; qwen3_5 also captures a packed row."""
    proc = torchrun(3, __file__, str(tmp_path), str(tiny_target_dir),
                    *(f"{family}={path}" for family, path in family_dirs.items()), module=None)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not list(tmp_path.glob("*.rank2.pt"))

    reference = load_target(tiny_target_dir, layer_ids=TINY_LAYER_IDS, dtype=torch.float32).capture(_input_ids())
    rank0, rank1 = (torch.load(tmp_path / f"tiny.rank{rank}.pt") for rank in (0, 1))
    assert rank0.shape == reference.shape == (2, SEQ_LEN, 128 * len(TINY_LAYER_IDS))
    torch.testing.assert_close(rank0, reference, **TINY_TOLERANCE)
    assert torch.equal(rank0, rank1)  # the all-reduce leaves every rank of the unit the same replica
    for family, path in family_dirs.items():
        reference = load_target(path, layer_ids=LAYER_IDS, dtype=torch.float32)
        rank0, rank1 = (torch.load(tmp_path / f"{family}.rank{rank}.pt") for rank in (0, 1))
        torch.testing.assert_close(rank0["plain"], reference.capture(_input_ids()), **TOLERANCE)
        torch.testing.assert_close(rank0["packed"], reference.capture(_input_ids(1), _packed_position_ids()),
                                   **TOLERANCE)
        assert torch.equal(rank0["plain"], rank1["plain"])
    assert "stay whole on every rank" in proc.stderr and "mlp.experts" in proc.stderr


def _tensor_parallel_worker(out_dir: str, tiny_dir: str, *family_paths: str) -> None:
    import logging
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.distributed.tensor_parallel import shard_target
    from launcher.distributed.topology import Topology, build_groups
    logging.basicConfig(level=logging.INFO)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    groups = build_groups(Topology(num_targets=2, num_drafters=1, tp_size=2), rank, timeout_s=120)
    if rank < 2:
        target = load_target(tiny_dir, layer_ids=TINY_LAYER_IDS, dtype=torch.float32)
        shard_target(target, groups.unit, torch.device("cpu"))
        torch.save(target.capture(_input_ids()), Path(out_dir) / f"tiny.rank{rank}.pt")
        for entry in family_paths:
            family, path = entry.split("=", 1)
            target = load_target(path, layer_ids=LAYER_IDS, dtype=torch.float32)
            shard_target(target, groups.unit, torch.device("cpu"))
            captures = {"plain": target.capture(_input_ids()),
                        "packed": target.capture(_input_ids(1), _packed_position_ids())}
            torch.save(captures, Path(out_dir) / f"{family}.rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _tensor_parallel_worker(*sys.argv[1:])
