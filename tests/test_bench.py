"""The benchmark harness (launcher/bench/) on CPU: its FLOP count against a hand count, the
stage-balance advice, the thread baseline's failure counting, and the whole `--tiny` harness."""
import json
import os
import subprocess
import sys

import pytest

from dflash_core.target.families import drafter_config_for_target
from launcher.bench.counts import (
    balance_advice,
    drafter_step_flops,
    drafter_step_flops_breakdown,
    drafter_step_min_bytes,
    target_forward_flops,
)
from launcher.bench.report import format_table
from tests.drafters import drafter_config, qwen3_8b_drafter_config
from tests.launching import REPO


def toy_config():
    return drafter_config(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          intermediate_size=16, vocab_size=32, mask_token_id=31)


def test_drafter_step_flops_matches_a_hand_count():
    cfg = toy_config()
    # One layer's matmul weights: q 8x8, k 8x4, v 8x4, o 8x8, MLP 3 x 8x16.
    layer = 64 + 32 + 32 + 64 + 384
    queries = 2 * 4                                   # 2 blocks of 4 slots
    layers = 6 * layer * queries * 2                  # fwd + 2 bwd, 2 layers
    head = 4 * 32 * 8 * queries                       # frozen LM head: fwd + input grad
    # Blocks at 2 and 5 see (2 + 4) and (5 + 4) keys per query; 4 queries each; QK and PV.
    attention = 3 * 2 * (4 * 2 * 4) * 4 * ((2 + 4) + (5 + 4))
    context_kv = 6 * (2 * 8 * 4) * 10 * 2             # k, v of 10 context tokens, 2 layers
    fc = 6 * (2 * 8 * 8) * 10                         # L*H x H per context token
    parts = drafter_step_flops_breakdown(cfg, 10, [2, 5])
    assert parts == {"layers": layers, "lm_head": head, "attention": attention, "context_kv": context_kv, "fc": fc,
                     "total": layers + head + attention + context_kv + fc}
    assert drafter_step_flops(cfg, 10, [2, 5]) == 90368
    # An anchor count uses the mean anchor of uniform candidates 0..S-2: (S-2)/2 = 4.
    assert drafter_step_flops(cfg, 10, 2) == drafter_step_flops(cfg, 10, [4, 4])


def test_min_bytes_and_target_flops_by_hand():
    cfg = toy_config()
    params = 2 * 576 + 2 * 8 * 8
    assert drafter_step_min_bytes(cfg, 10) == {"features": 10 * 16 * 2, "lm_head": 32 * 8 * 2,
                                               "params_and_adamw": 32 * params,
                                               "total": 320 + 512 + 32 * params}

    class HF:
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size = 8, 2, 1, 4, 16
    # 3 kept layers, S=5: 2 * 576 * 3 * 5 matmul FLOPs + 3 * 4 * 2 * 4 * (5 * 6 / 2) causal attention.
    assert target_forward_flops(HF, 3, 5) == 2 * 576 * 3 * 5 + 3 * 4 * 2 * 4 * 15


def test_production_numbers_in_perf_notes_hold():
    """docs/perf_notes.md quotes the Qwen3-8B drafter step: 75.1 TFLOP, 35.0 GB at S=4096, 512 anchors."""
    cfg = qwen3_8b_drafter_config()
    assert round(drafter_step_flops(cfg, 4096, 512) / 1e12, 1) == 75.1
    assert round(drafter_step_min_bytes(cfg, 4096)["total"] / 1e9, 1) == 35.0
    notes = (REPO / "docs" / "perf_notes.md").read_text()
    assert "75.1 TFLOP" in notes and "35.0 GB" in notes


