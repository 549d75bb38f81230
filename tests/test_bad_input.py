"""Bad input gets a clear error naming the bad value (docs/bad_input.md lists these cases)."""
import json
import shutil

import pytest
import torch
from hydra.errors import ConfigCompositionException
from transformers import AutoTokenizer

import dflash_core.target.tiny as tiny
from dflash_core.data import DataError, load_samples
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.target.capture import TargetError, load_target
from launcher import prepare
from launcher.config import ConfigError, compose_config, config_hash
from launcher.distributed.topology import Topology, parse_topology
from launcher.resolve import check_combinations, dataset_paths, ensure_embedded_target, resolve, target_dir
from launcher.roles.target import build_sources
from launcher.run_io.rundir import prepare_run_dir


def _cfg(tiny_target_dir, tmp_path, *overrides):
    return compose_config([f"target.path={tiny_target_dir}", f"data.cache_dir={tmp_path / 'tok'}", *overrides])


def _job(tiny_target_dir, tmp_path, *overrides):
    """The config resolved for one CPU drafter rank, as every process resolves it."""
    return resolve(_cfg(tiny_target_dir, tmp_path, *overrides), Topology(1, 1), torch.device("cpu"))


def test_missing_target_dir(tmp_path):
    cfg = compose_config([f"target.path={tmp_path / 'nope'}", "target.build_tiny=false"])
    with pytest.raises(ConfigError, match=r"target.path=.*nope.*no such directory"):
        target_dir(cfg)


def test_a_misspelt_target_path_is_refused_never_given_the_tiny_target(tmp_path, monkeypatch):
    """target.path without target=: the default target=tiny builds its embedded target only at its own path."""
    built = []
    monkeypatch.setattr(tiny, "build_tiny_target", lambda path, **_: built.append(str(path)))
    missing = tmp_path / "Qwen3-8b"
    with pytest.raises(ConfigError, match=r"target.path=.*Qwen3-8b.*no such directory .*only at its own path, "
                                          r"\.cache/tiny-qwen3"):
        prepare.run([f"target.path={missing}"])
    assert built == [] and not missing.exists()
    monkeypatch.chdir(tmp_path)   # the preset's own (relative) path is still built where it is missing
    ensure_embedded_target(compose_config(["target=tiny_llama"]), seed=0)
    assert built == [".cache/tiny-llama"]


def test_target_dir_without_weights(tmp_path, tiny_target_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_target_dir / "config.json", bare)
    with pytest.raises(TargetError, match="weights"):
        load_target(bare, layer_ids=[0], device="cpu")
    with pytest.raises(Exception, match="safetensors"):
        FrozenTargetHead.from_target_dir(bare)


def test_tokenizer_without_chat_template(tmp_path, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    tokenizer.chat_template = None
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": 1, "conversations": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello there"}]}) + "\n")
    with pytest.raises(DataError, match="no chat template"):
        load_samples([data], tokenizer, max_length=64)


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_malformed_dataset_line(tmp_path, tiny_target_dir, policy):
    good = json.dumps({"id": 1, "conversations": [{"role": "user", "content": "add 2 and 3"},
                                                  {"role": "assistant", "content": "2 plus 3 is 5, so 5."}]})
    data = tmp_path / "d.jsonl"
    data.write_text(good + "\n{not json\n" + good.replace("so 5.", "so five.") + "\n")  # distinct: none dropped
    cfg = _cfg(tiny_target_dir, tmp_path, f"data.paths=[{data}]", f"data.on_bad_line={policy}",
               "data.eval_fraction=0")
    if policy == "fail":
        with pytest.raises(DataError, match=r"d\.jsonl line 2"):
            build_sources(resolve(cfg, Topology(1, 1), torch.device('cpu')))
    else:
        _, _, stats = build_sources(resolve(cfg, Topology(1, 1), torch.device('cpu')))
        assert stats["bad_lines_skipped"] == 1 and stats["train_samples"] == 2


def test_empty_dataset_after_filtering(tmp_path, tiny_target_dir):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": 1, "conversations": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": ""}]}) + "\n")
    with pytest.raises(DataError, match="no usable samples"):
        build_sources(_job(tiny_target_dir, tmp_path, f"data.paths=[{data}]"))


