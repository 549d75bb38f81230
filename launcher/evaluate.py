"""`python -m launcher.evaluate evaluate.drafter=DIR key=value ...`: real acceptance length.

Greedy speculative decoding (dflash_core.serving.speculative) of chat prompts with the target and a
drafter (an exported HF directory or a training checkpoint). Prints a table and writes a
JSON result. One process, batch size 1; under torchrun only rank 0 works.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dflash_core.files.readers import read_json
from dflash_core.serving.export import CONFIG_NAME
from dflash_core.serving.model_card import (
    acceptance_comparison,
    acceptance_key,
    read_card_info,
    record_acceptance_length,
)
from launcher.config import ConfigError, compose_config, require
from launcher.resolve import compute_dtype, dataset_paths, ensure_embedded_target, resolve_device, target_dir
from launcher.run_io.progress import prompt_progress
from launcher.serving.acceptance import (
    NEAR_TIE,
    NOT_A_TIE,
    load_prompts,
    per_position_from_steps,
    prompt_row,
    summarize,
    tie_tolerance,
)

log = logging.getLogger("dflash")
USAGE = """\
Usage: python -m launcher.evaluate evaluate.drafter=DIR [key=value ...]
Examples:
  python -m launcher.evaluate evaluate.drafter=runs/<name>/export                 # the embedded tiny target
  python -m launcher.evaluate target=qwen3_8b target.path=/models/Qwen3-8B \\
      evaluate.drafter=/runs/qwen3-8b/export evaluate.data=/data/heldout.jsonl"""


def load_drafter(path, *, device=None, dtype=None):
    """A DFlash or DFlash 2 drafter from an exported HF directory (config.json) or a training checkpoint
    directory (meta.json and its shards), in eval mode. Non-finite weights (a diverged run) are refused:
    they would "draft" nothing and report a meaningless acceptance length."""
    from dflash_core.serving.export import CONFIG_NAME, load_exported
    from dflash_core.serving.finite import check_finite
    from launcher.export import drafter_from_checkpoint

    path = Path(path)
    if (path / CONFIG_NAME).is_file():
        drafter = load_exported(path)
    elif (path / "meta.json").is_file():
        _, drafter = drafter_from_checkpoint(path)
    else:
        raise ConfigError(f"evaluate.drafter={str(path)!r}: neither an exported drafter (no {CONFIG_NAME}) "
                          f"nor a checkpoint directory (no meta.json)")
    check_finite(drafter, f"evaluate.drafter={str(path)!r}")
    return drafter.to(device=device, dtype=dtype).eval()


def check_fits_target(ev: DictConfig, drafter_config, target_path: Path) -> None:
    """Before any target weight loads: the drafter reads this target (hidden size, layers, vocabulary;
    with evaluate.check_target, the target its card or run records). A drafter for another target
    would run and report a meaningless tau."""
    from transformers import AutoConfig

    from dflash_core.serving.model_card import other_target
    from dflash_core.serving.speculative import pair_mismatches
    from launcher.export import run_facts

    found, remedy = pair_mismatches(drafter_config, AutoConfig.from_pretrained(target_path)), ""
    if ev.check_target and not found:
        drafter = Path(ev.drafter)
        recorded = read_card_info(drafter) if (drafter / CONFIG_NAME).is_file() else run_facts(drafter)
        found = [other for other in [other_target(recorded, target_path)] if other]
        remedy = " (or, if this is another copy of it, with evaluate.check_target=false)"
    if found:
        raise ConfigError(f"evaluate.drafter={str(ev.drafter)!r} does not fit target.path={str(target_path)!r}: "
                          f"{'; '.join(found)}; evaluate it with the target it was trained for{remedy}")


def prompt_sets(ev: DictConfig) -> dict[str | None, list[Path]]:
    """evaluate.data's prompt sets: a mapping {name: a path or paths} is decoded and reported set by set, with the
    same target, drafter and servers (a server's start is most of a small set's time on CPU); a path or a list of
    paths is one set (None)."""
    if OmegaConf.is_dict(ev.data):
        if not ev.data:
            raise ConfigError("evaluate.data={}: name at least one set")
        return {str(name): dataset_paths(paths, f"evaluate.data.{name}") for name, paths in ev.data.items()}
    return {None: dataset_paths(ev.data, "evaluate.data")}


def check_outputs(ev: DictConfig, names) -> dict[str | None, Path]:
    """Before any work: each set's result file (a named set's is evaluate.output with `.<name>` before its suffix),
    which replaces an earlier result only with evaluate.overwrite."""
    suffix = ".served.json" if ev.engine == "vllm" else ".speculative.json"   # each engine's result kept apart
    output = Path(ev.output) if ev.output else Path(str(Path(ev.drafter).resolve()) + suffix)
    outputs = {name: output if name is None else output.with_suffix(f".{name}{output.suffix}") for name in names}
    for path in outputs.values():
        if path.exists() and not ev.overwrite:
            try:
                earlier = read_json(path)
                what = f" (an earlier result: tau {earlier.get('tau')}, target {earlier.get('target')})"
            except (OSError, ValueError):
                what = ""
            raise ConfigError(f"evaluate.output={str(path)!r} already exists{what}; set evaluate.overwrite=true to "
                              f"replace it, or choose another evaluate.output")
    return outputs


def plain_margin(target):
    """The HF engine's reading of a divergence (acceptance.divergence's `measure`): the plain target's
    logits after the common prefix, once as the evaluation computes them (the target's dtype, fp32
    logits) and once with the whole target in fp32, where no compute-dtype rounding is left: a margin
    near zero there too is the model's own tie; a wide one there, tiny in the compute dtype, is rounding's
    (None where the GPU cannot hold the target in fp32)."""
    import torch

    from dflash_core.serving.speculative import next_token_logits, upcast_to_fp32

    dtype = next(target.parameters()).dtype

    def measure(ids, plain, speculative) -> dict:
        logits = fp32 = next_token_logits(target, ids)
        if dtype != torch.float32:
            try:
                with upcast_to_fp32(target):
                    fp32 = next_token_logits(target, ids)
            except torch.OutOfMemoryError:   # a target over half the GPU's memory: its fp32 margin is not read
                fp32 = None
        magnitude = max(abs(float(logits[plain])), abs(float(logits[speculative])))
        return {"margin": float(logits[plain] - logits[speculative]),
                "margin_fp32": None if fp32 is None else float(fp32[plain] - fp32[speculative]),
                "tolerance": tie_tolerance(str(dtype).removeprefix("torch."), magnitude)}
    return measure


def evaluate(cfg: DictConfig) -> dict:
    """The HF engine's report of evaluate.data, one set (see evaluate_sets)."""
    (summary,) = evaluate_sets(cfg).values()
    return summary


