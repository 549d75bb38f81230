"""Files that are there but cannot be used (truncated, corrupt, not what they should be), checkpoints
pruned under a reader, and a drafter evaluated with a target it was not trained for: each entry point
names the file or the mismatch, with no traceback and no earlier result replaced (issues 31 and 33;
docs/bad_input.md)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from dflash_core.drafter.model import DFlashDrafter
from dflash_core.files.readers import BadFileError
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.serving.export import export_drafter
from dflash_core.serving.model_card import TARGET_IDENTITY, read_card_info, target_identity
from dflash_core.target.capture import load_target
from dflash_core.target.families import drafter_config_for_target
from dflash_core.target.tiny import first_unused_token_id
from launcher import evaluate
from launcher import export as export_cli
from launcher.cli import run_main
from launcher.config import compose_config
from launcher.distributed.topology import Topology
from launcher.resolve import resolve
from launcher.run_io import checkpoint
from tests.drafters import drafter_config, save_drafter_checkpoint
from tests.targets import other_family_copy

pytestmark = pytest.mark.usefixtures("one_thread")


def truncate(path: Path) -> None:
    """What an interrupted copy leaves: the first half of the file."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.fixture(scope="module")
def fitting_drafter(tiny_target_dir):
    """A one-layer drafter built for the tiny target."""
    config = AutoConfig.from_pretrained(tiny_target_dir)
    mask_id = first_unused_token_id(AutoTokenizer.from_pretrained(tiny_target_dir), config)
    return DFlashDrafter(drafter_config_for_target(config, num_layers=1, block_size=4, mask_token_id=mask_id), seed=0)