def test_missing_dataset_file(tmp_path, tiny_target_dir):
    with pytest.raises(ConfigError, match=r"data.paths: .*missing.jsonl.* does not exist"):
        build_sources(_job(tiny_target_dir, tmp_path, f"data.paths=[{tmp_path / 'missing.jsonl'}]"))


def test_sequence_longer_than_the_model_allows(tmp_path, tiny_target_dir):
    with pytest.raises(ConfigError, match=r"data.max_length=4096 exceeds the target's max_position_embeddings"):
        _job(tiny_target_dir, tmp_path, "data.max_length=4096")


def test_fixed_length_shorter_than_a_sample(tmp_path, tiny_target_dir):
    with pytest.raises(ValueError, match="fixed_length=64"):
        build_sources(_job(tiny_target_dir, tmp_path, "data.fixed_length=64"))


@pytest.mark.parametrize("override,key", [("drafter.block_size=1", "drafter.block_size"),
                                          ("drafter.loss=focal", "drafter.loss"),
                                          ("train.steps=0", "train.steps"),
                                          ("data.on_bad_line=ignore", "data.on_bad_line"),
                                          ("drafter.compile=yes", "drafter.compile"),
                                          # issue 17: these used to train backwards, diverge or crash later
                                          ("optim.lr=1e4", "optim.lr"),
                                          ("optim.grad_clip=-1", "optim.grad_clip"),
                                          ("optim.min_lr_ratio=-3", "optim.min_lr_ratio"),
                                          ("run.log_every=0", "run.log_every"),
                                          ("drafter.mask_token_id=abc", "drafter.mask_token_id"),
                                          ("isolation.compile_threads=-2", "isolation.compile_threads")])
def test_invalid_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        compose_config([override])


def test_an_empty_path_is_refused_not_replaced_by_the_default():
    # issue 31: `run.dir=` (an unset shell variable) trained silently into runs/<timestamp>
    with pytest.raises(ConfigError, match=r"^run.dir='': must not be empty .*leave the key out"):
        compose_config(["run.dir="])
    with pytest.raises(ConfigError, match=r"^regenerate.output=' ': must not be empty"):
        compose_config(["regenerate.output=' '"], "regenerate")
    assert compose_config(["run.dir=null"]).run.dir is None   # the default, asked for explicitly


@pytest.mark.parametrize("steps", [10**8, 10**12, 10**20])
def test_train_steps_stop_where_checkpoint_names_do(steps):
    # issue 31: 10**12 was accepted, its warm-up of 4*10**10 steps kept the lr near zero with no word; and
    # step_XXXXXXXX holds 8 digits: a 9-digit step would be a checkpoint resume neither finds nor orders
    with pytest.raises(ConfigError, match=rf"^train.steps={steps}: must be <= 99999999"):
        compose_config([f"train.steps={steps}"])
    assert compose_config(["train.steps=99999999"]).train.steps == 99999999


@pytest.mark.parametrize("overrides,binding", [
    (["drafter.block_size=300", "data.fixed_length=256"], ["data.fixed_length"]),
    (["drafter.block_size=300", "data.fixed_length=256", "data.packing=false"], ["data.fixed_length"]),
    # the case: both bound the conversation
    (["drafter.block_size=300", "data.max_length=256", "data.fixed_length=256"], ["data.max_length",
                                                                                  "data.fixed_length"]),
    (["drafter.block_size=300", "data.max_length=1024", "data.fixed_length=256"], ["data.fixed_length"]),
    (["drafter.block_size=300", "data.max_length=128", "data.fixed_length=256"], ["data.max_length"]),
    (["drafter.block_size=300", "data.max_length=256"], ["data.max_length"])])
def test_a_block_longer_than_every_conversation_is_refused_at_start(overrides, binding):
    with pytest.raises(ConfigError, match=r"^drafter.block_size=300: a block lies within one conversation") as no:
        check_combinations(compose_config(overrides))
    for key in ("data.max_length", "data.fixed_length"):
        assert (f"{key}=" in str(no.value)) == (key in binding), str(no.value)