def evaluate_sets(cfg: DictConfig) -> dict:
    """{set name (None: evaluate.data is one set): report}, the target and drafter loaded once."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from dflash_core.data import load_tokenizer
    from dflash_core.data.prompts import stop_token_ids
    from dflash_core.serving.speculative import default_walk
    from dflash_core.target.capture import check_target_files

    ev = cfg.evaluate
    template_kwargs = OmegaConf.to_container(ev.chat_template_kwargs)
    device = resolve_device(ev.device, "evaluate.device")
    dtype = compute_dtype(cfg.target.dtype, device)
    ensure_embedded_target(cfg, ev.seed)
    path = target_dir(cfg)
    check_target_files(path)
    drafter = load_drafter(ev.drafter, device=device, dtype=dtype)
    check_fits_target(ev, drafter.config, path)
    hf_logging.disable_progress_bar()
    tokenizer = load_tokenizer(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    block_size = drafter.config.block_size
    max_prompt = target.config.max_position_embeddings - ev.max_new_tokens - block_size
    eos = stop_token_ids(tokenizer, target.generation_config, template_kwargs)
    # A DFlash 2 drafts with its selector's walk, as vLLM does, and decodes again with its unary top-1 alone: what
    # the selector adds.
    walk = default_walk(drafter)
    measure = plain_margin(target)
    summaries = {}
    for name, paths in prompt_sets(ev).items():
        prompts, skipped = load_prompts(paths, tokenizer, ev.num_prompts, max_prompt_tokens=max_prompt,
                                        chat_template_kwargs=template_kwargs)
        summaries[name] = {"engine": "hf", "drafter": str(ev.drafter), "target": str(path), "device": str(device),
                           "dtype": str(dtype).removeprefix("torch."), "logits_dtype": "float32", "skipped": skipped,
                           "max_new_tokens": ev.max_new_tokens, "walk": walk,
                           **decode_hf(ev, target, drafter, prompts, eos, walk, measure)}
    return summaries


def decode_hf(ev: DictConfig, target, drafter, prompts, eos, walk: str, measure) -> dict:
    """The HF engine's speculative decoding of `prompts` (and with a DFlash 2 its unary walk, and plain greedy
    decoding where losslessness is checked): the report's acceptance fields."""
    from dflash_core.serving.speculative import fp32_logits, greedy_decode, speculative_generate

    block_size = drafter.config.block_size
    per_prompt, unary_rows, spec_s, greedy_s = [], [], 0.0, 0.0
    with fp32_logits(target):   # verification and plain decoding both choose from fp32 logits
        # An evaluation on CPU runs for minutes per prompt set: its bar, cleared before the report.
        for ids in prompt_progress("evaluating", prompts, leave=False):
            started = time.perf_counter()
            result = speculative_generate(target, drafter, ids, max_new_tokens=ev.max_new_tokens, eos_token_id=eos)
            spec_s += time.perf_counter() - started
            if walk != "unary":
                unary = speculative_generate(target, drafter, ids, max_new_tokens=ev.max_new_tokens,
                                             eos_token_id=eos, walk="unary")
                unary_rows.append(prompt_row(ids, unary.tokens, len(unary.accepted),
                                             per_position_from_steps(unary.accepted, block_size)))
            reference = None
            if ev.check_lossless:
                started = time.perf_counter()
                reference = greedy_decode(target, ids, ev.max_new_tokens, eos_token_id=eos)
                greedy_s += time.perf_counter() - started
            row = prompt_row(ids, result.tokens, len(result.accepted),
                             per_position_from_steps(result.accepted, block_size), reference, measure)
            per_prompt.append({**row, "accepted": result.accepted})
    summary = summarize(per_prompt, block_size, speculative_s=spec_s, greedy_s=greedy_s)
    if unary_rows:
        unary = summarize(unary_rows, block_size, speculative_s=0.0, greedy_s=None)
        summary["unary_walk"] = {key: unary[key] for key in ("tau", "verify_steps", "per_position", "histogram",
                                                             "tokens_per_target_forward")}
    return summary