def test_bench_shape_composes_the_production_drafter(tmp_path, tiny_target_dir):
    """The overrides the GPU run uses give exactly the Qwen3-8B dflash5 drafter."""
    import dataclasses

    from dflash_core.target.shapes import SHAPES
    from launcher.bench.inputs import run_overrides, write_bench_target
    from launcher.config import compose_config
    from launcher.resolve import drafter_config

    target = write_bench_target(tmp_path / "target", "qwen3-8b", tiny_target_dir)
    cfg = compose_config(run_overrides(target_dir=target, data_path=tmp_path / "d.jsonl", seq_len=4096, steps=5,
                                       tiny=False, anchors=512, work=tmp_path,
                                       mask_token_id=SHAPES["qwen3-8b"].mask_token_id))
    from transformers import AutoConfig
    got = dataclasses.asdict(drafter_config(cfg, AutoConfig.from_pretrained(target)))
    want = dataclasses.asdict(qwen3_8b_drafter_config())
    assert got == {**want, "rms_norm_eps": got["rms_norm_eps"]}
    assert cfg.drafter.num_anchors == 512 and cfg.data.fixed_length == 4096 and cfg.target.random_weights


def test_balance_advice_on_made_up_rates():
    assert balance_advice(30000, 10000, 8) == (2, 6, 60000)
    assert balance_advice(10000, 10000, 8) == (4, 4, 40000)
    assert balance_advice(10000, 30000, 8)[:2] == (6, 2)
    assert balance_advice(5000, 7000, 2) == (1, 1, 5000)
    assert balance_advice(10, 10, 3) == (1, 2, 10)     # a tie goes to more drafters
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        balance_advice(1, 1, 1)


def test_option_rows_say_how_much_faster_than_the_plain_row_of_their_length_and_what_to_do():
    from launcher.bench.option_rows import against_bf16
    from launcher.bench.report import Row
    rows = [{"n": Row.DRAFTER, "seq_len": 2048, "ms_per_step": 60.0}, {"n": Row.DRAFTER, "seq_len": 4096,
                                                                      "ms_per_step": 130.0}]
    faster = against_bf16({"n": Row.FP8_DRAFTER, "seq_len": 4096, "ms_per_step": 104.0, "notes": "peak"}, rows)
    assert faster["speedup_vs_bf16"] == pytest.approx(1.25)
    assert faster["notes"].startswith("1.25x the step of row 3: train with drafter.matmul_precision=fp8")
    assert faster["notes"].endswith("; peak")
    slower = against_bf16({"n": Row.FP8_DRAFTER, "seq_len": 2048, "ms_per_step": 75.0}, rows)
    assert "0.80x" in slower["notes"] and "leave drafter.matmul_precision at its default here" in slower["notes"]
    # 1.008x: within the step time's run-to-run spread
    level = against_bf16({"n": Row.FP8_DRAFTER, "seq_len": 4096, "ms_per_step": 129.0}, rows)
    assert level["notes"].startswith("1.01x the step of row 3: leave drafter.matmul_precision at its default here")
    alone = {"n": Row.FP8_DRAFTER, "seq_len": 8192, "ms_per_step": 200.0}
    assert against_bf16(alone, rows) == alone   # no bf16 row of that length: nothing to compare


def test_format_table_lists_every_row():
    table = format_table([{"n": 1, "row": "matmul ceiling", "tflops": 1.5, "mfu": 1.0, "notes": "x"},
                          {"n": 4, "row": "end to end", "notes": "skipped"}])
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].startswith("#") and "1.50" in lines[1] and lines[2].endswith("skipped")


def _baseline_spec(tiny_target_dir, tmp_path, **overrides):
    import dataclasses

    from dflash_core.target.tiny import MODEL_SHAPE
    from launcher.bench.inputs import write_bench_target
    target = write_bench_target(tmp_path / "target", {**MODEL_SHAPE, "vocab_size": 1088}, tiny_target_dir)
    from transformers import AutoConfig
    cfg = drafter_config_for_target(AutoConfig.from_pretrained(target), num_layers=1, block_size=4,
                                    mask_token_id=1024, target_layer_ids=[0, 2])
    spec = {"target_dir": str(target), "drafter_config": dataclasses.asdict(cfg), "seq_len": 32, "num_anchors": 8,
            "chunk_blocks": 4, "items_per_thread": 2, "target_device": "cpu", "drafter_devices": ["cpu", "cpu"],
            "backend": "sdpa", "fx_noise": False, "timeout_s": 60, "seed": 0, "lr": 1e-3}
    return {**spec, **overrides}


