"""The recipes (conf/recipe/<name>.yaml): each composes into a complete, valid config without any
weights present, says where each of its values comes from, fits its real target's shape, and trains
end to end on the tiny stand-in target of its family with the recipe's settings wherever the tiny
shape allows them. Each has a DFlash 2 variant (<name>_dflash2.yaml): the recipe with the published
DFlash 2 drafter (conf/drafter/dflash2.yaml) merged over it."""
import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dflash_core.drafter.dflash2 import DFlash2Config
from dflash_core.target.families import drafter_config_for_target
from dflash_core.target.shapes import SHAPES, config_from_shape
from launcher import config
from launcher.cli import parse_flags
from launcher.config import ConfigError, compose_config
from launcher.resolve import drafter_config, target_layer_ids
from tests.conftest import _build_tiny_target
from tests.launching import REPO, torchrun

RECIPE_DIR = REPO / "conf" / "recipe"
# recipe -> (its target's family, the real shape in dflash_core/target/shapes.py where there is one)
RECIPES = {"qwen3_8b": ("qwen3", "qwen3-8b"), "qwen3_6_27b": ("qwen3_5", None),
           "qwen3_5_35b_a3b": ("qwen3_5_moe", "qwen3.5-35b-a3b"), "llama3_1_8b": ("llama", "llama3-8b"),
           "gpt_oss_20b": ("gpt_oss", None)}
# Recipes sized for CPU machines (make train TARGET=...): -> (family, real shape), as above.
CPU_RECIPES = {"smollm2_135m": ("llama", "smollm2-135m")}
# DFlash 2 variant -> the recipe it varies.
DFLASH2_RECIPES = {f"{name}_dflash2": name for name in [*RECIPES, *CPU_RECIPES]}
DFLASH2_DRAFTER = REPO / "conf" / "drafter" / "dflash2.yaml"
ALL_RECIPES = [*RECIPES, *CPU_RECIPES, *DFLASH2_RECIPES]
# What a value's comment must name: the published recipe it follows, this project's measurement, the
# target's own shape or the DFlash spec's rule, or that it is an estimate (or, for paths, that the user sets it).
SOURCES = re.compile(r"\[z-lab\]|\[SpecForge\]|\[perf\]|\[target\]|\[spec\]|estimate|set yours")
TINY_LENGTH = 256   # the tiny targets' chats; their max_position_embeddings is 1024


def _recipe(name: str):
    return compose_config([f"recipe={name}"])


