"""`python -m launcher.evaluate evaluate.drafter=DIR key=value ...`: real acceptance length.

Greedy speculative decoding (dflash_core.speculative) of chat prompts with the target and a
drafter (an exported HF directory or a training checkpoint). Prints a table and writes a
JSON result. One process, batch size 1; under torchrun only rank 0 works.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from launcher.config import ConfigError, compose_config, require, resolve_device


def validate(cfg: DictConfig) -> None:
    ev = cfg.evaluate
    require(cfg, ev.drafter is not None, "evaluate.drafter",
            "set it to an exported drafter dir or a checkpoints/step_XXXXXXXX dir")
    require(cfg, ev.num_prompts >= 1, "evaluate.num_prompts", "must be >= 1")
    require(cfg, ev.max_new_tokens >= 1, "evaluate.max_new_tokens", "must be >= 1")
    require(cfg, ev.device in ("auto", "cpu", "cuda"), "evaluate.device", "must be auto, cpu or cuda")


def load_drafter(path, *, device=None, dtype=None):
    """A DFlashDrafter from an exported HF directory (config.json) or a training checkpoint
    directory (meta.json + state.pt), in eval mode. Non-finite weights (a diverged run) are refused:
    they would "draft" nothing and report a meaningless acceptance length."""
    from dflash_core.export import CONFIG_NAME, load_exported
    from dflash_core.finite import check_finite
    from dflash_core.model import DFlashDrafter, DrafterConfig
    from launcher import checkpoint

    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        drafter = load_exported(path)
    elif (path / "meta.json").is_file():
        _, state = checkpoint.load(path)
        drafter = DFlashDrafter(DrafterConfig(**state["drafter_config"]))
        drafter.load_state_dict(state["model"])
    else:
        raise ConfigError(f"evaluate.drafter={str(path)!r}: neither an exported drafter (no {CONFIG_NAME}) "
                          f"nor a checkpoint directory (no meta.json)")
    check_finite(drafter, f"evaluate.drafter={str(path)!r}")
    return drafter.to(device=device, dtype=dtype).eval()


def _data_paths(data) -> list[Path]:
    from launcher.data_setup import resolve_dataset
    entries = [data] if isinstance(data, str) else list(data)
    paths = [resolve_dataset(p) for p in entries]
    for path in paths:
        if not path.is_file():
            raise ConfigError(f"evaluate.data: {str(path)!r} does not exist")
    return paths


def load_prompts(paths, tokenizer, num_prompts: int, *, max_prompt_tokens: int) -> tuple[list[list[int]], dict]:
    """Token ids of the first num_prompts conversations cut before their last assistant turn,
    rendered with the chat template and its generation prompt. Plain-text records (no turns)
    and prompts over max_prompt_tokens are skipped and counted."""
    from dflash_core.data import read_records

    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; prompts cannot be rendered")
    prompts, skipped = [], {"no_assistant_turn": 0, "too_long": 0}
    for path in paths:
        for _, record in read_records(path):
            turns = [k for k, m in enumerate(record.messages or ()) if m["role"] == "assistant"]
            if not turns or turns[-1] == 0:  # nothing to answer, or nothing before the answer
                skipped["no_assistant_turn"] += 1
                continue
            text = tokenizer.apply_chat_template(list(record.messages[:turns[-1]]), tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                skipped["too_long"] += 1
                continue
            prompts.append(ids)
            if len(prompts) == num_prompts:
                return prompts, skipped
    if not prompts:
        raise ConfigError(f"evaluate.data: no usable prompt in {[str(p) for p in paths]} ({skipped})")
    return prompts, skipped


def _eos_ids(tokenizer, target) -> list[int]:
    """The tokenizer's eos plus any the generation config lists (Qwen3 ends turns on either)."""
    found = [tokenizer.eos_token_id, getattr(target.generation_config, "eos_token_id", None)]
    ids = set()
    for item in found:
        ids.update([item] if isinstance(item, int) else (item or []))
    return sorted(ids)