def test_thread_baseline_counts_steps_with_fx_noise(tmp_path, tiny_target_dir):
    from launcher.bench.thread_baseline import run_baseline
    result = run_baseline(_baseline_spec(tiny_target_dir, tmp_path, fx_noise=True))
    # FX's module-call patcher is process-global: even eager sdpa steps (and the target's forward)
    # beside a symbolic_trace loop can fail. Whatever happened, every item is accounted for.
    assert result["steps_attempted"] == 4 and result["steps_done"] + result["failures"] == 4
    assert sum(result["failure_kinds"].values()) == result["failures"]
    assert result["fx_traces"] > 0 and result["hung_threads"] == 0 and result["tokens"] == 32 * result["steps_done"]


def test_thread_baseline_counts_failures_and_keeps_going(tmp_path, tiny_target_dir):
    """CPU flex has no backward: every step raises, each is counted by its message, no thread dies."""
    from launcher.bench.thread_baseline import run_baseline
    result = run_baseline(_baseline_spec(tiny_target_dir, tmp_path, backend="flex"))
    assert result["steps_attempted"] == 4 and result["steps_done"] == 0 and result["failures"] == 4
    (kind, count), = result["failure_kinds"].items()
    assert count == 4 and kind.startswith("RuntimeError: flex backend has no backward on CPU")
    assert result["hung_threads"] == 0


# ------------------------------------------------------------------------------ new shapes
@pytest.mark.parametrize("shape, config_class, mask, layer_ids, intermediate", [
    ("qwen3.5-35b-a3b", "Qwen3_5MoeTextConfig", "auto", [1, 10, 19, 28, 37], 3 * 2048),
    ("llama3-8b", "LlamaConfig", 128002, [1, 8, 15, 22, 29], 14336)])
def test_new_shapes_write_their_own_config_class_and_drafter(tmp_path, tiny_target_dir, shape, config_class, mask,
                                                             layer_ids, intermediate):
    from transformers import AutoConfig

    from dflash_core.target.shapes import SHAPES
    from launcher.bench.inputs import run_overrides, write_bench_target
    from launcher.config import compose_config
    from launcher.resolve import drafter_config

    target = write_bench_target(tmp_path / "target", shape, tiny_target_dir)
    hf = AutoConfig.from_pretrained(target)
    assert type(hf).__name__ == config_class and hf.num_hidden_layers == {"llama3-8b": 32}.get(shape, 40)
    assert (SHAPES[shape].mask_token_id or "auto") == mask
    cfg = compose_config(run_overrides(target_dir=target, data_path=tmp_path / "d.jsonl", seq_len=4096, steps=5,
                                       tiny=False, anchors=512, work=tmp_path, mask_token_id=mask))
    dcfg = drafter_config(cfg, hf)
    assert dcfg.target_layer_ids == layer_ids and dcfg.intermediate_size == intermediate
    assert dcfg.mask_token_id == (1024 if mask == "auto" else mask)   # auto: the tiny tokenizer's first unused id


# ------------------------------------------------------------------------------ target FLOPs per family
def _tiny_config(family, **overrides):
    from transformers import AutoConfig

    from dflash_core.target.tiny import TINY_SHAPES
    return AutoConfig.for_model(**{**TINY_SHAPES[family], "vocab_size": 1088, **overrides})


def test_target_flops_of_moe_and_linear_attention_by_hand():
    """Tiny Qwen3.5-MoE: hidden 128; linear-attention layers (2 key heads, 4 value heads of 32) and
    gated full attention (4 heads, 2 kv heads of 32) alternate; 4 experts of width 64, top 2, and a
    shared expert of width 64 with its sigmoid gate."""
    from launcher.bench.counts import target_forward_flops_breakdown

    linear = 128 * (2 * 64 + 128) + 128 * 128 + 2 * 128 * 4 + 128 * 128   # qkv, z, b and a, out
    attention = 128 * 128 * 2 + 2 * 128 * 64 + 128 * 128                  # q with its gate, k, v, o
    moe = 128 * 4 + 2 * 3 * 128 * 64 + (3 * 128 * 64 + 128)                # router, top-2 experts, shared + gate
    recurrence = 6 * 4 * 32 * 32 + 2 * (2 * 64 + 128) * 4                 # per token: state, short conv
    parts = target_forward_flops_breakdown(_tiny_config("qwen3_5_moe"), 2, 5, documents=[2, 3])
    assert parts == {"matmuls": 2 * (linear + moe + attention + moe) * 5, "recurrence": recurrence * 5,
                     "attention": 4 * 4 * 32 * (3 + 6), "total": parts["total"]}
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    # A composite (multimodal) config counts its text decoder.
    from transformers import AutoConfig
    composite = AutoConfig.for_model("qwen3_5_moe", text_config=_tiny_config("qwen3_5_moe").to_dict())
    assert target_forward_flops_breakdown(composite, 2, 5, documents=[2, 3]) == parts


