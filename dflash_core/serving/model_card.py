"""The export's README.md model card: what the drafter was trained for and on, how well it drafts,
and how to serve it.

The facts arrive as a plain dict (the launcher gathers them; keys below). They are also kept,
as one line of JSON, in the card's YAML front matter under `dflash_training`, so that a later
evaluation can add the real acceptance length and render the card again without losing them.
"""

import hashlib
import json
import shlex
from pathlib import Path

from ..files.durable import write_atomic
from ..files.readers import read_json

CARD_NAME = "README.md"
_INFO_KEY = "dflash_training"

# The training facts a card shows, in this order. Keys of the info dict not named here (and not
# "provenance", an acceptance's "..._eval" or "target_identity") are shown after them under their own names.
FIELDS = {
    "target": "Target model",
    "data": "Training data",
    "init_from": "Initial weights (drafter.init_from, drafter.init)",
    "steps": "Optimiser steps",
    "tokens_seen": "Training tokens seen",
    "heldout_tau": "Held-out tau (speculative decoding of held-out data simulated during training)",
    "heldout_anchor_tau": "Held-out tau per anchor (its mean over every position of held-out data)",
    "acceptance_length": "Acceptance length (real speculative decoding, launcher.evaluate, engine hf)",
    "served_acceptance_length": "Served acceptance length (vLLM's counters, launcher.evaluate evaluate.engine=vllm)",
    "command": "Command",
}
# A DFlash 2's held-out figures beside heldout_tau (its selector walk, what serving drafts): the card key of each
# StepCounts.summary() key, and its label; shown only on the cards that have them.
SELECTOR_FIGURES = {"unary_decode_tau": "heldout_unary_tau", "oracle_decode_tau": "heldout_oracle_tau",
                    "recall_at_k": "heldout_recall_at_k", "selector_acc": "heldout_selector_acc"}
SELECTOR_FIELDS = {
    "heldout_unary_tau": "Held-out tau of the unary top-1 walk (DFlash 2 without its selector)",
    "heldout_oracle_tau": "Held-out tau of the oracle walk (the target's token anywhere in the top-K counts)",
    "heldout_recall_at_k": "Held-out recall@K (the target's token among the unary top-K)",
    "heldout_selector_acc": "Held-out selector accuracy (its pick after the true previous token is the target's)",
}
# The card key of each evaluation engine's acceptance length; how it was measured is under _eval_key(key).
ACCEPTANCE_KEYS = {"hf": "acceptance_length", "vllm": "served_acceptance_length"}


def _eval_key(key: str) -> str:
    return key.replace("_length", "_eval")   # acceptance_eval, served_acceptance_eval
PROVENANCE = "provenance"          # dict: code version, torch / transformers / CUDA / NCCL versions, ...
INIT_FROM = "init_from"            # dict {"path", "weights_sha256"} of the export training started from, or
                                   # {"target_layers"} copied (drafter.init=target), or None
TARGET_IDENTITY = "target_identity"  # dict: the target's model_type and config.json digest (target_identity())
_SHOWN_ELSEWHERE = (PROVENANCE, TARGET_IDENTITY, *map(_eval_key, ACCEPTANCE_KEYS.values()))
# config.json keys that differ between copies of one model (who saved it, with what, in which dtype).
_COPY_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


def write_model_card(out_dir, info):
    """Write (or replace, atomically) out_dir/README.md from `info`, a plain JSON-able dict with
    any of: target, data (list of files), init_from (dict: path, weights_sha256; or target_layers), steps, tokens_seen,
    heldout_tau, acceptance_length, acceptance_eval (dict), command (str or argv list), provenance
    (dict), target_identity (dict, target_identity(): what later evaluations check the target against). The architecture
    comes from out_dir/config.json when it is there."""
    out_dir = Path(out_dir)
    config_path = out_dir / "config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    # World-readable whatever the umask: a server running as another user reads the export.
    write_atomic(out_dir / CARD_NAME, render_model_card(info, config), permissions=0o644)


def read_card_info(out_dir):
    """The info dict a card was written from ({} when there is no card, or not one of ours)."""
    path = Path(out_dir) / CARD_NAME
    if not path.is_file():
        return {}
    front_matter = path.read_text(encoding="utf-8").split("\n---\n", 1)[0]
    prefix = f"{_INFO_KEY}: "
    for line in front_matter.splitlines():
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    return {}