def test_every_recipe_file_is_listed():
    assert {path.stem for path in RECIPE_DIR.glob("*.yaml")} == set(ALL_RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_cfg_job_prints_a_complete_config(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_flags([f"recipe={name}", "--cfg", "job"], "config", "")
    assert exit_info.value.code == 0
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.recipe == name and not OmegaConf.missing_keys(printed)
    assert printed.target.path.startswith("/models/") and printed.target.build_tiny is False
    spec = re.fullmatch(r"t(\d+)d(\d+)", printed.topology)
    assert spec and int(spec[1]) + int(spec[2]) == 8, printed.topology   # one 8-GPU node
    assert printed.drafter.block_size == 16 and printed.data.packing is True


def _unsourced(text: str, value: str) -> list[str]:
    """The lines setting a value (matching `value`) that name no source, neither in their own comment nor in
    the comment block just above them (as the estimates of steps and topology explain themselves)."""
    unsourced, above = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            above += line
            continue
        if re.match(value, line) and not SOURCES.search(line + above):
            unsourced.append(line)
        above = ""
    return unsourced


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_every_value_says_where_it_comes_from(name):
    body = (RECIPE_DIR / f"{name}.yaml").read_text().split("_self_", 1)[1]
    assert _unsourced(body, r"\s+\w+: \S") == []


def test_every_published_dflash2_value_says_where_it_comes_from():
    assert _unsourced(DFLASH2_DRAFTER.read_text(), r"\w+: \S") == []


def test_a_recipe_value_of_the_wrong_type_names_the_key_value_type_and_file(tmp_path, monkeypatch):
    """Issue 46: "ValidationError raised while composing config:" and nothing after the colon."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    recipe = conf / "recipe" / "qwen3_8b.yaml"
    recipe.write_text(recipe.read_text().replace("  num_layers: 5 ", "  num_layers: five "))
    monkeypatch.setattr(config, "CONF_DIR", conf)
    with pytest.raises(ConfigError, match=rf"^drafter.num_layers='five' \(set in {recipe}\): must be of type int "
                                          r"\(omegaconf: Value 'five' of type 'str' could not be converted"):
        compose_config(["recipe=qwen3_8b"])


def test_an_unknown_recipe_lists_the_recipes_that_exist():
    with pytest.raises(ConfigError, match=rf"^recipe='qwen3_9b': there is no {RECIPE_DIR}/qwen3_9b.yaml; the recipe "
                                          rf"options are: {', '.join(sorted(ALL_RECIPES))}$"):
        compose_config(["recipe=qwen3_9b"])


@pytest.mark.parametrize("name", [name for name, (_, shape) in RECIPES.items() if shape])
def test_recipe_fits_its_real_target_shape(name):
    cfg, shape = _recipe(name), RECIPES[name][1]
    config = config_from_shape(shape)
    mask = cfg.drafter.mask_token_id
    drafter = drafter_config_for_target(
        config, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
        mask_token_id=SHAPES[shape].mask_token_id if mask == "auto" else mask,
        target_layer_ids=target_layer_ids(cfg, config),
        **({"intermediate_size": cfg.drafter.intermediate_size} if cfg.drafter.intermediate_size else {}))
    assert drafter.mask_token_id == (SHAPES[shape].mask_token_id or drafter.mask_token_id)
    assert cfg.data.fixed_length <= config.max_position_embeddings
    assert cfg.data.max_length <= cfg.data.fixed_length


@pytest.mark.parametrize("name,layers,published", [
    ("qwen3_8b", 36, [1, 9, 17, 25, 33]), ("llama3_1_8b", 32, [1, 8, 15, 22, 29]),
    ("qwen3_6_27b", 64, [1, 16, 31, 46, 61]), ("gpt_oss_20b", 24, [1, 6, 11, 16, 21]),
    ("qwen3_5_35b_a3b", 40, [3, 11, 19, 27, 35])])
def test_recipe_layer_ids_are_the_published_ones_on_their_target(name, layers, published):
    """A recipe derives its layer ids from the target's layer count (null), and on its own target that gives
    the published drafter's; only a drafter published with other ids lists them (SpecForge's full-attention
    layers of Qwen3.5-35B-A3B)."""
    cfg = _recipe(name)
    assert target_layer_ids(cfg, SimpleNamespace(num_hidden_layers=layers)) == published
    assert cfg.drafter.target_layer_ids is None or name == "qwen3_5_35b_a3b"


@pytest.mark.parametrize("name,dflash", DFLASH2_RECIPES.items())
def test_dflash2_variant_is_its_recipe_with_the_published_dflash2_drafter(name, dflash):
    """The published DFlash 2 values (z-lab's checkpoint, SpecForge's drafter) reach every variant but where
    the variant's own file sets a per-target one; all else is the DFlash recipe's."""
    variant, recipe = _recipe(name), _recipe(dflash)
    published = OmegaConf.load(DFLASH2_DRAFTER)
    own = OmegaConf.load(RECIPE_DIR / f"{name}.yaml").get("drafter", {})
    assert variant.recipe == name and variant.drafter.kind == "dflash2"
    assert (variant.drafter.conv_group_size, variant.drafter.conv_kernel_size, variant.drafter.selector_rank,
            variant.drafter.selector_top_k) == (16, 2, 256, 16)
    assert len(variant.drafter.layer_types) == variant.drafter.num_layers
    for key, value in published.items():
        assert variant.drafter[key] == own.get(key, value), key
    changed = {key for key in recipe.drafter if variant.drafter[key] != recipe.drafter[key]}
    assert changed <= set(published) | set(own), changed
    for section in ("topology", "target", "data", "optim", "train", "run"):
        assert variant[section] == recipe[section], section


@pytest.mark.parametrize("name", [name for name, dflash in DFLASH2_RECIPES.items()
                                  if {**RECIPES, **CPU_RECIPES}[dflash][1]])
def test_dflash2_variant_builds_on_its_real_target_shape(name):
    """DFlash2Config's checks at the real width and vocabulary: the convolution groups divide the hidden size,
    the taps fit the block, the top-K the vocabulary, one layer type per layer."""
    shape = {**RECIPES, **CPU_RECIPES}[DFLASH2_RECIPES[name]][1]
    auto = _recipe(name).drafter.mask_token_id == "auto"
    cfg = compose_config([f"recipe={name}", *([f"drafter.mask_token_id={SHAPES[shape].mask_token_id}"] * auto)])
    drafter = drafter_config(cfg, config_from_shape(shape))
    assert isinstance(drafter, DFlash2Config) and drafter.layer_types == list(cfg.drafter.layer_types)


def test_cpu_recipe_fits_its_target_and_two_cpu_processes():
    cfg = _recipe("smollm2_135m")
    config = config_from_shape("smollm2-135m")
    drafter = drafter_config_for_target(config, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                                        mask_token_id=cfg.drafter.mask_token_id,
                                        target_layer_ids=list(cfg.drafter.target_layer_ids))
    assert drafter.hidden_size == 576 and drafter.vocab_size == 49152 and drafter.num_target_layers == 30
    assert cfg.drafter.mask_token_id == SHAPES["smollm2-135m"].mask_token_id
    # the DFlash spec's spread: first 1, last at most N - 3, never the last layer (serving engines cannot capture
    # it); with drafter.init=target the last is the first copied layer's input
    ids = list(cfg.drafter.target_layer_ids)
    assert ids[0] == 1 and ids[-1] <= 30 - 3 and ids == sorted(set(ids))
    if cfg.drafter.init == "target":
        assert ids[-1] == 30 - cfg.drafter.num_layers - 1
    assert cfg.topology == "t1d1"   # the Makefile's --nproc-per-node 2
    assert cfg.data.max_length <= config.max_position_embeddings and cfg.target.path == ".cache/smollm2-135m-instruct"


def test_cpu_recipes_mask_token_is_a_special_token_the_template_never_renders():
    """The real tokenizer, where launcher.fetch_target has built the target here (make train TARGET=smollm2)."""
    from dflash_core.data import load_tokenizer
    target = REPO / _recipe("smollm2_135m").target.path
    if not (target / "fetch.json").is_file():
        pytest.skip(f"{target} is not built (python -m launcher.fetch_target builds it)")
    tokenizer = load_tokenizer(target)
    mask = SHAPES["smollm2-135m"].mask_token_id
    assert tokenizer.convert_ids_to_tokens(mask) == "<empty_output>" and mask in tokenizer.added_tokens_decoder
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    assert mask not in (rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    assert len(tokenizer) == config_from_shape("smollm2-135m").vocab_size   # no unused row: hence a chosen token


def _stand_in_overrides(name: str, target_dir: Path, tmp_path: Path) -> list[str]:
    """The recipe on its family's tiny target: only what the tiny shape cannot hold is replaced (the
    layer ids of a 36-64 layer target, the mask id of its vocabulary, lengths beyond its positions, the
    anchors and FFN width of an 8B drafter), plus a few steps on one drafter."""
    family = {**RECIPES, **CPU_RECIPES}[DFLASH2_RECIPES.get(name, name)][0]
    overrides = [f"recipe={name}", f"target={'tiny' if family == 'qwen3' else f'tiny_{family}'}",
                 f"target.path={target_dir}", "drafter.target_layer_ids=[0,2]", "drafter.mask_token_id=auto",
                 "drafter.num_anchors=32", f"data.max_length={TINY_LENGTH}", f"data.fixed_length={TINY_LENGTH}",
                 "data.paths=[bundled:tiny_chat]", "topology=t1d1", "train.steps=3", "train.eval_every=0",
                 "run.checkpoint_every=0", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'tok'}",
                 "run.progress=false"]
    if _recipe(name).drafter.intermediate_size is not None:
        overrides.append("drafter.intermediate_size=null")   # the tiny target's width
    return overrides


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_recipe_trains_on_its_family_stand_in(name, tiny_target_dir, tmp_path):
    family = {**RECIPES, **CPU_RECIPES}[DFLASH2_RECIPES.get(name, name)][0]
    target_dir = tiny_target_dir if family == "qwen3" else _build_tiny_target(family)
    overrides = _stand_in_overrides(name, target_dir, tmp_path)
    # The CPU recipes compile target and drafter: about a minute alone on 2 cores, past 300 s when another
    # suite shares the cores; 600 s still ends a hang.
    proc = torchrun(2, *overrides, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and math.isfinite(summary["last_loss"]), summary
    trained = OmegaConf.load(run_dir / "config.yaml")
    recipe = _recipe(name)
    kept = ("drafter.num_layers", "drafter.block_size", "drafter.gamma", "drafter.layer_types",
            "drafter.sliding_window", "data.packing", "data.chat_template_kwargs", "optim.lr", "optim.schedule",
            "optim.warmup_fraction", "optim.grad_clip", "train.micro_batch_size", "drafter.kind",
            *(f"drafter.{key}" for key in OmegaConf.load(DFLASH2_DRAFTER)))
    for key in kept:
        assert OmegaConf.select(trained, key) == OmegaConf.select(recipe, key), key
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    assert exported["num_hidden_layers"] == recipe.drafter.num_layers
    assert exported["dflash_config"]["block_size"] == recipe.drafter.block_size
    assert exported["layer_types"] == list(recipe.drafter.layer_types or ["full_attention"] * recipe.drafter.num_layers)
    if recipe.drafter.kind == "dflash2":
        assert exported["architectures"] == ["DFlash2DraftModel"]
        assert exported["dflash_config"]["selector_top_k"] == recipe.drafter.selector_top_k