def test_target_flops_of_dense_sliding_and_partly_sparse_stacks_by_hand():
    from launcher.bench.counts import target_forward_flops

    attention = 128 * 128 + 2 * 128 * 64 + 128 * 128     # 4 heads x 32, 2 kv heads: q, k, v, o
    # Llama 3 (no q/k norms; they cost no matmul anyway): dense MLP of width 256.
    assert target_forward_flops(_tiny_config("llama"), 1, 10) == 2 * (attention + 3 * 128 * 256) * 10 \
        + 4 * 4 * 32 * 55
    # Qwen3-MoE with mlp_only_layers=[0]: layer 0 dense, layer 1 router + top-2 of 4 experts of width 64.
    sparse = 128 * 4 + 2 * 3 * 128 * 64
    assert target_forward_flops(_tiny_config("qwen3_moe"), 2, 10) == 2 * (2 * attention + 3 * 128 * 256 + sparse) * 10 \
        + 2 * 4 * 4 * 32 * 55
    # gpt-oss: layer 0 slides a window of 8 keys (10 queries see 1..8, 8, 8: 52 keys), layer 1 is full.
    experts = 128 * 4 + 2 * 3 * 128 * 64
    assert target_forward_flops(_tiny_config("gpt_oss"), 2, 10) == 2 * 2 * (attention + experts) * 10 \
        + 4 * 4 * 32 * (52 + 55)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "llama", "gpt_oss"])
