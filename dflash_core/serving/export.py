"""Export the drafter as a Hugging Face model directory, and load it back.

What vLLM and SGLang read stays fixed: config.json with the Qwen3 fields, architectures
["DFlashDraftModel"], model_type "qwen3", block_size, num_target_layers and dflash_config
{mask_token_id, target_layer_ids (HF numbering), block_size}; model.safetensors with exactly the
drafter's state_dict keys (no prefix, no embedding, no LM head). SGLang silently ignores unknown
names, so both directions are checked strictly. A DFlash 2 drafter (drafter/dflash2.py) is written as
vLLM 0.32's qwen3_dflash2.py reads it: architectures ["DFlash2DraftModel"], dflash_config also
holding its convolution and selector settings, and its convolutions' and selector's tensors
(layers.{i}.{attention,mlp}_conv.*, candidate_selector.*) beside the DFlash ones.

For transformers, config.json also maps AutoModel to dflash.DFlashDraftModel (dflash.DFlash2DraftModel;
the layout of the public z-lab checkpoints) and the code lies beside it: dflash.py (hf_model.py, a thin wrapper)
and the drafter's own source (model.py and what it imports relatively), so
`AutoModel.from_pretrained(dir, trust_remote_code=True)` is this project's drafter. README.md is
the model card (model_card.py).

The directory is world-readable (0755 / 0644) and written into a temporary sibling, then renamed
into place. It never replaces anything but a previous export, and that only when asked.
"""

import json
import os
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..data.records import file_digest
from ..drafter import dflash2
from ..drafter.dflash2 import DFlash2Config, build_drafter
from ..drafter.model import DrafterConfig, fixed_weights
from ..files.readers import bad_file, check_safetensors, load_safetensors, open_safetensors, read_json
from .finite import check_finite
from .model_card import CARD_NAME, write_model_card

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MODELING_NAME = "dflash.py"
ARCHITECTURE = "DFlashDraftModel"
KNOWN_ARCHITECTURES = (ARCHITECTURE, dflash2.ARCHITECTURE)
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


class ExportExistsError(FileExistsError):
    """The output path exists and may not be replaced; the message says why and what to do."""


