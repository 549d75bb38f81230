"""The benchmark's inputs: a target directory of the bench shape (random weights), synthetic data,
and the training overrides shared by the drafter-alone row and the end-to-end launch."""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

from dflash_core.target.families import text_config
from dflash_core.target.shapes import config_from_shape
from launcher.bench.mix import LengthMix, MixError


def bench_config(shape, **ids):
    """The transformers config of a bench shape: a name of dflash_core.target.shapes.SHAPES, or a dict
    of config fields (the tiny target's: model_type defaults to qwen3)."""
    from transformers import AutoConfig

    if isinstance(shape, str):
        return config_from_shape(shape, **ids)
    return AutoConfig.for_model(**{"model_type": "qwen3", **shape, **ids})


def write_bench_target(out_dir: Path, shape, tokenizer_src: Path) -> Path:
    """A target directory with only config.json (the bench shape, see bench_config) and a tokenizer:
    enough for target.random_weights=true. The tiny tokenizer's ids are < 1024, so they fit any
    vocabulary."""
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    config = bench_config(shape, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.model_max_length = text_config(config).max_position_embeddings  # no "sequence too long" warnings
    tokenizer.save_pretrained(out_dir)
    config.save_pretrained(out_dir)
    return out_dir


_WORDS = ("the model reads a long text and learns to guess the next words of the answer quickly while the "
          "target checks every block it proposes so that nothing changes in the output only the speed "
          "data tokens layers hidden states flow from one process to another over the network").split()


def write_synthetic_data(path: Path, tokenizer_dir: Path, min_tokens: int, records: int = 8, seed: int = 0) -> dict:
    """Preformatted {"id", "text"} records that each tokenise to >= min_tokens tokens, so with
    data.max_length = min_tokens every sample is truncated to exactly that length, its loss mask is
    all ones and S-1 anchor candidates exist."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    words = min_tokens + 16
    while True:
        texts = [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(records)]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        if min(lengths) >= min_tokens:
            break
        words *= 2
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"bench-{i}", "text": text}) + "\n")
    return {"records": records, "min_tokens": min(lengths)}


def run_overrides(*, target_dir: Path, data_path: Path, seq_len: int, steps: int, tiny: bool, anchors: int,
                  work: Path, mask_token_id="auto") -> list[str]:
    """The hydra overrides shared by the drafter-alone stage (composed in-process) and the
    end-to-end launch, so both train exactly the same drafter. Real shapes: the production
    drafter (dflash5, the spec's default layer ids) with the shape's mask token."""
    over = [f"target.path={target_dir}", "target.build_tiny=false", "target.random_weights=true",
            f"drafter={'tiny' if tiny else 'dflash5'}", f"drafter.num_anchors={anchors}",
            f"data.paths=['{data_path}']", f"data.max_length={seq_len}", f"data.fixed_length={seq_len}",
            "data.eval_fraction=0", f"data.cache_dir={work / 'tokenized'}", "train.micro_batch_size=1",
            f"train.steps={steps}", "run.export=false", "run.progress=false"]
    if not tiny:
        over += ["drafter.target_layer_ids=null", f"drafter.mask_token_id={mask_token_id}"]
    return over


# ------------------------------------------------------------------------------ conversations of a mix
def _single_token_words(tokenizer) -> list[str]:
    """Words that are one token with and without a leading space (a template may strip the space);
    failing that, words that are one token after a space."""
    def one_token(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 1
    words = sorted(set(_WORDS))
    usable = [w for w in words if one_token(" " + w) and one_token(w)] or [w for w in words if one_token(" " + w)]
    if not usable:
        raise MixError(f"tokenizer {tokenizer.name_or_path!r} has none of the bench's words as a single token; "
                       f"the mix's conversation file cannot realise exact token lengths with it")
    return usable


def _words(rng: random.Random, words: list[str], count: int) -> str:
    return "".join(" " + rng.choice(words) for _ in range(count))


def _conversation(prompt: str, answer: str, index: int) -> str:
    return json.dumps({"id": f"mix-{index}", "messages": [{"role": "user", "content": prompt},
                                                          {"role": "assistant", "content": answer}]}) + "\n"


def _split_lengths(samples: list[dict]) -> list[tuple[int, int]]:
    """(unsupervised, supervised) tokens per tokenised sample."""
    return [(len(s["input_ids"]) - int(s["loss_mask"].sum()), int(s["loss_mask"].sum())) for s in samples]


def _template_overheads(tokenizer, word: str, kwargs: dict) -> tuple[int, int]:
    """Tokens the chat template adds to a one-turn conversation's prompt and to its answer, measured
    by tokenising two calibration conversations the way training does."""
    from dflash_core.data import load_samples

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration.jsonl"
        path.write_text(_conversation(f" {word}", f" {word}", 0) + _conversation(f" {word}" * 3, f" {word}" * 5, 1))
        samples, _ = load_samples([path], tokenizer, max_length=1 << 20, chat_template_kwargs=kwargs)
    (p1, a1), (p3, a5) = _split_lengths(samples)
    if (p3 - p1, a5 - a1) != (2, 4):
        raise MixError(f"tokenizer {tokenizer.name_or_path!r}: a word does not add exactly one token to a rendered "
                       f"conversation (prompts of 1 and 3 words: {p1} and {p3} tokens; answers of 1 and 5 words: "
                       f"{a1} and {a5}); the mix's conversation file cannot realise exact token lengths")
    return p1 - 1, a1 - 1


def write_mix_conversations(path: Path, mix: LengthMix, tokenizer_dir: Path, *, max_length: int,
                            chat_template_kwargs: dict | None = None, seed: int = 0) -> tuple[LengthMix, dict]:
    """One-turn conversations whose rendered token counts (prompt = unsupervised, answer = supervised,
    chat template included) equal the mix's under the tokenizer in tokenizer_dir, so a launcher run
    on the file tokenises and packs the mix itself. The file is read back as training reads it and
    the result says how exactly it realises the mix (a prompt or answer shorter than the template's
    own tokens cannot be realised and comes out longer). Returns the realised mix (what the
    launcher will train on: the stage rows use it too) and how it compares with `mix`."""
    from dflash_core.data import load_samples, load_tokenizer

    kwargs = dict(chat_template_kwargs or {})
    tokenizer = load_tokenizer(tokenizer_dir)
    words = _single_token_words(tokenizer)
    prompt_overhead, answer_overhead = _template_overheads(tokenizer, words[0], kwargs)
    rng = random.Random(f"dflash-bench-conversations/{seed}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, (prompt, answer) in enumerate(zip(mix.prompts, mix.answers)):
            f.write(_conversation(_words(rng, words, max(1, prompt - prompt_overhead)),
                                  _words(rng, words, max(1, answer - answer_overhead)), i))
    samples, stats = load_samples([path], tokenizer, max_length=max_length, chat_template_kwargs=kwargs)
    realised = _split_lengths(samples)
    wanted = list(zip(mix.prompts, mix.answers))
    errors = [abs(gp - wp) + abs(ga - wa) for (gp, ga), (wp, wa) in zip(realised, wanted)] if stats["kept"] == len(
        wanted) else None
    realised_mix = LengthMix(f"{mix.source} (realised in {path.name})", *map(tuple, zip(*realised)))
    return realised_mix, {"path": str(path), "conversations": len(wanted), "kept": stats["kept"],
                          "truncated": stats["truncated"], "prompt_overhead": prompt_overhead,
                          "answer_overhead": answer_overhead,
                          "mismatched": None if errors is None else sum(e > 0 for e in errors),
                          "max_token_error": None if errors is None else max(errors)}
