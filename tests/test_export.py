import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash_core.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_core.drafter.model import DFlashDrafter
from dflash_core.serving import export as export_module
from dflash_core.serving.export import ExportExistsError, export_drafter, load_exported
from dflash_core.serving.finite import NonFiniteError
from launcher import export as export_cli
from launcher.cli import run_main
from launcher.evaluate import load_drafter
from tests.drafters import drafter_config, save_drafter_checkpoint


def drafter_to_export():
    cfg = drafter_config(target_layer_ids=[1, 3], num_target_layers=4,
                         layer_types=["full_attention", "sliding_attention"], sliding_window=6)
    return DFlashDrafter(cfg, seed=0)


def drafter_inputs():
    """context_features, block_embeds, anchors, keep for drafter_to_export()."""
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(1, 12, 64, generator=gen), torch.randn(1, 8, 32, generator=gen),
            torch.tensor([[2, 9]]), torch.tensor([[True, True]]))


def drafter_output(drafter):
    with torch.no_grad():
        return drafter(*drafter_inputs(), backend="sdpa")


def test_round_trip_gives_identical_outputs(tmp_path):
    drafter = drafter_to_export()
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    loaded = load_exported(tmp_path / "out")
    assert loaded.config == drafter.config
    assert torch.equal(drafter_output(loaded), drafter_output(drafter))


def test_bf16_export_holds_bf16_contiguous_tensors(tmp_path):
    drafter = drafter_to_export()
    export_drafter(drafter, tmp_path / "out")
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert set(tensors) == set(drafter.state_dict())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    loaded = load_exported(tmp_path / "out")
    torch.testing.assert_close(drafter_output(loaded), drafter_output(drafter), rtol=0.05, atol=0.05)


def test_config_carries_the_serving_fields(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": 49, "target_layer_ids": [1, 3],
                                       "block_size": 4}
    assert config["block_size"] == 4 and config["num_target_layers"] == 4
    for field in ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta",
                  "max_position_embeddings", "vocab_size", "attention_bias", "layer_types",
                  "sliding_window"]:
        assert field in config, field
    hf = AutoConfig.from_pretrained(tmp_path / "out")  # what the serving stacks parse
    assert hf.sliding_window == 6 and hf.layer_types == ["full_attention", "sliding_attention"]
    assert hf.rope_parameters["rope_theta"] == config["rope_theta"]


def dflash2_to_export():
    """drafter_to_export()'s shape as a DFlash 2, every new part moved off its identity start."""
    drafter = DFlash2Drafter(DFlash2Config(**dataclasses.asdict(drafter_to_export().config), conv_group_size=8,
                                           conv_kernel_size=2, selector_rank=6, selector_top_k=5,
                                           output_multiplier=0.5, final_logit_softcapping=20.0), seed=0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.normal_(0.0, 0.3)
    return drafter


def test_dflash2_round_trip_in_vllms_layout(tmp_path):
    drafter = dflash2_to_export()
    export_drafter(drafter, tmp_path / "out", dtype=torch.float32)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}
    assert config["dflash_config"] == {"mask_token_id": 49, "target_layer_ids": [1, 3], "block_size": 4,
                                       "conv_group_size": 8, "conv_kernel_size": 2, "selector_rank": 6,
                                       "selector_top_k": 5, "output_multiplier": 0.5,
                                       "final_logit_softcapping": 20.0}
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    dflash_keys = set(export_module.expected_keys(drafter_to_export().config))
    assert set(tensors) - dflash_keys == {
        *(f"layers.{i}.{conv}.{name}" for i in range(2) for conv in ("attention_conv", "mlp_conv")
          for name in ("base_kernel", "kernel_projection.weight")),
        "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight"}
    assert tensors["layers.0.attention_conv.base_kernel"].shape == (2, 2, 32)
    assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 4, 32)
    assert tensors["candidate_selector.successor_codebook"].shape == (50, 6)
    assert tensors["candidate_selector.hidden_projection.weight"].shape == (6, 32)
    loaded = load_exported(tmp_path / "out")
    assert type(loaded) is DFlash2Drafter and loaded.config == drafter.config
    assert torch.equal(drafter_output(loaded), drafter_output(drafter))


def test_a_dflash2_checkpoint_is_exported_and_evaluated_as_a_dflash2(tmp_path):
    """launcher.export and launcher.evaluate read a checkpoint's drafter kind from the config it records."""
    drafter = dflash2_to_export()
    ckpt = save_drafter_checkpoint(tmp_path / "checkpoints", drafter, 3, keep=1)
    export_cli.export_checkpoint(ckpt, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    for loaded in (load_exported(tmp_path / "out"), load_drafter(ckpt)):
        assert type(loaded) is DFlash2Drafter and loaded.config == drafter.config
    exported = load_exported(tmp_path / "out").state_dict()
    for name, value in drafter.state_dict().items():   # the export's bf16 of every weight
        assert torch.equal(exported[name], value.to(torch.bfloat16).float()), name


def test_an_uncapped_dflash2_export_leaves_the_cap_out(tmp_path):
    drafter = dflash2_to_export()
    drafter.config.final_logit_softcapping = None
    export_drafter(drafter, tmp_path / "out")
    assert "final_logit_softcapping" not in json.loads((tmp_path / "out" / "config.json").read_text())["dflash_config"]
    assert load_exported(tmp_path / "out").config.final_logit_softcapping is None


def rewrite_weights(path, edit):
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)