def failure(capsys, run, name: str, args: list[str]) -> str:
    """What the user sees of a failing command: exit 1 and its error line, never a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        run_main(run, name, "", args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err, err
    return err


def evaluate_args(target, drafter, *extra) -> list[str]:
    return [f"target.path={target}", f"evaluate.drafter={drafter}", "evaluate.device=cpu", "evaluate.num_prompts=1",
            "evaluate.max_new_tokens=2", *extra]


# ----------------------------------------------------------------------------- the target's files
def test_a_truncated_target_safetensors_is_named(tmp_path, tiny_target_dir, fitting_drafter, capsys):
    """Issue 31: `SafetensorError: invalid header length`, no path."""
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    weights = target / "model.safetensors"
    truncate(weights)
    said = rf"{weights}: not a readable safetensors file: deserializing header: incomplete metadata"
    with pytest.raises(BadFileError, match=said):   # every rank, resolving its job
        resolve(compose_config([f"target.path={target}"]), Topology(1, 1), torch.device("cpu"))
    with pytest.raises(BadFileError, match=said):   # the target ranks
        load_target(target, layer_ids=[0])
    with pytest.raises(BadFileError, match=said):   # the drafter ranks (the frozen embedding and LM head)
        FrozenTargetHead.from_target_dir(target)
    export_drafter(fitting_drafter, tmp_path / "export")
    err = failure(capsys, evaluate.run, "evaluate", evaluate_args(target, tmp_path / "export"))
    assert f"BadFileError: {weights}: not a readable safetensors file" in err and "truncated or corrupt" in err


# ----------------------------------------------------------------------------- the drafter's files
def _break_weights(export: Path) -> tuple[Path, str]:
    truncate(export / "model.safetensors")
    return export, f"{export / 'model.safetensors'}: not a readable safetensors file"


def _break_config(export: Path) -> tuple[Path, str]:
    truncate(export / "config.json")
    return export, f"{export / 'config.json'}: not valid JSON"


def _drop_dflash_config(export: Path) -> tuple[Path, str]:
    config = json.loads((export / "config.json").read_text())
    del config["dflash_config"]
    (export / "config.json").write_text(json.dumps(config))
    return export, f"{export / 'config.json'}: not a DFlash export: it has no dflash_config"


def _truncated_checkpoint(export: Path) -> tuple[Path, str]:
    ckpt = save_drafter_checkpoint(export.parent / "checkpoints", evaluate.load_drafter(export), step=3)
    truncate(ckpt / "__0_0.distcp")
    return ckpt, f"{ckpt / '__0_0.distcp'}: cut short"


@pytest.mark.parametrize("breakage", [_break_weights, _break_config, _drop_dflash_config, _truncated_checkpoint])
def test_evaluate_names_the_broken_drafter_file(tmp_path, tiny_target_dir, fitting_drafter, capsys, breakage):
    """Issue 33: SafetensorError, JSONDecodeError, KeyError: 'dflash_config', PytorchStreamReader failed."""
    export_drafter(fitting_drafter, tmp_path / "export")
    drafter, said = breakage(tmp_path / "export")
    err = failure(capsys, evaluate.run, "evaluate", evaluate_args(tiny_target_dir, drafter))
    assert f"BadFileError: {said}" in err


def test_export_names_a_truncated_checkpoint_file(tmp_path, fitting_drafter, capsys):
    """Issue 33: `RuntimeError: PytorchStreamReader failed`, no path."""
    ckpt = save_drafter_checkpoint(tmp_path / "run" / "checkpoints", fitting_drafter, step=3)
    truncate(ckpt / "__0_0.distcp")
    err = failure(capsys, export_cli.run, "export", [f"export.checkpoint={ckpt}", f"export.out={tmp_path / 'out'}"])
    assert f"BadFileError: {ckpt / '__0_0.distcp'}: cut short" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("when", ["before the export", "while it starts", "while it reads"])
def test_export_of_a_checkpoint_pruned_meanwhile_says_so(tmp_path, fitting_drafter, capsys, monkeypatch, when):
    """Issue 31: `not a complete checkpoint (no meta.json)` for a checkpoint the running job pruned."""
    root = tmp_path / "run" / "checkpoints"
    ckpt = save_drafter_checkpoint(root, fitting_drafter, step=3)
    save_drafter_checkpoint(root, fitting_drafter, step=4)
    if when == "before the export":
        shutil.rmtree(ckpt)
    elif when == "while it starts":   # the job's rmtree is under way: meta.json gone, the directory not yet
        (ckpt / "meta.json").unlink()
    else:
        read = checkpoint.read_dcp_metadata

        def pruned_first(path):
            shutil.rmtree(ckpt)   # what the job's next save does to its older checkpoints
            return read(path)
        monkeypatch.setattr(checkpoint, "read_dcp_metadata", pruned_first)
    err = failure(capsys, export_cli.run, "export", [f"export.checkpoint={ckpt}", f"export.out={tmp_path / 'out'}"])
    said = {"before the export": "no such directory: ", "while it starts": "not a complete checkpoint (no meta.json): ",
            "while it reads": "was removed while being read: "}[when]
    assert said in err, err
    assert f"the job writing {root} removes its older checkpoints" in err
    assert "the newest complete one now is step_00000004" in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- drafter and target
@pytest.mark.parametrize("recorded", ["identity", "path only", "checkpoint"])
def test_evaluate_refuses_a_drafter_trained_for_another_target(tmp_path, tiny_target_dir, fitting_drafter, capsys,
                                                              recorded):
    """Issue 33: a tiny-Qwen3 export evaluated with target=tiny_llama ran without a word (tau 1.000) and
    replaced the earlier result for the right target; even evaluate.overwrite=true keeps it now."""
    if recorded == "checkpoint":   # its run's config.yaml records the target
        drafter = save_drafter_checkpoint(tmp_path / "run" / "checkpoints", fitting_drafter, step=3)
        (tmp_path / "run" / "config.yaml").write_text(f"target:\n  path: {tiny_target_dir}\n")
    else:
        drafter = tmp_path / "export"
        card = {"target": str(tiny_target_dir)}
        if recorded == "identity":
            card[TARGET_IDENTITY] = target_identity(tiny_target_dir)
        export_drafter(fitting_drafter, drafter, card=card)
    earlier = Path(str(drafter) + ".speculative.json")
    earlier.write_text('{"tau": 3.5}\n')
    other = other_family_copy(tmp_path, tiny_target_dir)
    err = failure(capsys, evaluate.run, "evaluate", evaluate_args(other, drafter, "evaluate.overwrite=true"))
    assert f"does not fit target.path='{other}': it was trained for the target {tiny_target_dir}" in err
    assert ("model_type qwen3" in err and "this one is model_type llama" in err) if recorded != "path only" else \
        f"not {other}" in err
    assert "evaluate.check_target=false" in err
    assert earlier.read_text() == '{"tau": 3.5}\n'


def test_evaluate_names_each_shape_mismatch(tmp_path, tiny_target_dir, capsys):
    """Hidden size, layers and vocabulary, before any target weight loads."""
    export_drafter(DFlashDrafter(drafter_config(), seed=0), tmp_path / "export")
    err = failure(capsys, evaluate.run, "evaluate", evaluate_args(tiny_target_dir, tmp_path / "export"))
    assert "hidden size: the drafter's 32, the target's 128" in err
    assert "layers: the drafter reads layer ids [0, 1] of a 2-layer target, this target has 4 layers" in err
    assert "vocabulary: the drafter's 50 tokens, the target's 1088" in err


def test_evaluate_keeps_earlier_results(tmp_path, tiny_target_dir, fitting_drafter, capsys):
    """An existing result file is replaced only with evaluate.overwrite=true; an export's card keeps its
    earlier acceptance length unless asked."""
    export = tmp_path / "export"
    export_drafter(fitting_drafter, export, card={"acceptance_length": 3.5})
    earlier = Path(str(export) + ".speculative.json")
    earlier.write_text('{"tau": 3.5, "target": "/t"}\n')
    err = failure(capsys, evaluate.run, "evaluate", evaluate_args(tiny_target_dir, export))
    assert f"evaluate.output='{earlier}' already exists (an earlier result: tau 3.5, target /t)" in err
    assert "evaluate.overwrite=true" in err and earlier.read_text() == '{"tau": 3.5, "target": "/t"}\n'

    elsewhere = tmp_path / "second.json"
    assert evaluate.run(evaluate_args(tiny_target_dir, export, f"evaluate.output={elsewhere}")) == 0
    assert json.loads(elsewhere.read_text())["prompts"] == 1
    assert read_card_info(export)["acceptance_length"] == 3.5
    assert "keeps its earlier acceptance length 3.500" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the served engine
def _missing_weights(export: Path) -> tuple[Path, str]:
    (export / "model.safetensors").unlink()
    return export, f"evaluate.drafter='{export}': no model.safetensors in it"


def served_args(tmp_path: Path, target, drafter, *extra) -> list[str]:
    """evaluate.engine=vllm with a `vllm serve` that leaves tmp_path/server-started behind: the refusals
    below come before any server starts (a real start takes 35-60 s on CPU)."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {tmp_path / 'server-started'}\nexit 1\n")
    python.chmod(0o755)
    return evaluate_args(target, drafter, "evaluate.engine=vllm", f"evaluate.vllm_python={python}", *extra)


