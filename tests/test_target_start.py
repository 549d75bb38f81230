"""drafter.init=target: the drafter's layers start as copies of the target's last layers, its context as the
first copied layer reads it; a target whose layers do not fit stops the run at start-up naming the tensors."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_core.drafter.from_target import copied_layers, target_start
from launcher.config import ConfigError, compose_config
from launcher.distributed.topology import Topology
from launcher.resolve import resolve
from launcher.roles.trainer import DrafterTrainer
from tests.launching import tiny_overrides, torchrun

pytestmark = pytest.mark.usefixtures("one_thread")


def _job(target, *overrides):
    cfg = compose_config([f"target.path={target}", "target.build_tiny=false", "drafter=tiny", "run.device=cpu",
                          "drafter.init=target", *overrides])
    return resolve(cfg, Topology(num_targets=0, num_drafters=1), torch.device("cpu"))


def test_the_drafter_starts_as_the_targets_last_layers(tiny_target_dir, world):
    from transformers import AutoModelForCausalLM
    layers = json.loads((tiny_target_dir / "config.json").read_text())["num_hidden_layers"]
    # The layer before the first copied one among those captured: the context is then that layer's very input.
    job = _job(tiny_target_dir, f"drafter.target_layer_ids=[0,{layers - 3}]")
    dcfg = job.drafter
    assert job.start_from_target and copied_layers(dcfg) == [layers - 2, layers - 1]
    trainer = DrafterTrainer(job, world)
    assert trainer.start_from_target(tiny_target_dir) == copied_layers(dcfg)
    drafter, theirs = trainer.drafter, load_file(tiny_target_dir / "model.safetensors")
    for i, layer in enumerate(copied_layers(dcfg)):
        for name, value in drafter.layers[i].state_dict().items():
            assert torch.equal(value, theirs[f"model.layers.{layer}.{name}"].float()), f"layers.{i}.{name}"
    assert torch.equal(drafter.norm.weight, theirs["model.norm.weight"].float())

    # The context's keys are the first copied layer's own keys for the same tokens: fc passes the captured
    # feature at that layer's input through and hidden_norm is that layer's input norm.
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    seen = {}
    first = target.model.layers[copied_layers(dcfg)[0]].self_attn
    first.k_norm.register_forward_hook(lambda module, args, out: seen.setdefault("keys", out))
    ids = torch.randint(0, dcfg.mask_token_id, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in dcfg.target_layer_ids], dim=-1)
        attn = drafter.layers[0].self_attn
        keys = attn.k_norm(attn._heads(attn.k_proj(drafter.context(features)), attn.num_kv_heads))
    # Both in fp32 through the same products and norms: only the norms' rounding order differs (~1e-7);
    # a wrong tensor in the chain moves the keys by O(1).
    torch.testing.assert_close(keys, seen["keys"].transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_norms_the_target_lacks_start_at_one(tiny_target_dir, tmp_path):
    """A Llama-type target has no per-head query and key norms: the drafter's start at 1."""
    target = tmp_path / "no-qk-norm"
    shutil.copytree(tiny_target_dir, target)
    weights = {name: value for name, value in load_file(target / "model.safetensors").items()
               if not name.endswith(("q_norm.weight", "k_norm.weight"))}
    save_file(weights, target / "model.safetensors")
    dcfg = _job(target).drafter
    start = target_start(dcfg, target, ["layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight",
                                        "layers.1.mlp.down_proj.weight"])
    assert torch.equal(start["layers.0.self_attn.q_norm.weight"], torch.ones(dcfg.head_dim))
    assert torch.equal(start["layers.1.self_attn.k_norm.weight"], torch.ones(dcfg.head_dim))
    assert torch.equal(start["layers.1.mlp.down_proj.weight"],
                       weights[f"model.layers.{copied_layers(dcfg)[1]}.mlp.down_proj.weight"].float())


@pytest.mark.parametrize("change, said", [
    ("drafter.intermediate_size=48", r"drafter\.init=target: .*differ from the drafter's in shape: "
                                     r"model\.layers\.\d+\.mlp\.gate_proj\.weight \[\d+, \d+\] for "
                                     r"layers\.0\.mlp\.gate_proj\.weight \[48, \d+\].*set drafter\.init=random"),
    ("drafter.num_layers=5", r"drafter\.init=target: .*the drafter's 5 layers outnumber the target's 4"),
    ("target.random_weights=true", r"drafter\.init=target copies the target's trained layers, but "
                                   r"target\.random_weights=true"),
])
def test_a_target_the_drafter_cannot_start_from_is_named(tiny_target_dir, change, said):
    with pytest.raises(ConfigError, match=said):
        _job(tiny_target_dir, change, "drafter.target_layer_ids=[0,1]")


def test_a_target_without_its_layers_is_named(tiny_target_dir, tmp_path):
    target = tmp_path / "no-mlp"
    shutil.copytree(tiny_target_dir, target)
    save_file({name: value for name, value in load_file(target / "model.safetensors").items()
               if ".mlp." not in name}, target / "model.safetensors")
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ConfigError, match=rf"drafter\.init=target: .*the target has no model\.layers\.{layers - 2}"
                                          r"\.mlp\.\w+\.weight.*not the Llama/Qwen decoder layers"):
        _job(target)


@pytest.mark.multiproc
def test_a_launched_run_starts_from_the_target_and_says_so(tiny_target_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(2, *tiny_overrides(tmp_path, tiny_target_dir), "drafter=tiny", "topology=t1d1",
                    "train.eval_every=0", f"run.dir={run_dir}", "drafter.init=target", "train.steps=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    layers = json.loads((tiny_target_dir / "config.json").read_text())["num_hidden_layers"]
    copied = [layers - 2, layers - 1]
    assert f"drafter layers from the target's layers {copied} (drafter.init=target)" in \
        (run_dir / "logs" / "drafter1.log").read_text()
    assert json.loads((run_dir / "provenance.json").read_text())["init_from"] == {"target_layers": copied}
    assert f"| Initial weights (drafter.init_from, drafter.init) | the target's layers {copied[0]}, {copied[1]} " \
           f"(drafter.init=target) |" in (run_dir / "export" / "README.md").read_text()