def _unary_walk_row(summary: dict) -> list[tuple[str, str]]:
    """A DFlash 2's unary top-1 walk beside its selector's: what the selector adds."""
    unary = summary.get("unary_walk")
    if not unary or unary["tau"] is None:
        return []
    lift = f" (the selector: {100 * (summary['tau'] / unary['tau'] - 1):+.1f}%)" if summary["tau"] else ""
    return [("mean tau, unary top-1 walk", f"{unary['tau']:.3f}{lift}")]


def _rate(summary: dict, key: str) -> str:
    return "n/a" if summary[key] is None else f"{summary[key]:.1f} tokens/s"


def real_differences(summary: dict) -> str | None:
    """The prompts whose output differs from plain greedy decoding beyond a near-tie: speculation
    changed the output, a bug. None when there are none."""
    found = []
    for i, row in enumerate(summary["per_prompt"]):
        record = row.get("divergence", {})
        if record.get("verdict") == NOT_A_TIE:
            why = record.get("why") or f"margin {record['margin']:.3g} > tolerance {record['tolerance']:.3g}"
            found.append(f"prompt {i} at generated token {record['position']} ({why})")
    return "; ".join(found) or None


def _lossless(summary: dict) -> str:
    """e.g. NO (14/16 identical; 2 near-ties: margins 0.004, 0.01 at positions 37, 88; 0 real differences)."""
    if summary["lossless"] is None:
        return "not checked"
    counts = summary["lossless_counts"]
    identical = f"{counts['identical']}/{summary['prompts']} identical to plain greedy decoding"
    if summary["lossless"]:
        return f"yes ({identical})"
    ties = [row["divergence"] for row in summary["per_prompt"]
            if row.get("divergence", {}).get("verdict") == NEAR_TIE]
    near = f"{counts['near_ties']} near-ties"
    if ties:
        margins = ", ".join(f"{tie['margin']:.3g}" for tie in ties)
        near += f": margins {margins} at positions {', '.join(str(tie['position']) for tie in ties)}"
    real = real_differences(summary)
    warning = f" WARNING, speculation changed the output: {real}" if real else ""
    return f"NO ({identical}; {near}; {counts['not_ties']} real differences){warning}"


def format_table(summary: dict) -> str:
    tau = "n/a (no verify step)" if summary["tau"] is None else f"{summary['tau']:.3f}"
    lossless = _lossless(summary)
    rows = [
        ("engine", summary["engine"]),
        ("prompts", str(summary["prompts"])),
        ("block size", str(summary["block_size"])),
        ("mean tau (accepted + 1)", tau + (" (the selector's greedy walk, as vLLM drafts)"
                                           if summary.get("walk") == "selector" else "")),
        *_unary_walk_row(summary),
        ("accepted per position", "  ".join(str(n) for n in summary["per_position"])),
        ("acceptance histogram", "  ".join(f"{k}:{n}" for k, n in summary["histogram"].items())),
        ("tokens per target forward", f"{summary['tokens_per_target_forward']:.3f}"),
        ("generated tokens", str(summary["generated_tokens"])),
        ("lossless", lossless),
        ("speculative decoding", f"{summary['speculative_s']:.1f} s, {_rate(summary, 'speculative_tokens_per_s')}"),
        ("plain greedy decoding", _rate(summary, "greedy_tokens_per_s")),
    ]
    width = max(len(name) for name, _ in rows)
    table = "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
    return table + (comparison(summary) if summary.get("baselines") else "")


