"""Tiny local targets: the embedded default (a small Qwen3 fitted to the bundled chats) and one
random tiny model per supported family (`conf/target/tiny_<family>.yaml`).

Everything is built locally (no model hub), deterministically from a seed, and written with
`save_pretrained`, so the rest of the code loads it exactly like a real checkpoint of its
family. The tokenizer follows Qwen3's conventions: ChatML turns, `<|im_end|>` ends a turn (eos),
`<|endoftext|>` pads, and the embedding table has unused rows after the tokenizer's ids so
the first one can serve as the drafter's mask token (Qwen3 uses 151669 the same way).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..data import read_records
from .mask_token import first_unused_token_id

BUNDLED_DATASET = Path(__file__).resolve().parents[1] / "assets" / "tiny_chat.jsonl"

PAD_TOKEN, CHAT_START, CHAT_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOKENIZER_VOCAB_SIZE = 1024  # byte-level BPE: 256 byte symbols, 3 specials, the rest merges
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_ATTENTION = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "max_position_embeddings": 1024}
# Hybrid stacks alternate so that capturing layers [0, 2] runs both kinds of token mixer.
_HYBRID = {"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
# Config fields of each family's tiny build: the family's own layout (experts, hybrid layers,
# sliding windows, rope scaling) at the smallest size that still exercises it.
TINY_SHAPES = {
    "qwen3": {"model_type": "qwen3", **_ATTENTION, "intermediate_size": 256},
    "qwen3_moe": {"model_type": "qwen3_moe", **_ATTENTION, **_EXPERTS, "intermediate_size": 256,
                  "mlp_only_layers": [0]},  # one dense layer beside the sparse ones
    "qwen3_5": {"model_type": "qwen3_5_text", **_ATTENTION, **_HYBRID, "intermediate_size": 256},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe_text", **_ATTENTION, **_HYBRID, **_EXPERTS,
                    "shared_expert_intermediate_size": 64},
    "llama": {"model_type": "llama", **_ATTENTION, "intermediate_size": 256, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "gpt_oss": {"model_type": "gpt_oss", **_ATTENTION, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 64, "sliding_window": 8,  # alternating sliding / full layers
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256}},
}
MODEL_SHAPE = {key: value for key, value in TINY_SHAPES["qwen3"].items() if key != "model_type"}
DEFAULT_FAMILY = "qwen3"
# Enough for the tiny target to follow its chats (how long they take: docs/perf_notes.md, "Figures the code quoted").
PRETRAIN_STEPS = 300
PRETRAIN_THREADS = 2
BUILD_MARKER = "tiny_build.json"  # written last: its presence means the directory is complete


def _training_texts(dataset: Path):
    """The strings the tokenizer learns from: message contents, role names and plain texts."""
    yield "system user assistant"
    for _, record in read_records(dataset):
        if record.text is not None:
            yield record.text
        else:
            yield from (message["content"] for message in record.messages)


def _train_tokenizer(dataset: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB_SIZE, special_tokens=[PAD_TOKEN, CHAT_START, CHAT_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_training_texts(dataset), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=PAD_TOKEN, eos_token=CHAT_END,
                                   additional_special_tokens=[CHAT_START], chat_template=CHAT_TEMPLATE,
                                   model_max_length=MODEL_SHAPE["max_position_embeddings"])


def _random_model(tokenizer, seed: int, family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_SHAPES:
        raise ValueError(f"no tiny build for family {family!r}; choose one of {sorted(TINY_SHAPES)}")
    # One spare row at least, rounded up to a multiple of 64 like real checkpoints pad their tables.
    vocab_size = (len(tokenizer) // 64 + 1) * 64
    config = AutoConfig.for_model(**TINY_SHAPES[family], vocab_size=vocab_size, tie_word_embeddings=False,
                                  pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def _is_complete(path: Path) -> bool:
    return (path / BUILD_MARKER).is_file()


def _pretrain(model, tokenizer, *, steps: int, seed: int, batch_size: int = 16, lr: float = 3e-3) -> float | None:
    """A short language-model fit on the bundled chats, so the tiny target answers like its data
    (a random target babbles, and nothing a drafter learns from the data would be accepted)."""
    if steps <= 0:
        return None
    from ..data import MicroBatchSource, load_samples
    samples, _ = load_samples([BUNDLED_DATASET], tokenizer, max_length=256)
    source = MicroBatchSource(samples, micro_batch_size=batch_size, seed=seed, pad_token_id=tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    # CPU kernels split reductions by thread count: fix it so a seed always builds the same bytes.
    threads = torch.get_num_threads()
    torch.set_num_threads(PRETRAIN_THREADS)
    try:
        for step in range(steps):
            batch = source.batch(step)
            labels = batch.input_ids.masked_fill(batch.input_ids == tokenizer.pad_token_id, -100)
            loss = model(input_ids=batch.input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    return float(loss.detach())


def build_tiny_target(out_dir, *, seed: int = 0, family: str = DEFAULT_FAMILY,
                      pretrain_steps: int | None = None) -> Path:
    """Build a tiny target of `family` into out_dir (tokenizer + model), or return it if already built.

    pretrain_steps None: the embedded qwen3 default is fitted to the bundled chats
    (PRETRAIN_STEPS); the other families stay random, which is all that loading, capture,
    packing, tensor parallelism and a training launch need.

    The build goes to a temporary sibling directory that is renamed into place, so a crash or
    a concurrent build never leaves a half-written out_dir.
    """
    out_dir = Path(out_dir)
    if _is_complete(out_dir):
        built = json.loads((out_dir / BUILD_MARKER).read_text()).get("family", DEFAULT_FAMILY)
        if built != family:
            raise FileExistsError(f"{out_dir} holds a tiny {built} target, not the {family} one asked for; "
                                  f"remove it or pick another directory")
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists but is not a complete tiny-target build; "
                              f"remove it or pick another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.building-"))
    try:
        tokenizer = _train_tokenizer(BUNDLED_DATASET)
        tokenizer.save_pretrained(staging)
        model = _random_model(tokenizer, seed, family)
        if pretrain_steps is None:
            pretrain_steps = PRETRAIN_STEPS if family == DEFAULT_FAMILY else 0
        final_loss = _pretrain(model, tokenizer, steps=pretrain_steps, seed=seed)
        model.save_pretrained(staging)
        info = {"family": family, "seed": seed, "tokens": len(tokenizer), "vocab_size": model.config.vocab_size,
                "pretrain_steps": pretrain_steps, "pretrain_final_loss": final_loss,
                "mask_token_id": first_unused_token_id(tokenizer, model.config),
                "parameters": sum(p.numel() for p in model.parameters())}
        (staging / BUILD_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above): rename cannot replace a directory
        os.rename(staging, out_dir)
    except OSError:
        if _is_complete(out_dir):  # another process finished the same build first
            return out_dir
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir
