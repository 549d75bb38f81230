"""The benchmark's inputs: a target directory of the bench shape (random weights), synthetic data,
and the training overrides shared by the drafter-alone row and the end-to-end launch."""
from __future__ import annotations

import json
import random
from pathlib import Path

from launcher.bench.counts import QWEN3_MASK_TOKEN_ID


def write_bench_target(out_dir: Path, shape: dict, tokenizer_src: Path) -> Path:
    """A target directory with only config.json (the bench shape) and a tokenizer: enough for
    target.random_weights=true. The tiny tokenizer's ids are < 1024, so they fit any vocabulary."""
    from transformers import AutoTokenizer, Qwen3Config

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    tokenizer.model_max_length = shape["max_position_embeddings"]  # no "sequence too long" warnings
    tokenizer.save_pretrained(out_dir)
    fields = dict(shape)
    theta = fields.pop("rope_theta", None)
    if theta is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    Qwen3Config(tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, **fields).save_pretrained(out_dir)
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
                  work: Path) -> list[str]:
    """The hydra overrides shared by the drafter-alone stage (composed in-process) and the
    end-to-end launch, so both train exactly the same drafter."""
    over = [f"target.path={target_dir}", "target.build_tiny=false", "target.random_weights=true",
            f"drafter={'tiny' if tiny else 'dflash5'}", f"drafter.num_anchors={anchors}",
            f"data.paths=['{data_path}']", f"data.max_length={seq_len}", f"data.fixed_length={seq_len}",
            "data.eval_fraction=0", f"data.cache_dir={work / 'tokenized'}", "train.micro_batch_size=1",
            f"train.steps={steps}", "run.export=false", "run.progress=false"]
    if not tiny:  # the spec defaults [1, 9, 17, 25, 33] and Qwen3's mask token
        over += ["drafter.target_layer_ids=null", f"drafter.mask_token_id={QWEN3_MASK_TOKEN_ID}"]
    return over