def evaluate(cfg: DictConfig) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from dflash_core.speculative import greedy_decode, speculative_generate
    from launcher.setup_models import compute_dtype, ensure_embedded_target, target_dir

    ev = cfg.evaluate
    device = resolve_device(ev.device, "evaluate.device")
    dtype = compute_dtype(cfg.target.dtype, device)
    ensure_embedded_target(cfg, ev.seed)
    path = target_dir(cfg)
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    drafter = load_drafter(ev.drafter, device=device, dtype=dtype)
    block_size = drafter.config.block_size
    max_prompt = target.config.max_position_embeddings - ev.max_new_tokens - block_size
    prompts, skipped = load_prompts(_data_paths(ev.data), tokenizer, ev.num_prompts, max_prompt_tokens=max_prompt)
    eos = _eos_ids(tokenizer, target)

    per_prompt, spec_s, greedy_s = [], 0.0, 0.0
    for ids in prompts:
        started = time.perf_counter()
        result = speculative_generate(target, drafter, ids, max_new_tokens=ev.max_new_tokens, eos_token_id=eos)
        spec_s += time.perf_counter() - started
        row = {"prompt_tokens": len(ids), "generated_tokens": len(result.tokens), "tau": result.tau,
               "accepted": result.accepted, "target_forwards": result.target_forwards, "tokens": result.tokens}
        if ev.check_lossless:
            started = time.perf_counter()
            reference = greedy_decode(target, ids, ev.max_new_tokens, eos_token_id=eos)
            greedy_s += time.perf_counter() - started
            row["lossless"] = reference == result.tokens
            if not row["lossless"]:
                row["first_mismatch"] = next((i for i, (a, b) in enumerate(zip(reference, result.tokens)) if a != b),
                                             min(len(reference), len(result.tokens)))
        per_prompt.append(row)

    # Step-weighted over all prompts: every verify step counts once, as in serving benchmarks.
    accepted = [a for row in per_prompt for a in row["accepted"]]
    histogram = {str(k): 0 for k in range(1, block_size + 1)}
    for a in accepted:
        histogram[str(a + 1)] += 1
    generated = sum(row["generated_tokens"] for row in per_prompt)
    forwards = sum(row["target_forwards"] for row in per_prompt)
    return {
        "drafter": str(ev.drafter), "target": str(path), "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "prompts": len(prompts), "skipped": skipped, "block_size": block_size, "max_new_tokens": ev.max_new_tokens,
        "tau": sum(a + 1 for a in accepted) / len(accepted) if accepted else None,
        "histogram": histogram, "verify_steps": len(accepted), "generated_tokens": generated,
        "target_forwards": forwards, "tokens_per_target_forward": generated / forwards,
        "lossless": all(row["lossless"] for row in per_prompt) if ev.check_lossless else None,
        "speculative_s": spec_s, "greedy_s": greedy_s if ev.check_lossless else None,
        "per_prompt": per_prompt,
    }


def format_table(summary: dict) -> str:
    tau = "n/a (no verify step)" if summary["tau"] is None else f"{summary['tau']:.3f}"
    lossless = {None: "not checked", True: "yes", False: "NO"}[summary["lossless"]]
    if summary["lossless"] is not None:
        same = sum(row["lossless"] for row in summary["per_prompt"])
        lossless += f" ({same}/{summary['prompts']} prompts identical to greedy decoding)"
    rows = [
        ("prompts", str(summary["prompts"])),
        ("block size", str(summary["block_size"])),
        ("mean tau (accepted + 1)", tau),
        ("acceptance histogram", "  ".join(f"{k}:{n}" for k, n in summary["histogram"].items())),
        ("tokens per target forward", f"{summary['tokens_per_target_forward']:.3f}"),
        ("generated tokens", str(summary["generated_tokens"])),
        ("lossless", lossless),
        ("speculative decoding time", f"{summary['speculative_s']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def run(overrides: list[str]) -> int:
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun: rank 0 alone evaluates
    cfg = compose_config(overrides, config_name="evaluate")
    validate(cfg)
    summary = evaluate(cfg)
    ev = cfg.evaluate
    output = Path(ev.output) if ev.output else Path(str(Path(ev.drafter).resolve()) + ".speculative.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    print(format_table(summary))
    print(f"wrote {output}")
    return 0


def main() -> None:
    from hydra.errors import HydraException
    try:
        code = run(sys.argv[1:])
    except (ValueError, OSError, HydraException) as exc:  # bad settings or data: the message says what to fix
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