@pytest.mark.parametrize("breakage", [_break_weights, _break_config, _drop_dflash_config, _missing_weights])
def test_served_evaluation_names_the_broken_drafter_file_before_any_server_starts(tmp_path, tiny_target_dir,
                                                                                 fitting_drafter, capsys, breakage):
    """Issue 46: the root cause sat beyond the 40-line log tail, after 35-59 s of server start."""
    export_drafter(fitting_drafter, tmp_path / "export")
    drafter, said = breakage(tmp_path / "export")
    err = failure(capsys, evaluate.run, "evaluate", served_args(tmp_path, tiny_target_dir, drafter))
    assert said in err
    assert not (tmp_path / "server-started").exists()


def test_served_evaluation_refuses_a_drafter_for_another_target_before_any_server_starts(tmp_path, tiny_target_dir,
                                                                                        fitting_drafter, capsys):
    """Issue 46: exit 0 after 117 s, tau 1.000, "lossless yes", where the HF engine refused in 6 s."""
    export_drafter(fitting_drafter, tmp_path / "export", card={"target": str(tiny_target_dir),
                                                               TARGET_IDENTITY: target_identity(tiny_target_dir)})
    other = other_family_copy(tmp_path, tiny_target_dir)
    err = failure(capsys, evaluate.run, "evaluate", served_args(tmp_path, other, tmp_path / "export"))
    assert f"does not fit target.path='{other}': it was trained for the target {tiny_target_dir}" in err
    export_drafter(DFlashDrafter(drafter_config(), seed=0), tmp_path / "small")
    err = failure(capsys, evaluate.run, "evaluate", served_args(tmp_path, tiny_target_dir, tmp_path / "small"))
    assert "hidden size: the drafter's 32, the target's 128" in err
    assert not (tmp_path / "server-started").exists()