def test_loader_rejects_an_unexpected_key(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    rewrite_weights(tmp_path / "out",
                    lambda t: t.update({"model.embed_tokens.weight": torch.zeros(50, 32)}))
    with pytest.raises(KeyError, match=r"unexpected keys \['model.embed_tokens.weight'\]"):
        load_exported(tmp_path / "out")


def test_loader_rejects_a_missing_key(tmp_path):
    export_drafter(drafter_to_export(), tmp_path / "out")
    rewrite_weights(tmp_path / "out", lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(KeyError, match=r"missing keys \['layers.1.self_attn.k_norm.weight'\]"):
        load_exported(tmp_path / "out")


# ----------------------------------------------------------------------------- outputs never destroy data
def snapshot(path):
    """Every file under path (or path itself) with its bytes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path.parent)): p.read_bytes() for p in files}


def run_with_checkpoint(tmp_path):
    run = tmp_path / "run"
    drafter = drafter_to_export()
    ckpt = save_drafter_checkpoint(run / "checkpoints", drafter, 3)
    (run / "config.yaml").write_text("target:\n  path: /models/tiny\ndata:\n  paths: [a.jsonl]\n")
    (run / "metrics.jsonl").write_text('{"step": 3}\n')
    return run, ckpt


def test_cli_export_onto_the_run_dir_is_refused_and_the_run_dir_kept(tmp_path, capsys):
    """Issue 17: `launcher.export <ckpt> --out <run dir>` deleted the whole run dir (any setting)."""
    run, ckpt = run_with_checkpoint(tmp_path)
    before = snapshot(run)
    for extra in ([], ["export.overwrite=true"]):
        with pytest.raises(SystemExit) as exit_info:
            run_main(export_cli.run, "export", "", [f"export.checkpoint={ckpt}", f"export.out={run}", *extra])
        assert exit_info.value.code == 1
        assert f"{run} exists and is not a DFlash export (it holds checkpoints" in capsys.readouterr().err
    assert snapshot(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temporaries left


def test_cli_export_replaces_its_own_export_only_with_overwrite(tmp_path, capsys):
    _, ckpt = run_with_checkpoint(tmp_path)
    out = tmp_path / "exported"
    args = [f"export.checkpoint={ckpt}", f"export.out={out}"]
    assert export_cli.run(args) == 0
    first = snapshot(out)
    with pytest.raises(SystemExit):
        run_main(export_cli.run, "export", "", args)
    assert "holds a previous DFlash export" in capsys.readouterr().err and snapshot(out) == first
    export_cli.run(args + ["export.overwrite=true"])
    assert "export.overwrite=true" in (out / "README.md").read_text()  # the card records the command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]


@pytest.mark.parametrize("kind", ["file", "model dir", "export plus a foreign file", "symlink to an export"])
def test_export_never_replaces_what_is_not_an_export(tmp_path, kind):
    """Issue 17: an existing file or directory at the output path was deleted."""
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("precious")
    elif kind == "model dir":
        out.mkdir()
        (out / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
        (out / "model.safetensors").write_bytes(b"weights")
    else:
        export_drafter(drafter_to_export(), tmp_path / "real")
        if kind == "export plus a foreign file":
            (tmp_path / "real" / "notes.txt").write_text("mine")
        out.symlink_to(tmp_path / "real")
    before = {p.name: snapshot(p) for p in tmp_path.iterdir()}
    with pytest.raises(ExportExistsError, match=rf"{out} exists and is not a DFlash export"):
        export_drafter(drafter_to_export(), out, overwrite=True)
    assert {p.name: snapshot(p) for p in tmp_path.iterdir()} == before


def test_previous_export_is_replaced_only_when_asked(tmp_path):
    """The end-of-run export (run.dir/export) is written again on resume, with overwrite=True."""
    first, second = drafter_to_export(), DFlashDrafter(drafter_to_export().config, seed=7)
    export_drafter(first, tmp_path / "out", dtype=torch.float32)
    with pytest.raises(ExportExistsError, match="holds a previous DFlash export; to replace it"):
        export_drafter(second, tmp_path / "out", dtype=torch.float32)
    assert torch.equal(load_exported(tmp_path / "out").fc.weight, first.fc.weight)
    export_drafter(second, tmp_path / "out", dtype=torch.float32, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert torch.equal(load_exported(tmp_path / "out").fc.weight, second.fc.weight)


def test_an_empty_directory_is_filled(tmp_path):
    (tmp_path / "out").mkdir()
    export_drafter(drafter_to_export(), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_failed_write_keeps_the_previous_export(tmp_path, monkeypatch):
    export_drafter(drafter_to_export(), tmp_path / "out")
    before = snapshot(tmp_path / "out")

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_drafter(DFlashDrafter(drafter_to_export().config, seed=7), tmp_path / "out", overwrite=True)
    assert snapshot(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ----------------------------------------------------------------------------- non-finite weights
def diverged_drafter():
    drafter = drafter_to_export()
    with torch.no_grad():
        drafter.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    return drafter


def test_export_refuses_non_finite_weights(tmp_path):
    """Issue 17: optim.lr=1e4 gave an all-NaN export."""
    with pytest.raises(NonFiniteError, match=r"parameter 'layers.1.mlp.up_proj.weight' holds 1 non-finite"):
        export_drafter(diverged_drafter(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_evaluate_refuses_non_finite_weights(tmp_path):
    """Issue 17: launcher.evaluate reported a NaN drafter as tau 1.0, "lossless"."""
    export_drafter(drafter_to_export(), tmp_path / "export")
    rewrite_weights(tmp_path / "export", lambda t: t["norm.weight"].fill_(float("inf")))
    drafter = diverged_drafter()
    ckpt = save_drafter_checkpoint(tmp_path / "checkpoints", drafter, 1, keep=1)
    for path, name in ((tmp_path / "export", "norm.weight"), (ckpt, "layers.1.mlp.up_proj.weight")):
        with pytest.raises(NonFiniteError, match=rf"evaluate.drafter='{path}': parameter '{name}'"):
            load_drafter(path)
