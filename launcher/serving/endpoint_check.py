"""What a server named by URL serves, checked before any prompt is sent to it: the model
target.path names (regenerate.endpoints, evaluate.endpoint, evaluate.plain_endpoint) and the
drafter it speculates with (evaluate.endpoint against evaluate.drafter).

The model. vLLM's /v1/models gives the path it was started with (`root`). When that path is a
model directory here (a server on this machine or a shared filesystem) it must be target.path, or
a copy of it: the same config.json but for the keys copies differ in (model_card.identifying_config).
Else (a server elsewhere, a hub name) the server tokenizes a probe text (vLLM's /tokenize), which
must give the ids the local tokenizer gives; the weights cannot be compared from here, and the log
says so, as it does when the server cannot tokenize on request (SGLang).

The drafter. vLLM 0.32 reports its --speculative-config only in its development mode
(VLLM_SERVER_DEV_MODE=1: /server_info): then the method, the draft length and the drafter are
compared (a drafter directory here by path, else by the digest of its weights). Otherwise its
Prometheus page still shows the draft length (one `position` label per draft token of
vllm:spec_decode_num_accepted_tokens_per_pos), so the block size is compared, and the log says the
drafter itself was not; the caller then records nothing in the export's model card.
"""
from __future__ import annotations

import logging
from pathlib import Path

from dflash_core.serving.export import CONFIG_NAME, WEIGHTS_NAME, weights_digest
from dflash_core.serving.model_card import identifying_config
from launcher.config import ConfigError
from launcher.serving.openai_client import OpenAIClient
from launcher.serving.vllm_server import parse_spec_counters

log = logging.getLogger("dflash")
# Words, digits, accents, CJK, an emoji and runs of whitespace: two tokenizers agree on all of it
# only if they are one tokenizer. The local tokenizer's end-of-turn token is appended to it.
PROBE_TEXT = "Speculative decoding: 1234567 + 89 = ?\n\tÜber café, naïve façade — 東京の天気 🚀  end."
_SHOWN = 3   # differing config keys named in an error


def _differences(ours: dict, theirs: dict) -> str:
    keys = sorted(key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key))
    said = "; ".join(f"{key}: served {theirs.get(key)!r}, target.path's {ours.get(key)!r}" for key in keys[:_SHOWN])
    return said + (f"; and {len(keys) - _SHOWN} more keys" if len(keys) > _SHOWN else "")


def check_serves_target(client: OpenAIClient, target: Path, tokenizer, setting: str) -> None:
    """A ConfigError naming both models unless the server at client.url serves the model of the
    directory `target` (see the module docstring); `setting` names the server's URL setting."""
    if not client.served:
        client.connect()
    served = str(client.served.get("root") or client.served.get("id"))
    there = Path(served)
    said = f"{setting}: the server at {client.url} serves {served!r}"
    remedy = "serve target.path there, or set target.path to the model the server serves"
    if (there / "config.json").is_file():
        if there.resolve() == target.resolve():
            return
        ours, theirs = identifying_config(target), identifying_config(there)
        if ours != theirs:
            raise ConfigError(f"{said}, not the model target.path={str(target)!r} names (config.json differs: "
                              f"{_differences(ours, theirs)}); {remedy}")
        log.info("%s, a copy of target.path=%s (the same config.json)", said, target)
        return
    text = PROBE_TEXT + (tokenizer.eos_token or "")
    theirs = client.tokenize(text)
    if theirs is None:
        log.info("%s, which is no model directory here, and it tokenizes nothing on request (no /tokenize): "
                 "whether it is target.path=%s is not checked", said, target)
        return
    ours = tokenizer.encode(text, add_special_tokens=False)
    if theirs != ours:
        at = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ConfigError(f"{said}, not the model target.path={str(target)!r} names: its tokenizer gives a probe "
                          f"text other ids (from token {at}: served {theirs[at:at + 4]}, target.path's "
                          f"{ours[at:at + 4]}); {remedy}")
    log.info("%s, which is no model directory here: its tokenizer is target.path=%s's (a probe text gives the "
             "same ids); its weights are not compared from here", said, target)


def check_serves_drafter(client: OpenAIClient, drafter: Path, block_size: int, setting: str) -> bool:
    """A ConfigError naming both unless the server at client.url speculates with the export in
    `drafter` of block size `block_size` (see the module docstring). -> whether the drafter itself
    was compared (False: only its block size was)."""
    counters = parse_spec_counters(client.metrics())
    if not counters["speculating"]:
        raise ConfigError(f"{setting}: the server at {client.url} exposes no vllm:spec_decode_* counters: it does "
                          f"not speculate (start it with --speculative-config, or leave {setting} unset)")
    config = client.server_config()
    named = f"evaluate.drafter={str(drafter)!r}"
    if config is None:
        positions = len(counters["per_position"])
        if positions and positions != block_size - 1:
            raise ConfigError(f"{setting}: the server at {client.url} drafts {positions} tokens per step (block size "
                              f"{positions + 1}), {named} has block size {block_size}: it speculates with another "
                              f"drafter; evaluate the drafter it serves, or serve {named} there")
        log.info("%s: the server at %s does not say which drafter it speculates with (vLLM does at /server_info when "
                 "started with VLLM_SERVER_DEV_MODE=1): only its block size was compared with %s's", setting,
                 client.url, named)
        return False
    spec = config.get("speculative_config") or {}
    method, tokens, served = spec.get("method"), spec.get("num_speculative_tokens"), spec.get("model")
    said = f"{setting}: the server at {client.url} speculates with {served!r} (method {method!r}, " \
           f"{tokens} draft tokens)"
    remedy = f"evaluate the drafter it serves, or serve {named} there"
    if method != "dflash" or tokens != block_size - 1:
        raise ConfigError(f"{said}, not with {named} (method 'dflash', {block_size - 1} draft tokens); {remedy}")
    there = Path(str(served))
    if not ((there / CONFIG_NAME).is_file() and (there / WEIGHTS_NAME).is_file()):
        log.info("%s, which is no export here: only its method and block size were compared with %s's", said, named)
        return False
    if there.resolve() != drafter.resolve():   # another directory: a copy holds the same weights
        digests = weights_digest(there), weights_digest(drafter)
        if digests[0] != digests[1]:
            raise ConfigError(f"{said}, not with {named} (other weights: {WEIGHTS_NAME} sha256 {digests[0][:16]} "
                              f"served, {digests[1][:16]} named); {remedy}")
    return True