def expected_keys(cfg):
    """The exact tensor names of an exported drafter with this config."""
    attn_params = ["weight", "bias"] if cfg.attention_bias else ["weight"]
    per_layer = [f"self_attn.{proj}_proj.{p}" for proj in "qkvo" for p in attn_params]
    per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += [f"mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    keys = [f"layers.{i}.{name}" for i in range(cfg.num_hidden_layers) for name in per_layer]
    keys += ["fc.weight", "hidden_norm.weight", "norm.weight"]
    return keys + dflash2.parameter_names(cfg) if isinstance(cfg, DFlash2Config) else keys


def architecture(cfg):
    """config.json's architectures entry (and the wrapper class in dflash.py) for this drafter."""
    return dflash2.ARCHITECTURE if isinstance(cfg, DFlash2Config) else ARCHITECTURE


def dflash_config(cfg):
    """config.json's dflash_config: what the serving engines read besides the Qwen3 fields."""
    keys = {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size}
    if isinstance(cfg, DFlash2Config):
        # An absent cap is no cap for vLLM (it reads `or 0.0`); a null could be read as a number elsewhere.
        keys.update((key, getattr(cfg, key)) for key in dflash2.DFLASH_CONFIG_KEYS if getattr(cfg, key) is not None)
    return keys


def config_to_json(cfg, dtype=torch.bfloat16):
    sliding = "sliding_attention" in cfg.layer_types
    return {
        "architectures": [architecture(cfg)],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": f"dflash.{architecture(cfg)}"},
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        # transformers 5 reads RoPE from rope_parameters; rope_theta stays for older readers.
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": cfg.attention_bias,
        "layer_types": list(cfg.layer_types),
        # Qwen3Config drops sliding_window unless use_sliding_window is true.
        "use_sliding_window": sliding,
        "sliding_window": cfg.sliding_window,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": dflash_config(cfg),
    }


def shipped_sources():
    """Export file name -> source file: the wrapper as dflash.py, then every module it imports
    relatively, found by transformers' own rule for the files remote code needs."""
    from transformers.dynamic_module_utils import get_relative_import_files

    wrapper = Path(__file__).parents[1] / "drafter" / "hf_model.py"
    files = {MODELING_NAME: wrapper}
    files.update((Path(source).name, Path(source)) for source in get_relative_import_files(str(wrapper)))
    return files


def export_drafter(drafter, out_dir, *, dtype=torch.bfloat16, overwrite=False, card=None):
    """Write the Hugging Face drafter directory out_dir (see the module docstring); `card`: the
    model card's facts (model_card.write_model_card). An existing out_dir is replaced only if it
    is a previous export and overwrite is true; anything else there is an ExportExistsError and
    is left untouched. Non-finite weights are a NonFiniteError: nothing is written."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported export dtype {dtype}; expected one of {list(_DTYPE_NAMES)}")
    out_dir = Path(out_dir)
    cfg = drafter.config
    state = {**drafter.state_dict(), **fixed_weights(cfg)}
    _check_keys(set(state), set(expected_keys(cfg)), "drafter state_dict")
    check_finite(drafter, f"export to {out_dir}")
    check_replaceable(out_dir, overwrite)  # before the work, and again before the rename
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous() for name, t in state.items()}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp_dir / CONFIG_NAME).write_text(json.dumps(config_to_json(cfg, dtype), indent=2) + "\n")
        for name, source in shipped_sources().items():
            shutil.copyfile(source, tmp_dir / name)
        write_model_card(tmp_dir, card or {})
        for path in tmp_dir.iterdir():
            os.chmod(path, 0o644)
        os.chmod(tmp_dir, 0o755)  # mkdtemp made it 0700: a server running as another user could not read it
        _move_into_place(tmp_dir, out_dir, overwrite)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
    return out_dir


def check_replaceable(out_dir, overwrite):
    """Raise ExportExistsError unless out_dir is absent, an empty directory, or a previous
    export that overwrite allows to replace."""
    out_dir = Path(out_dir)
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return  # an empty directory holds nothing to lose
    reason = _not_an_export(out_dir)
    if reason:
        raise ExportExistsError(f"{out_dir} exists and is not a DFlash export ({reason}); it is left "
                                f"untouched: choose an output path that does not exist")
    if not overwrite:
        raise ExportExistsError(f"{out_dir} holds a previous DFlash export; to replace it, ask for it "
                                f"(launcher.export export.overwrite=true, export_drafter(..., overwrite=True)) "
                                f"or choose another output path")


def _not_an_export(path):
    """Why `path` is not a directory export_drafter wrote ("" when it is one)."""
    if path.is_symlink():
        return "a symbolic link"
    if not path.is_dir():
        return "not a directory"
    export_files = {CONFIG_NAME, WEIGHTS_NAME, CARD_NAME}
    foreign = sorted(p.name for p in path.iterdir()
                     if not p.is_file() or p.is_symlink() or not (p.name in export_files or p.suffix == ".py"))
    if foreign:
        return f"it holds {', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}, which an export never writes"
    try:
        architectures = read_json(path / CONFIG_NAME).get("architectures")
    except (OSError, ValueError):
        return f"no readable {CONFIG_NAME}"
    if not isinstance(architectures, list) or len(architectures) != 1 or architectures[0] not in KNOWN_ARCHITECTURES:
        return f"its {CONFIG_NAME} describes {architectures}, not one of {list(KNOWN_ARCHITECTURES)}"
    return ""


def _move_into_place(tmp_dir, out_dir, overwrite):
    if not (out_dir.exists() or out_dir.is_symlink()):
        os.replace(tmp_dir, out_dir)
        return
    check_replaceable(out_dir, overwrite)
    # Renames within one directory: the previous export moves aside, the new one takes its
    # place, and only then is the old one deleted; if the second rename fails it goes back.
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    try:
        os.replace(out_dir, aside / out_dir.name)
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.replace(tmp_dir, out_dir)
    except BaseException:
        os.replace(aside / out_dir.name, out_dir)
        aside.rmdir()
        raise
    shutil.rmtree(aside)


def _check_keys(found, expected, where):
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise KeyError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")


def load_exported(path, *, device=None, dtype=torch.float32):
    """Load an exported drafter; any missing or unexpected tensor name is an error."""
    # Imported here: hf_model pulls in transformers' modeling code (docs/perf_notes.md, "Figures the
    # code quoted"), which a process that only writes exports (every training drafter) never needs.
    path = Path(path)
    cfg = check_export(path)
    state = load_safetensors(path / WEIGHTS_NAME)
    with torch.device("meta"):  # skip the random init: every tensor comes from the file
        drafter = build_drafter(cfg)
    drafter.load_state_dict(state, assign=True)
    return drafter.to(device=device, dtype=dtype)


def check_export(path):
    """The DrafterConfig of the export in directory `path`, its files read without loading a tensor:
    config.json a DFlash drafter's, model.safetensors whole (its header) and holding exactly this
    drafter's tensor names. A broken file is a BadFileError naming it; a missing one a
    FileNotFoundError naming it."""
    path = Path(path)
    cfg = read_exported_config(path)
    with open_safetensors(path / WEIGHTS_NAME) as weights:
        _check_keys(set(weights.keys()), set(expected_keys(cfg)), str(path / WEIGHTS_NAME))
    return cfg


def read_exported_config(path):
    """The DrafterConfig of the export in directory `path`; a config.json that is not a DFlash
    drafter's is a BadFileError saying what it lacks."""
    from ..drafter.hf_model import drafter_config_from_dict
    config_file = Path(path) / CONFIG_NAME
    config = read_json(config_file)
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise bad_file(config_file, "not a DFlash export: it has no dflash_config (the drafter's mask token, "
                       "target layer ids and block size)", "point at a directory that launcher.export wrote")
    try:
        return drafter_config_from_dict(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise bad_file(config_file, f"not a usable DFlash drafter config ({type(exc).__name__}: {exc})",
                       "point at a directory that launcher.export wrote") from None


def config_differences(path, cfg):
    """(field, the export's value, cfg's value) for every config field in which the export in directory
    `path` differs from `cfg`: a warm start needs none (its weights would not fit, or would read other
    target layers, mask token or block size). A DFlash export starts a DFlash 2 (`cfg` a DFlash2Config):
    its backbone is compared, the new parts start at identity; a DFlash 2 export starts only a DFlash 2
    of its settings (the field `kind` differs otherwise)."""
    exported = read_exported_config(path)
    kinds = [("dflash2" if isinstance(c, DFlash2Config) else "dflash") for c in (exported, cfg)]
    if kinds == ["dflash2", "dflash"]:
        return [("kind", *kinds)]
    compared = fields(DFlash2Config) if kinds == ["dflash2", "dflash2"] else fields(DrafterConfig)
    differences = [(f.name, getattr(exported, f.name), getattr(cfg, f.name)) for f in compared
                   if f.name != "learn_k_norm" and getattr(exported, f.name) != getattr(cfg, f.name)]
    # config.json has no learn_k_norm (an export holds every layer's k_norm): its weights say. Ones fit a
    # drafter that learns k_norm and one that does not; trained ones only the first.
    fixed = fixed_weights(cfg)
    if fixed:
        with open_safetensors(path / WEIGHTS_NAME) as weights:
            if any(not torch.equal(weights.get_tensor(name).float(), value) for name, value in fixed.items()):
                differences.append(("learn_k_norm", True, False))
    return differences


def weights_digest(path):
    """The sha256 of the export's model.safetensors, after checking its header (a truncated file is a
    BadFileError naming it): what a run that starts from these weights records of them."""
    weights = Path(path) / WEIGHTS_NAME
    check_safetensors(weights)
    return file_digest(weights)
