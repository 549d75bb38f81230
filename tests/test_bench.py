"""The benchmark harness (launcher/bench/) on CPU: its FLOP count against a hand count, the
stage-balance advice, the thread baseline's failure counting, and the whole `--tiny` harness."""
import json
import os
import subprocess
import sys

import pytest

from dflash_core.model import DrafterConfig
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
    assert drafter_step_min_bytes(cfg, 10, 2) == {"features": 10 * 16 * 2, "lm_head": 32 * 8 * 2,
                                                  "params_and_adamw": 36 * params,
                                                  "total": 320 + 512 + 36 * params}

    class HF:
        hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size = 8, 2, 1, 4, 16
    # 3 kept layers, S=5: 2 * 576 * 3 * 5 matmul FLOPs + 3 * 4 * 2 * 4 * (5 * 6 / 2) causal attention.
    assert target_forward_flops(HF, 3, 5) == 2 * 576 * 3 * 5 + 3 * 4 * 2 * 4 * 15


def test_production_numbers_in_perf_notes_hold():
    """docs/perf_notes.md quotes the Qwen3-8B drafter step: 75.1 TFLOP, 39.2 GB at S=4096, 512 anchors."""
    cfg = qwen3_8b_drafter_config()
    assert round(drafter_step_flops(cfg, 4096, 512) / 1e12, 1) == 75.1
    assert round(drafter_step_min_bytes(cfg, 4096, 512)["total"] / 1e9, 1) == 39.2
    assert "75.1 TFLOP" in (REPO / "docs" / "perf_notes.md").read_text()


def test_bench_shape_composes_the_production_drafter(tmp_path, tiny_target_dir):
    """The overrides the GPU run uses give exactly the Qwen3-8B dflash5 drafter."""
    import dataclasses

    from launcher.bench.counts import QWEN3_8B_SHAPE
    from launcher.bench.inputs import run_overrides, write_bench_target
    from launcher.config import compose_config
    from launcher.resolve import drafter_config

    target = write_bench_target(tmp_path / "target", QWEN3_8B_SHAPE, tiny_target_dir)
    cfg = compose_config(run_overrides(target_dir=target, data_path=tmp_path / "d.jsonl", seq_len=4096, steps=5,
                                       tiny=False, anchors=512, work=tmp_path))
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


def test_format_table_lists_every_row():
    table = format_table([{"n": 1, "row": "matmul ceiling", "tflops": 1.5, "mfu": 1.0, "notes": "x"},
                          {"n": 4, "row": "end to end", "notes": "skipped"}])
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].startswith("#") and "1.50" in lines[1] and lines[2].endswith("skipped")


def _baseline_spec(tiny_target_dir, tmp_path, **overrides):
    import dataclasses

    from dflash_core.tiny import MODEL_SHAPE
    from launcher.bench.inputs import write_bench_target
    target = write_bench_target(tmp_path / "target", {**MODEL_SHAPE, "vocab_size": 1088}, tiny_target_dir)
    from transformers import AutoConfig
    cfg = DrafterConfig.from_target(AutoConfig.from_pretrained(target), num_layers=1, block_size=4,
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


@pytest.mark.multiproc
def test_tiny_harness_end_to_end(tmp_path, tiny_target_dir):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "launcher.bench", "--tiny", "--out", str(out),
                           "--tokenizer", str(tiny_target_dir), "--work-dir", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    by_n = {}
    for r in rows:
        by_n.setdefault(r["n"], []).append(r)
    assert sorted(by_n) == [1, 2, 3, 4, 5, 6]
    assert by_n[1][0]["tflops"] > 0
    seqs = report["meta"]["seqs"]
    for n in (2, 3, 5):
        assert [r["seq_len"] for r in by_n[n]] == seqs
    for r in by_n[2] + by_n[3]:
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and 0 < r["mfu"]
    assert all(r["full_forward_ms"] > 0 for r in by_n[2])
    for r in by_n[3]:
        assert r["compiles_stable"] and r["samples_per_s"] > 0
    e2e, = by_n[4]
    assert e2e["row"] == "end to end t1d1" and e2e["tokens_per_s"] > 0 and e2e["pipeline_efficiency"] > 0
    assert 0 <= e2e["target_idle_fraction"] <= 1 and 0 <= e2e["drafter_idle_fraction"] <= 1
    assert e2e["channel_gb_per_s"] > 0 and list(e2e["compiles_per_drafter"]) == ["1"]
    assert list(e2e["compile_s_per_drafter"]) == ["1"] and e2e["compile_s_per_drafter"]["1"] > 0
    assert all(r["advice"]["2"] == "t1d1" and r["advice"]["8"].startswith("t") for r in by_n[5])
    baseline, = by_n[6]
    assert baseline["failures"] == 0 and baseline["steps_done"] == baseline["steps_attempted"] > 0
    # The table is printed last, and is the one stored in the JSON.
    assert proc.stdout.rstrip().endswith(report["table"].rstrip())
    assert "[bench +" in proc.stdout    # progress lines as it goes