def test_target_weights_per_token_equal_the_models_own_modules(family):
    """Per layer: every Linear weight, the router's, and top_k/num_experts of the experts' 3-D weights,
    counted on the transformers model itself (meta device: no memory)."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    from launcher.bench.counts import layer_weights_per_token

    config = _tiny_config(family)
    with torch.device("meta"):
        layers = AutoModelForCausalLM.from_config(config).get_decoder().layers
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(layers)
    for index, layer in enumerate(layers):
        counted = 0
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                counted += module.weight.numel()
            elif isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):   # experts, as 3-D weights
                counted += (module.gate_up_proj.numel() + module.down_proj.numel()) * config.num_experts_per_tok \
                    // config.num_experts
            elif name.endswith(("gate", "router")) and isinstance(getattr(module, "weight", None), nn.Parameter):
                counted += module.weight.numel()
        assert layer_weights_per_token(config, index, kinds[index]) == counted, (family, index)


def test_documents_of_position_ids():
    import torch

    from launcher.bench.counts import documents_of
    assert documents_of(torch.tensor([0, 1, 2, 0, 1, 0])) == [3, 2, 1]
    assert documents_of(torch.arange(7)) == [7]


# ------------------------------------------------------------------------------ the ceiling
def _fake_clock(step_s):
    now = [0.0]

    def clock():
        now[0] += step_s / 2   # two readings per measured loop
        return now[0]
    return clock


def test_implausible_ceiling_is_an_error_row_and_mfu_disappears():
    import torch

    from launcher.bench.ceiling import matmul_ceiling, rate_fields, usable_ceiling
    # 256^3 fp32 products timed at 1 us for 20 of them: ~670 TFLOP/s against a peak of 10.
    row = matmul_ceiling(torch.device("cpu"), tiny=True, size=256, peak=10.0, peak_source="test peak",
                         clock=_fake_clock(1e-6))
    assert row["remeasured"] and row["reps"] == 100 and row["tflops"] > 10.0 and row["mfu"] is None
    assert "exceeds the plausible peak 10" in row["error"] and row["notes"].startswith("ERROR")
    assert usable_ceiling(row) is None
    fields = rate_fields(1e12, 0.5, usable_ceiling(row))
    assert fields["mfu"] is None and fields["tflops"] == 2.0
    table = format_table([{"n": 1, "row": "matmul ceiling", **row}, {"n": 3, "row": "drafter", **fields}])
    assert table.splitlines()[2].split()[8:10] == ["2.00", "-"]   # TFLOP/s and MFU of the drafter row


def test_plausible_ceiling_is_used_and_a_first_bad_timing_is_remeasured():
    import torch

    from launcher.bench.ceiling import matmul_ceiling, usable_ceiling
    ok = matmul_ceiling(torch.device("cpu"), tiny=True, size=256, peak=1e9, peak_source="test",
                        clock=_fake_clock(1.0))
    assert "error" not in ok and not ok["remeasured"] and usable_ceiling(ok) == ok["tflops"]
    readings = iter([0.0, 1e-9, 0.0, 1000.0])   # first loop implausibly fast, the re-measurement slow
    again = matmul_ceiling(torch.device("cpu"), tiny=True, size=256, peak=1.0, peak_source="test",
                           clock=lambda: next(readings))
    assert again["remeasured"] and "error" not in again and again["tflops"] < 1.0 < again["first_tflops"]


def test_plausible_peaks_by_device_name():
    from launcher.bench.ceiling import plausible_peak
    assert plausible_peak("NVIDIA H200") == plausible_peak("NVIDIA H100 80GB HBM3") == 989.0
    assert plausible_peak("NVIDIA A100-SXM4-80GB") == 312.0 and plausible_peak("NVIDIA B200") == 2250.0
    assert plausible_peak("NVIDIA H20") is None and plausible_peak("cpu") is None


# ------------------------------------------------------------------------------ length mixes
def test_builtin_mix_is_chat_like_and_capped():
    import statistics

    from launcher.bench.mix import builtin_mix
    mix = builtin_mix(2000, seed=1)
    assert mix == builtin_mix(2000, seed=1) and mix != builtin_mix(2000, seed=2)
    assert statistics.median(mix.answers) < 512 and max(mix.answers) > 4096   # short median, long reasoning tail
    capped = mix.capped(4096)
    assert max(p + a for p, a in zip(capped.prompts, capped.answers)) == 4096 and min(capped.answers) >= 2
    assert capped.prompts == tuple(min(p, 4094) for p in mix.prompts)


def test_mix_rows_padded_and_packed_through_the_real_micro_batch_source():
    import torch

    from launcher.bench.mix import LengthMix, MixError, mix_batches, synthesize_samples
    mix = LengthMix("test", prompts=(3, 10, 5, 1) * 4, answers=(4, 20, 2, 30) * 4)
    samples = synthesize_samples(mix, id_limit=100)
    assert [int(s["loss_mask"].sum()) for s in samples] == list(mix.answers)
    assert all(int(s["input_ids"].max()) < 100 and s["loss_mask"][:p].sum() == 0
               for s, p in zip(samples, mix.prompts))
    padded = mix_batches(samples, mode="padded", seq_len=64, count=5, pad_token_id=0, num_anchors=8)
    packed = mix_batches(samples, mode="packed", seq_len=64, count=5, pad_token_id=0, num_anchors=8)
    assert [b.input_ids.shape for b in padded.batches + packed.batches] == [torch.Size([1, 64])] * 10
    assert padded.real_tokens == [sum(len(samples[i]["input_ids"]) for row in b.sample_ids for i in row)
                                  for b in padded.batches]
    # 300 tokens: 16 padded rows (71% padding) or 5 packed rows of 64 (two of 31 + 31, two of 30 + 30,
    # one of eight 7-token samples: 6% padding).
    assert padded.padding_fraction == pytest.approx(1 - 300 / (16 * 64))
    assert packed.padding_fraction == pytest.approx(1 - 300 / (5 * 64))
    # Anchor candidates per answer: 3, 19, 1, 29 -> min(., 8) fills 3, 8, 1, 8 of 8 slots when padded.
    assert padded.epoch_anchor_fill == pytest.approx((3 + 8 + 1 + 8) / 32)
    assert packed.epoch_anchor_fill > 0.9 and all((b.position_ids == 0).sum() > 1 for b in packed.batches)
    with pytest.raises(MixError, match="unknown mode 'sorted'"):
        mix_batches(samples, mode="sorted", seq_len=64, count=1, pad_token_id=0, num_anchors=8)


def test_conversation_file_realises_the_mix_and_reads_back_as_lengths(tmp_path, tiny_target_dir):
    """The e2e rows' data file tokenises (as training does) to exactly the mix's prompt and answer
    lengths, and --lengths reads them back."""
    from dflash_core.data import load_tokenizer
    from launcher.bench.inputs import write_mix_conversations
    from launcher.bench.mix import LengthMix, mix_from_file
    mix = LengthMix("test", prompts=(12, 40, 100, 13), answers=(2, 9, 300, 50))
    realised, info = write_mix_conversations(tmp_path / "mix.jsonl", mix, tiny_target_dir, max_length=512)
    assert info["mismatched"] == 0 and info["kept"] == 4 and info["prompt_overhead"] < 12
    assert (realised.prompts, realised.answers) == (mix.prompts, mix.answers)
    back = mix_from_file(tmp_path / "mix.jsonl", load_tokenizer(tiny_target_dir), max_length=512, count=10)
    assert sorted(zip(back.prompts, back.answers)) == sorted(zip(mix.prompts, mix.answers))
    # A prompt shorter than the chat template's own tokens cannot be realised: it is reported.
    _, short = write_mix_conversations(tmp_path / "short.jsonl", LengthMix("t", (1,), (5,)), tiny_target_dir,
                                       max_length=512)
    assert short["mismatched"] == 1 and short["max_token_error"] == short["prompt_overhead"]


# ------------------------------------------------------------------------------ stage rows in process
@pytest.fixture
def tiny_job(tmp_path, tiny_target_dir, one_thread):
    import torch

    from dflash_core.target.tiny import MODEL_SHAPE
    from launcher.bench.inputs import run_overrides, write_bench_target
    from launcher.config import compose_config
    from launcher.distributed.topology import Topology
    from launcher.resolve import resolve

    target = write_bench_target(tmp_path / "target", {**MODEL_SHAPE, "vocab_size": 1088}, tiny_target_dir)
    cfg = compose_config(run_overrides(target_dir=target, data_path=tmp_path / "d.jsonl", seq_len=64, steps=4,
                                       tiny=True, anchors=8, work=tmp_path) + ["run.device=cpu"])
    return resolve(cfg, Topology(num_targets=0, num_drafters=1), torch.device("cpu"))


def _mix_workloads(num_anchors):
    from launcher.bench.mix import LengthMix, mix_batches, synthesize_samples
    from launcher.bench.stages import mix_workload
    samples = synthesize_samples(LengthMix("t", (3, 10, 5, 1) * 4, (4, 20, 2, 30) * 4), id_limit=1000)
    return [mix_workload(mix_batches(samples, mode=mode, seq_len=64, count=4, pad_token_id=0,
                                     num_anchors=num_anchors), 64) for mode in ("padded", "packed")]


def test_drafter_and_target_rows_on_padded_and_packed_mixes(tmp_path, tiny_job):
    from launcher.bench.stages import drafter_stage, full_row_workload, target_stage
    workloads = [full_row_workload(64, 1000, 8)] + _mix_workloads(8)
    drafter = drafter_stage(tiny_job, workloads, work=tmp_path, warmup=1, steps=3, ceiling=1.0)
    assert [r["row"] for r in drafter] == ["drafter alone, full rows", "drafter alone, padded mix",
                                           "drafter alone, packed mix"]
    full, padded, packed = drafter
    assert full["anchor_fill"] == 1.0 and full["padding_fraction"] == 0.0
    assert padded["anchor_fill"] < packed["anchor_fill"] <= 1.0 and padded["padding_fraction"] > 0.5
    for r in drafter:   # blocks/s is the fill of the anchor slots per second, and MFU follows step time
        assert r["supervised_blocks_per_s"] == pytest.approx(r["anchor_fill"] * 8 * r["samples_per_s"])
        assert r["mfu"] == pytest.approx(r["flops_per_step"] / (r["ms_per_step"] / 1e3) / 1e12)
        assert r["compiles_stable"] and set(r["compile_report"]) == {"graphs", "seconds", "phases", "caches"}
    target = target_stage(tiny_job.target.hf_config, tiny_job.target.layer_ids, tiny_job.device, tiny_job.target.dtype,
                          workloads, warmup=1, reps=3, ceiling=None)
    assert [r["mode"] for r in target] == ["full", "padded", "packed"] and "full_forward_ms" in target[0]
    assert all(r["mfu"] is None and r["tokens_per_s"] > 0 for r in target)
    assert target[1]["padding_fraction"] > target[2]["padding_fraction"]
    # Packed rows count attention per document: fewer FLOPs than the same row as one sequence.
    assert target[2]["flops_per_step"] < target[0]["flops_per_step"]


def test_target_row_reports_the_familys_kernel_notes(one_thread):
    import torch

    from dflash_core.target.families import kernel_notes
    from launcher.bench.stages import full_row_workload, target_stage
    config = _tiny_config("qwen3_5")
    row, = target_stage(config, [0, 2], torch.device("cpu"), torch.float32, [full_row_workload(16, 1000, 4)],
                        warmup=0, reps=1, ceiling=None, full_forward=False)
    assert row["kernel_notes"] == kernel_notes(config) and row["kernel_notes"]   # fla is not installed here
    assert "kernel notes: python module fla not installed" in row["notes"]


# ------------------------------------------------------------------------------ end to end and balance rows
def _summary(steady, tokens, valid, items, wall=10.0):
    ranks = [{"role": "target", "rank": 0, "tokens": tokens, "forward_s": 2.0},
             {"role": "drafter", "rank": 1, "tokens": tokens, "valid_anchors": valid, "items": items}]
    return {"steady_tokens_per_s": steady, "ranks": ranks, "anchor_fill": 0.97, "target_padding_fraction": 0.04,
            "target_idle_fraction": 0.1, "drafter_idle_fraction": 0.01, "channel_gb_per_s": 0.2, "compiles": {"1": 4},
            "compile_s": {"1": 9.0}, "compile_report": {"graphs": {}}, "tokens_per_s": steady * 0.9, "steps": items,
            "wall_s": wall}


def test_e2e_row_blocks_per_drafter_and_pipeline_efficiency():
    from launcher.bench.rows import e2e_row
    from launcher.distributed.topology import Topology
    rates = {("target", "packed", 4096): 30000.0, ("drafter", "packed", 4096): 20000.0}
    # 40 steps of 3,900 real tokens and 500 valid anchors each, at 19,500 real tokens/s steady.
    row = e2e_row(9, _summary(19500.0, 40 * 3900, 40 * 500, 40), 4096, "packed", rates, Topology(1, 1))
    assert row["supervised_blocks_per_s"] == pytest.approx(2500.0) and row["ms_per_step"] == pytest.approx(200.0)
    assert row["pipeline_efficiency"] == pytest.approx(19500 / 20000) and row["target_tokens_per_s_per_gpu"] == 19500
    assert row["target_forward_tokens_per_s_per_gpu"] == pytest.approx(40 * 3900 / 2.0)
    assert row["anchor_fill"] == 0.97 and row["padding_fraction"] == 0.04 and row["compiles_per_drafter"] == {"1": 4}
    two = e2e_row(9, _summary(19500.0, 40 * 3900, 40 * 500, 20), 4096, "packed", rates, Topology(1, 2))
    assert two["supervised_blocks_per_s"] == pytest.approx(1250.0) and two["pipeline_efficiency"] == 19500 / 30000
    assert e2e_row(9, _summary(1.0, 1, 1, 1), 4096, "padded", rates, Topology(1, 1))["pipeline_efficiency"] is None


def test_balance_rows_per_mode_and_stage_rates_from_json(tmp_path):
    from launcher.bench.rows import balance_rows, load_stage_rates, stage_rates
    rows = [{"stage": "target", "mode": "packed", "seq_len": 4096, "epoch_tokens_per_s": 30000.0},
            {"stage": "drafter", "mode": "packed", "seq_len": 4096, "epoch_tokens_per_s": 10000.0,
             "epoch_supervised_blocks_per_s": 1250.0},
            {"stage": "target", "mode": "padded", "seq_len": 4096, "epoch_tokens_per_s": 6000.0}]
    rates = stage_rates(rows)
    assert rates[("blocks_per_token", "packed", 4096)] == 0.125
    balance, = balance_rows(10, rates, 2, "qwen3-8b")   # the padded mode lacks a drafter rate: no row
    assert balance["advice"] == {"2": "t1d1", "8": "t2d6"} and balance["tokens_per_s_8_gpus"] == 60000.0
    assert balance["supervised_blocks_per_s_8_gpus"] == 7500.0 and balance["notes"].startswith("qwen3-8b: ")
    (tmp_path / "b.json").write_text(json.dumps({"rows": rows}))
    assert load_stage_rates(tmp_path / "b.json") == rates
    (tmp_path / "empty.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="no target or drafter stage rows"):
        load_stage_rates(tmp_path / "empty.json")


def test_bad_bench_flags_are_clear_errors(capsys):
    from launcher.bench.options import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--modes", "padded,sorted"])
    assert "--modes 'padded,sorted': choose from padded, packed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--mix-only", "--no-mix"])
    assert "exclude each other" in capsys.readouterr().err
    args = parse_args(["--tiny", "--seq", "32,96", "--modes", "packed"])
    assert args.mix_seq == 96 and args.modes == ["packed"] and args.mix_samples == 160


# ------------------------------------------------------------------------------ the whole harness
@pytest.mark.multiproc
def test_tiny_harness_end_to_end(tmp_path, tiny_target_dir):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "launcher.bench", "--tiny", "--out", str(out), "--seq", "128",
                           "--modes", "packed", "--tokenizer", str(tiny_target_dir), "--work-dir", str(tmp_path / "w")],
                          cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    by_n = {}
    for r in rows:
        by_n.setdefault(r["n"], []).append(r)
    assert sorted(by_n) == list(range(1, 13))
    assert all(r["notes"].startswith("skipped: cpu has no FP8") for r in by_n[11] + by_n[12])   # no FP8 on CPU
    ceiling = by_n[1][0]["tflops"]
    assert ceiling > 0 and by_n[1][0]["mfu"] == 1.0
    for r in by_n[2] + by_n[3] + by_n[7] + by_n[8]:   # MFU = FLOPs / step time / ceiling, row by row
        assert r["mfu"] == pytest.approx(r["flops_per_step"] / (r["ms_per_step"] / 1e3) / 1e12 / ceiling)
        assert r["tokens_per_s"] > 0 and r["seq_len"] == 128
    assert by_n[2][0]["full_forward_ms"] > 0 and by_n[3][0]["compiles_stable"]
    drafter_mix, = by_n[8]
    assert drafter_mix["mode"] == "packed" and 0 < drafter_mix["anchor_fill"] <= 1
    assert drafter_mix["supervised_blocks_per_s"] > 0 and "phases" in drafter_mix["compile_report"]
    e2e, e2e_mix = by_n[4][0], by_n[9][0]
    assert e2e["row"] == "end to end t1d1, full rows" and e2e["pipeline_efficiency"] > 0
    assert 0 <= e2e["target_idle_fraction"] <= 1 and e2e["channel_gb_per_s"] > 0
    assert list(e2e["compiles_per_drafter"]) == ["1"] and e2e["compile_s_per_drafter"]["1"] > 0
    assert e2e_mix["row"] == "end to end t1d1, packed mix" and e2e_mix["supervised_blocks_per_s"] > 0
    assert 0 < e2e_mix["anchor_fill"] <= 1 and e2e_mix["padding_fraction"] < 0.5 and e2e_mix["pipeline_efficiency"] > 0
    mix = report["meta"]["mix"]
    assert mix["nominal"]["source"] == "built-in" and mix["kept"] == mix["conversations"] == 160
    assert all(r["advice"]["2"] == "t1d1" and r["advice"]["8"].startswith("t") for r in by_n[5] + by_n[10])
    baseline, = by_n[6]
    assert baseline["failures"] == 0 and baseline["steps_done"] == baseline["steps_attempted"] > 0
    # The table is printed last, and is the one stored in the JSON.
    assert proc.stdout.rstrip().endswith(report["table"].rstrip())
    assert "[bench +" in proc.stdout    # progress lines as it goes
