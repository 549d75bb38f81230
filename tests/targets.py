"""Targets the tests derive from the tiny one."""
import json
import shutil
from pathlib import Path


def other_family_copy(tmp_path: Path, target: Path) -> Path:
    """The target's files and shapes under a Llama config (what `target=tiny_llama` gives): another model to a
    check that compares configs, with weights and tokenizer that still load."""
    other = tmp_path / "tiny-llama"
    shutil.copytree(target, other)
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (other / "config.json").write_text(json.dumps(config))
    return other
