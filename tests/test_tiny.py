import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_core.target.mask_token import first_unused_token_id
from dflash_core.target.tiny import BUNDLED_DATASET, build_tiny_target
from tests.launching import REPO


def test_build_loads_back_as_a_qwen3_checkpoint(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    config = model.config
    assert config.model_type == "qwen3" and not config.tie_word_embeddings
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 4, 4)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (2, 32, 256)
    assert 1000 <= len(tokenizer) <= 2000
    assert config.vocab_size > len(tokenizer) and config.vocab_size % 64 == 0
    assert first_unused_token_id(tokenizer, config) == len(tokenizer)
    assert (tiny_target_dir / "model.safetensors").is_file()
    assert tokenizer.pad_token == "<|endoftext|>" and config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.eos_token == "<|im_end|>" and config.eos_token_id == tokenizer.eos_token_id
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):  # atomic, never split into bytes
        assert len(tokenizer(special, add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_is_chatml(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_build_is_idempotent(tiny_target_dir):
    before = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in tiny_target_dir.iterdir()}
    assert build_tiny_target(tiny_target_dir) == tiny_target_dir
    after = {f.name: (f.stat().st_mtime_ns, f.read_bytes()) for f in tiny_target_dir.iterdir()}
    assert after == before
    assert not list(tiny_target_dir.parent.glob(".*building*")), "staging directory left behind"


def test_build_is_deterministic_per_seed(tmp_path):
    """The same seed gives the same bytes (pretraining included: a few steps show it as well as 300)."""
    first = build_tiny_target(tmp_path / "first", seed=0, pretrain_steps=5)
    again = build_tiny_target(tmp_path / "again", seed=0, pretrain_steps=5)
    other = build_tiny_target(tmp_path / "other", seed=1, pretrain_steps=0)
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert json.loads((other / "tiny_build.json").read_text())["seed"] == 1


def test_build_refuses_a_foreign_non_empty_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="not a complete tiny-target build"):
        build_tiny_target(tmp_path)


def test_first_unused_token_id_is_the_first_spare_embedding_row():
    tokenizer = [None] * 1024  # only len() is used
    assert first_unused_token_id(tokenizer, SimpleNamespace(vocab_size=1088)) == 1024
    assert first_unused_token_id(tokenizer, SimpleNamespace(vocab_size=1024)) is None   # a full table: none


def test_bundled_dataset_is_reproduced_by_its_generator(tmp_path):
    assert BUNDLED_DATASET.stat().st_size < 400 * 1024
    regenerated = tmp_path / "tiny_chat.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_chat.py"), "--out", str(regenerated)],
                   check=True, capture_output=True)
    assert regenerated.read_bytes() == BUNDLED_DATASET.read_bytes()
    records = [json.loads(line) for line in BUNDLED_DATASET.read_text().splitlines()]
    assert 400 <= len(records) <= 600
    sharegpt = [r for r in records if "conversations" in r and "from" in r["conversations"][0]]
    preformatted = [r for r in records if "text" in r]
    assert 0.05 < len(sharegpt) / len(records) < 0.15 and len(preformatted) >= 3