def acceptance_key(engine: str) -> str:
    """The card key of an evaluation engine's acceptance length (hf | vllm)."""
    return ACCEPTANCE_KEYS[engine]


def record_acceptance_length(out_dir, acceptance_length, details=None, engine="hf"):
    """Add an engine's real acceptance length (mean accepted + 1 per verify step, from speculative
    decoding with the target) to an existing export's card, keeping everything else it says.
    `details`: how it was measured, e.g. {"prompts": 64, "data": [...], "max_new_tokens": 256}."""
    info, key = read_card_info(out_dir), acceptance_key(engine)
    info[key] = acceptance_length
    info[_eval_key(key)] = dict(details or {})
    write_model_card(out_dir, info)


def acceptance_comparison(info) -> str:
    """The acceptance lengths a card holds side by side: what training simulated on held-out data, what
    real decoding gave (HF) and what vLLM served, each against real decoding's."""
    real = info.get(ACCEPTANCE_KEYS["hf"])
    rows = [(FIELDS[key], info.get(key)) for key in ("heldout_tau", ACCEPTANCE_KEYS["hf"], ACCEPTANCE_KEYS["vllm"])]
    if "heldout_unary_tau" in info:   # a DFlash 2: what its selector adds over its own unary top-1
        rows.insert(1, (SELECTOR_FIELDS["heldout_unary_tau"], info["heldout_unary_tau"]))
    width = max(len(label) for label, _ in rows)
    lines = ["acceptance length (tau), side by side:"]
    for label, value in rows:
        versus = f"  ({100 * (value / real - 1):+.1f}% against real decoding)" if value and real and value != real \
            else ""
        lines.append(f"  {label:<{width}}  {'not measured' if value is None else f'{value:.3f}'}{versus}")
    return "\n".join(lines)


def identifying_config(model_dir):
    """A model directory's config.json without the keys that differ between copies of one model."""
    config = read_json(Path(model_dir) / "config.json")
    return {key: value for key, value in config.items() if key not in _COPY_KEYS}


def target_identity(target_dir):
    """What names a target beyond its path, which moves: {"model_type", "config_sha256"} (the digest
    of identifying_config, its config.json without the keys that differ between copies of one model)."""
    kept = identifying_config(target_dir)
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"model_type": kept.get("model_type"), "config_sha256": digest}


def other_target(info, target_dir):
    """How the target a card's `info` records differs from `target_dir` ("" when it is the same, or
    when the card records none): by identity when recorded, else by resolved path."""
    recorded, identity = info.get("target"), info.get(TARGET_IDENTITY)
    if identity:
        here = target_identity(target_dir)
        if identity.get("config_sha256") == here["config_sha256"]:
            return ""
        return (f"it was trained for the target {recorded} (model_type {identity.get('model_type')}, config.json "
                f"sha256 {identity.get('config_sha256')}), this one is model_type {here['model_type']} "
                f"({here['config_sha256']})")
    there, here = (Path(path).resolve() for path in (recorded or target_dir, target_dir))
    if there != here:
        return f"it was trained for the target {recorded} ({there}), not {here}"
    return ""


def render_model_card(info, config):
    target = info.get("target")
    # One line of JSON is also valid YAML: the Hub's card parser and read_card_info both read it.
    front_matter = ["---", "library_name: transformers", "tags:", "- dflash", "- speculative-decoding",
                    f"{_INFO_KEY}: {json.dumps(info, sort_keys=True, default=str)}", "---", ""]
    kind = "DFlash 2" if "selector_top_k" in config.get("dflash_config", {}) else "DFlash"
    title = f"# {kind} drafter for {target}" if target else f"# {kind} drafter"
    intro = (f"A {kind} block-diffusion draft model for speculative decoding, trained with dflash-launcher. "
             "It drafts a block of tokens in one forward pass from the target's hidden states; it has no "
             "embedding and no LM head of its own (it uses the target's).")
    if kind == "DFlash 2":
        intro += (" Its candidate selector rescores each slot's top-K tokens by the token before it; serving "
                  "drafts its greedy walk through them.")
    extra = {k: v for k, v in info.items() if k not in {**FIELDS, **SELECTOR_FIELDS} and k not in _SHOWN_ELSEWHERE}
    training = [(label, _training_value(key, info)) for key, label in FIELDS.items()]
    training += [(label, _format(info[key])) for key, label in SELECTOR_FIELDS.items() if key in info]
    training += [(key, _format(value)) for key, value in sorted(extra.items())]
    provenance = [(key, _format(value)) for key, value in sorted((info.get(PROVENANCE) or {}).items())]
    lines = [*front_matter, title, "", intro, "", "## Training", "", *_table(training), ""]
    if config:
        lines += ["## Architecture (config.json)", "", *_table(_architecture(config)), ""]
    lines += ["## Provenance", "", *(_table(provenance) if provenance else ["not recorded"]), ""]
    lines += _usage(target, config.get("block_size"))
    return "\n".join(lines) + "\n"