def test_a_block_as_long_as_the_longest_conversation_is_allowed():
    check_combinations(compose_config(["drafter.block_size=256", "data.fixed_length=256"]))


def test_a_string_data_path_is_one_path(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    cfg = compose_config([f"data.paths={data}"])
    assert list(cfg.data.paths) == [str(data)] and dataset_paths(cfg.data.paths, "data.paths") == [data]
    # the same config as the list form, so a resume with either spelling is the same run
    assert config_hash(cfg) == config_hash(compose_config([f"data.paths=[{data}]"]))


@pytest.mark.parametrize("argv,meant", [
    (["run.dir=/tmp/ü", "ñ", "x"], "/tmp/ü ñ x"),   # the case: unquoted, the shell split it too
    (["run.dir=/tmp/ü"], "/tmp/ü"),
    (["train.steps=5", "run.dir=/tmp/a", "b", "c"], "/tmp/a b c")])
def test_an_unreadable_override_gets_one_line_saying_how_to_quote_it(argv, meant):
    with pytest.raises(ConfigError, match=r"^hydra cannot read the override 'run.dir=/tmp/|^hydra cannot read the "
                                          r"override 'b': it is not key=value") as refused:
        compose_config(argv)
    message = str(refused.value)
    assert "\n" not in message
    suggested = message.rsplit(": ", 1)[1]
    assert suggested[0] == suggested[-1] == '"'   # the shell's quotes, hydra's inside
    assert compose_config([suggested[1:-1]]).run.dir == meant


def test_a_timeout_too_short_for_a_heartbeat_is_refused_before_any_process_group():
    # issue 31: run.timeout_s=0.001 failed inside gloo's connection set-up, 40 C++ frames per rank.
    with pytest.raises(ConfigError, match=r"^run.timeout_s=0.001: must be >= 5"):
        compose_config(["run.timeout_s=0.001"])
    assert compose_config(["run.timeout_s=5"]).run.timeout_s == 5


def test_target_layer_ids_out_of_range(tmp_path, tiny_target_dir):
    with pytest.raises(ConfigError, match=r"target_layer_ids=\[0, 7\]: the target has 4 layers, .*\[7\] do not"):
        _job(tiny_target_dir, tmp_path, "drafter.target_layer_ids=[0,7]")


def test_drafter_hidden_size_mismatch(tmp_path, tiny_target_dir):
    with pytest.raises(ValueError, match="hidden size 64 must equal the target's hidden size 128"):
        _job(tiny_target_dir, tmp_path, "drafter.hidden_size=64")


def test_topology_not_fitting_world():
    with pytest.raises(ConfigError, match=r"topology=t5d3 needs 8 processes .* WORLD_SIZE=4"):
        parse_topology("t5d3", 4)


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"run.dir=.*file/run.* is not writable"):
        prepare_run_dir(blocker / "run")


def test_unknown_config_key():
    with pytest.raises(ConfigCompositionException, match="train.stpes"):
        compose_config(["train.stpes=5"])


@pytest.mark.parametrize("setting", ["nope-tok", "/nope-tok"])
def test_a_tokenizer_path_that_does_not_exist_is_named_at_once_with_no_hub_lookup(tmp_path, tiny_target_dir,
                                                                                 monkeypatch, setting):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # were the hub asked, it would fail here at once, not after 50 s
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"tokenizer path '{setting}' does not exist"):
        _job(tiny_target_dir, tmp_path, f"data.tokenizer={setting}")


def test_a_dataset_file_named_twice_is_refused_naming_it(tmp_path, tiny_target_dir):
    data = tmp_path / "x.jsonl"
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "hello there"}]}) + "\n")
    for paths in (f"[{data},{data}]", f"[{tmp_path},{data}]"):   # twice directly, or once more through its directory
        with pytest.raises(ConfigError, match=f"data.paths: '{data}' is named twice"):
            build_sources(_job(tiny_target_dir, tmp_path, f"data.paths={paths}", "data.eval_fraction=0"))