def comparison(summary: dict) -> str:
    """The drafter beside the baselines on the same prompts: what a user compares."""
    methods = [(f"dflash (block {summary['block_size']})", summary)]
    methods += [(f"{name} (k={report['speculative_config']['num_speculative_tokens']})", report)
                for name, report in summary["baselines"].items()]
    lines = [f"{'method':<20}  {'tokens/forward':>14}  {'tokens/s':>9}  {'lossless':>8}  accepted per position "
             f"(per target forward)"]
    for name, report in methods:
        rates = " ".join(f"{rate:.2f}" for rate in report["per_position_rate"] if rate is not None)
        lossless = {None: "n/a", True: "yes", False: "NO"}[report["lossless"]]
        lines.append(f"{name:<20}  {report['tokens_per_target_forward']:>14.3f}  "
                     f"{report['speculative_tokens_per_s']:>9.1f}  {lossless:>8}  {rates}")
    if summary["greedy_tokens_per_s"] is not None:
        lines.append(f"{'plain':<20}  {1.0:>14.3f}  {summary['greedy_tokens_per_s']:>9.1f}  {'-':>8}")
    return "\n\n" + "\n".join(lines)


def run(overrides: list[str]) -> int:
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun: rank 0 alone evaluates
    cfg = compose_config(overrides, config_name="evaluate")
    require(cfg, cfg.evaluate.drafter is not None, "evaluate.drafter",
            "set it to an exported drafter dir or a checkpoints/step_XXXXXXXX dir")
    ev = cfg.evaluate
    require(cfg, not ev.baselines or ev.engine == "vllm", "evaluate.baselines",
            "the baselines are served by vLLM: set evaluate.engine=vllm")
    outputs = check_outputs(ev, prompt_sets(ev))
    if ev.engine == "vllm":
        from launcher.cli import stop_on_signals
        from launcher.serving.served_evaluate import evaluate_served_sets
        try:
            with stop_on_signals():   # SIGTERM too stops the servers
                summaries = evaluate_served_sets(cfg)
        except KeyboardInterrupt as stopped:
            stopped.left = (f"no result was written to {', '.join(map(str, outputs.values()))}; run the same command "
                            f"again to evaluate")
            raise
    else:
        summaries = evaluate_sets(cfg)
    for name, summary in summaries.items():
        report(name, summary, outputs[name])
    # An export's card holds one acceptance length per engine: the first set's.
    first = next(iter(summaries))
    if (Path(ev.drafter) / CONFIG_NAME).is_file() and summaries[first]["tau"] is not None:
        record_on_card(ev, first, summaries[first], outputs[first])
    return 0


def report(name: str | None, summary: dict, output: Path) -> None:
    """One set's result: its file, its table, and a warning naming any real difference from plain decoding."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=2) + "\n")
    if name is not None:
        print(f"\nprompt set {name}:")
    print(format_table(summary))
    print(f"wrote {output}")
    if real_differences(summary):
        log.warning("speculative decoding changed the output beyond a near-tie of the plain run's logits, a bug: "
                    "%s (each prompt's `divergence` in %s)", real_differences(summary), output)


def record_on_card(ev: DictConfig, name: str | None, summary: dict, output: Path) -> None:
    """The export's model card gets the set's acceptance length (replacing an earlier one only with
    evaluate.overwrite), and shows it beside the card's other figures."""
    engine = summary["engine"]
    earlier = read_card_info(ev.drafter).get(acceptance_key(engine))
    if not summary.get("drafter_checked", True):
        log.warning("the model card of %s is not updated: which drafter the server at %s speculates with "
                    "was not checked (said above), so these figures may be another drafter's; they are in %s",
                    ev.drafter, summary["endpoint"], output)
    elif earlier is None or ev.overwrite:
        served_by = {"endpoint": summary["endpoint"]} if engine == "vllm" else {}   # where the figures came from
        data = ev.data if name is None else ev.data[name]
        record_acceptance_length(ev.drafter, summary["tau"], {
            "prompts": summary["prompts"], "data": OmegaConf.to_container(data) if OmegaConf.is_config(data)
            else data, "max_new_tokens": ev.max_new_tokens, "lossless": summary["lossless"], **served_by},
            engine=engine)
    else:
        log.warning("the model card of %s keeps its earlier acceptance length %.3f (engine %s; "
                    "evaluate.overwrite=true replaces it)", ev.drafter, earlier, engine)
    print(acceptance_comparison(read_card_info(ev.drafter)))


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "evaluate", USAGE)


if __name__ == "__main__":
    main()