def _training_value(key, info):
    value = info.get(key)
    if key in ACCEPTANCE_KEYS.values() and value is None:
        engine = next(engine for engine, k in ACCEPTANCE_KEYS.items() if k == key)
        return ("not measured yet (`python -m launcher.evaluate evaluate.drafter=<this directory> "
                f"evaluate.engine={engine}`)")
    if key in ACCEPTANCE_KEYS.values() and info.get(_eval_key(key)):
        how = ", ".join(f"{k} {_format(v)}" for k, v in sorted(info[_eval_key(key)].items()))
        return f"{_format(value)} ({how})"
    if key == INIT_FROM and key in info:
        if value and "target_layers" in value:
            return f"the target's layers {', '.join(map(str, value['target_layers']))} (drafter.init=target)"
        return (f"the export {_cell(value['path'])} (model.safetensors sha256 `{value['weights_sha256']}`)" if value
                else "random (trained from scratch)")
    if key == "command" and value:
        command = shlex.join(str(arg) for arg in value) if isinstance(value, (list, tuple)) else value
        return f"`{_cell(command)}`"
    return _format(value)


def _architecture(config):
    dflash = config.get("dflash_config", {})
    num_target_layers = config.get("num_target_layers")
    return [
        ("Drafter layers", _format(config.get("num_hidden_layers"))),
        ("Block size", _format(dflash.get("block_size", config.get("block_size")))),
        ("Target layers read (HF numbering)",
         f"{_format(dflash.get('target_layer_ids'))} of {_format(num_target_layers)}"),
        ("Mask token id", _format(dflash.get("mask_token_id"))),
        ("Hidden size / heads / KV heads", " / ".join(_format(config.get(k)) for k in (
            "hidden_size", "num_attention_heads", "num_key_value_heads"))),
        ("Layer types", _format(config.get("layer_types"))),
        ("Weights dtype", _format(config.get("torch_dtype"))),
        *([("Selector top-K / rank", f"{_format(dflash['selector_top_k'])} / {_format(dflash.get('selector_rank'))}"),
           ("Convolution taps / channels per coefficient",
            f"{_format(dflash.get('conv_kernel_size'))} / {_format(dflash.get('conv_group_size'))}")]
          if "selector_top_k" in dflash else []),
    ]


def _usage(target, block_size):
    model, block_size = target or "<target>", block_size or 16
    vllm_config = {"method": "dflash", "model": "<this directory>", "num_speculative_tokens": block_size - 1}
    return [
        "## Use", "",
        "Serve it beside its target (this directory is the draft model):", "",
        "```bash",
        f"vllm serve {model} \\",
        f"    --speculative-config '{json.dumps(vllm_config)}'",
        f"python -m sglang.launch_server --model-path {model} \\",
        "    --speculative-algorithm DFLASH --speculative-draft-model-path <this directory> \\",
        f"    --speculative-num-draft-tokens {block_size}",
        "```", "",
        ("In Python, `AutoModel.from_pretrained(<this directory>, trust_remote_code=True)` returns the "
         "drafter (`dflash.py` wraps the training code's `model.py`); its forward takes the target's "
         "hidden states at the layers above, the target's embeddings of each block, the block anchors "
         "and a keep mask, and returns block hidden states for the target's LM head."),
    ]


def _table(rows):
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]


def _format(value):
    if value is None:
        return "not recorded"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{_cell(str(item))}`" for item in value) or "none"
    if isinstance(value, dict):
        return f"`{_cell(json.dumps(value, sort_keys=True, default=str))}`"
    return _cell(str(value))


def _cell(text):
    """Text safe in a Markdown table cell: a "|" would end the cell, a newline the row."""
    return text.replace("|", "\\|").replace("\n", " ")
