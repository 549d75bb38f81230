"""The stages of `python -m launcher.bench`: FLOP and byte counts, the bench target and data, and
one function per measured row. See launcher/bench.py for the CLI and docs/perf_notes.md for the
numbers these formulas give at the production shape.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

# Qwen3-8B's shape (random weights: speed does not depend on weight values).
QWEN3_8B_SHAPE = dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                      max_position_embeddings=40960, rope_theta=1e6)
# The ~27B shape of the original 8-GPU incident (issue 8).
QWEN3_27B_SHAPE = dict(vocab_size=151936, hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                       num_key_value_heads=8, head_dim=128, intermediate_size=25600,
                       max_position_embeddings=40960, rope_theta=1e6)
SHAPES = {"qwen3-8b": QWEN3_8B_SHAPE, "qwen3-27b": QWEN3_27B_SHAPE}
QWEN3_MASK_TOKEN_ID = 151669
H200_BF16_MATMUL_TFLOPS = 790.0   # measured-class dense bf16 GEMM rate of one H200 (spec sheet: 989)
H200_HBM_TB_PER_S = 4.8

_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[bench +{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


# ----------------------------------------------------------------------------------------- counts
def layer_matmul_params(hidden, num_heads, num_kv_heads, head_dim, intermediate) -> int:
    """Weights of one Qwen3 decoder layer that enter matmuls: q, k, v, o and the SiLU MLP (norms and
    biases are negligible and left out)."""
    attention = hidden * num_heads * head_dim * 2 + hidden * num_kv_heads * head_dim * 2
    return attention + 3 * hidden * intermediate


def drafter_step_flops_breakdown(cfg, seq_len: int, anchors) -> dict:
    """Model FLOPs of one drafter training step on one row of `seq_len` context tokens.

    `anchors`: an int N (random anchors over the S-1 candidates 0..S-2, so the mean anchor is
    (S-2)/2), or the anchor positions themselves. With Q = N*Bs query tokens, n drafter layers,
    P = layer_matmul_params of one drafter layer, P_kv = its k,v weights, L captured target layers:

      layers    = 6 * P * Q * n            forward 2 + input-grad 2 + weight-grad 2, per query token
      lm_head   = 4 * V * H * Q            frozen head: forward + input-grad only (no weight grad)
      attention = 3 * n * 4 * heads * head_dim * sum_blocks Bs * (a + Bs)
                  QK^T and PV (2 FLOPs per MAC each) over the VISIBLE keys only: a query of the block
                  anchored at a sees the a context keys before it and the Bs keys of its block;
                  x3 = forward + backward (dQ, dK, dV, dP ~ twice the forward)
      context   = 6 * P_kv * S * n         k,v projections of every context token in every layer
      fc        = 6 * L * H * H * S        the feature projection, per context token

    MFU counts model FLOPs only (no recomputation; the fused head loss does none for the LM head).
    fc follows the issue's 6x although its input (the target's hidden states)
    needs no gradient, so the step really does 4x there (the difference is ~1% at the 8B shape).
    """
    n, bs, hidden = cfg.num_hidden_layers, cfg.block_size, cfg.hidden_size
    if isinstance(anchors, int):
        num_blocks, anchor_sum = anchors, anchors * (seq_len - 2) / 2
    else:
        positions = [int(a) for a in (anchors.flatten().tolist() if torch.is_tensor(anchors) else anchors)]
        num_blocks, anchor_sum = len(positions), sum(positions)
    queries = num_blocks * bs
    layer = layer_matmul_params(hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                cfg.intermediate_size)
    kv = 2 * hidden * cfg.num_key_value_heads * cfg.head_dim
    visible_keys = anchor_sum + num_blocks * bs   # summed over blocks, per query slot
    parts = {
        "layers": 6 * layer * queries * n,
        "lm_head": 4 * cfg.vocab_size * hidden * queries,
        "attention": 3 * n * 4 * cfg.num_attention_heads * cfg.head_dim * bs * visible_keys,
        "context_kv": 6 * kv * seq_len * n,
        "fc": 6 * cfg.num_features * hidden * hidden * seq_len,
    }
    parts["total"] = sum(parts.values())
    return parts


def drafter_step_flops(cfg, seq_len: int, anchors) -> float:
    """Total model FLOPs of one drafter step (see drafter_step_flops_breakdown for the formula)."""
    return drafter_step_flops_breakdown(cfg, seq_len, anchors)["total"]


def drafter_step_min_bytes(cfg, seq_len: int, anchors: int) -> dict:
    """A lower bound on the HBM bytes one drafter step must move, every tensor touched once:
    the bf16 features read (S * L*H * 2), the bf16 LM head read (V*H*2; the embedding gather is
    negligible), and per fp32 master parameter 36 B: read for compute (4), gradient written (4),
    AdamW reads param, grad, m, v (16) and writes param, m, v (12). Activations are left out."""
    params = (cfg.num_hidden_layers * layer_matmul_params(cfg.hidden_size, cfg.num_attention_heads,
                                                          cfg.num_key_value_heads, cfg.head_dim,
                                                          cfg.intermediate_size)
              + cfg.num_features * cfg.hidden_size ** 2)
    parts = {"features": seq_len * cfg.num_features * cfg.hidden_size * 2,
             "lm_head": cfg.vocab_size * cfg.hidden_size * 2,
             "params_and_adamw": 36 * params}
    parts["total"] = sum(parts.values())
    return parts


def target_forward_flops(hf_config, kept_layers: int, seq_len: int, batch: int = 1) -> float:
    """Frozen target forward over `kept_layers` decoder layers (the capture stops after the last
    captured one): 2 * P_layer * kept * tokens for the matmuls, plus causal attention
    kept * 4 * heads * head_dim * S(S+1)/2 per row (QK^T and PV, 2 FLOPs per MAC, each query
    sees itself and the keys before it). No LM head: the capture never runs it."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    layer = layer_matmul_params(hf_config.hidden_size, hf_config.num_attention_heads,
                                hf_config.num_key_value_heads, head_dim, hf_config.intermediate_size)
    matmuls = 2 * layer * kept_layers * seq_len * batch
    attention = kept_layers * 4 * hf_config.num_attention_heads * head_dim * seq_len * (seq_len + 1) / 2 * batch
    return matmuls + attention


def balance_advice(target_rate: float, drafter_rate: float, num_gpus: int) -> tuple[int, int, float]:
    """The T:D split of `num_gpus` (T, D >= 1) maximising min(T * target_rate, D * drafter_rate):
    (T, D, pipeline tokens/s). Ties go to more drafter GPUs (their idle time is the cheaper kind:
    the target's spare capacity can feed more data later)."""
    if num_gpus < 2:
        raise ValueError(f"a split needs at least 2 GPUs (one target, one drafter), got {num_gpus}")
    best = None
    for t in range(1, num_gpus):
        d = num_gpus - t
        rate = min(t * target_rate, d * drafter_rate)
        if best is None or rate > best[2] * (1 + 1e-9):
            best = (t, d, rate)
    return best


# ------------------------------------------------------------------------------ timing helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_reps(fn, device: torch.device, *, warmup: int, reps: int) -> list[float]:
    """Seconds per call of fn, one value per timed rep (CUDA events on GPU, synchronised)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------------------ bench inputs
def write_bench_target(out_dir: Path, shape: dict, tokenizer_src: Path) -> Path:
    """A target directory with only config.json (the bench shape) and a tokenizer: enough for
    target.random_weights=true. The tiny tokenizer's ids are < 1024, so they fit any vocabulary."""
    from transformers import AutoTokenizer, Qwen3Config

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    tokenizer.model_max_length = shape["max_position_embeddings"]  # no "sequence too long" warnings
    tokenizer.save_pretrained(out_dir)
    fields = dict(shape)
    theta = fields.pop("rope_theta", None)
    if theta is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    Qwen3Config(tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, **fields).save_pretrained(out_dir)
    return out_dir


_WORDS = ("the model reads a long text and learns to guess the next words of the answer quickly while the "
          "target checks every block it proposes so that nothing changes in the output only the speed "
          "data tokens layers hidden states flow from one process to another over the network").split()


def write_synthetic_data(path: Path, tokenizer_dir: Path, min_tokens: int, records: int = 8, seed: int = 0) -> dict:
    """Preformatted {"id", "text"} records that each tokenise to >= min_tokens tokens, so with
    data.max_length = min_tokens every sample is truncated to exactly that length, its loss mask is
    all ones and S-1 anchor candidates exist."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rng = random.Random(seed)
    words = min_tokens + 16
    while True:
        texts = [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(records)]
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        if min(lengths) >= min_tokens:
            break
        words *= 2
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"bench-{i}", "text": text}) + "\n")
    return {"records": records, "min_tokens": min(lengths)}


def run_overrides(*, target_dir: Path, data_path: Path, seq_len: int, steps: int, tiny: bool, anchors: int,
                  work: Path) -> list[str]:
    """The hydra overrides shared by the drafter-alone stage (composed in-process) and the
    end-to-end launch, so both train exactly the same drafter."""
    over = [f"target.path={target_dir}", "target.build_tiny=false", "target.random_weights=true",
            f"drafter={'tiny' if tiny else 'dflash5'}", f"drafter.num_anchors={anchors}",
            f"data.paths=['{data_path}']", f"data.max_length={seq_len}", f"data.fixed_length={seq_len}",
            "data.eval_fraction=0", f"data.cache_dir={work / 'tokenized'}", "train.micro_batch_size=1",
            f"train.steps={steps}", "run.export=false", "run.progress=false"]
    if not tiny:  # the spec defaults [1, 9, 17, 25, 33] and Qwen3's mask token
        over += ["drafter.target_layer_ids=null", f"drafter.mask_token_id={QWEN3_MASK_TOKEN_ID}"]
    return over


# ------------------------------------------------------------------------------ row 1: matmul
def matmul_ceiling(device: torch.device, *, tiny: bool, reps: int = 20) -> dict:
    """Median TFLOP/s of a square matmul on random data: bf16 8192^3 on GPU, fp32 1024^3 on CPU."""
    n, dtype = (1024, torch.float32) if device.type == "cpu" or tiny else (8192, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    times = timed_reps(lambda: torch.mm(a, b), device, warmup=3, reps=max(reps, 10))
    median = statistics.median(times)
    return {"row": "matmul ceiling", "ms_per_step": 1e3 * median, "tflops": 2 * n ** 3 / median / 1e12,
            "mfu": 1.0, "shape": f"{n}^3 {str(dtype).removeprefix('torch.')}", "reps": len(times),
            "notes": f"{n}^3 {str(dtype).removeprefix('torch.')}, median of {len(times)}"}


# ------------------------------------------------------------------------------ row 2: target
def target_stage(hf_config, layer_ids, device, dtype, seqs, *, warmup: int, reps: int, ceiling: float) -> list[dict]:
    from dflash_core.target import random_target

    t0 = time.perf_counter()
    target = random_target(hf_config, layer_ids=layer_ids, device=device, dtype=dtype, seed=0)
    progress(f"target built in {time.perf_counter() - t0:.1f}s ({target.num_kept_layers} layers kept, "
             f"captures {layer_ids})")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for seq_len in seqs:
        ids = torch.randint(0, min(hf_config.vocab_size, 1024), (1, seq_len), generator=gen).to(device)
        times = timed_reps(lambda: target.capture(ids), device, warmup=warmup, reps=reps)
        step = statistics.median(times)
        flops = target_forward_flops(hf_config, target.num_kept_layers, seq_len)
        row = {"row": "target alone", "seq_len": seq_len, "ms_per_step": 1e3 * step,
               "tokens_per_s": seq_len / step, "tflops": flops / step / 1e12,
               "mfu": flops / step / 1e12 / ceiling, "flops_per_step": flops, "kept_layers": target.num_kept_layers,
               "notes": f"{target.num_kept_layers} layers, 1 GPU" if device.type == "cuda" else
               f"{target.num_kept_layers} layers, cpu"}
        rows.append(row)
        progress(f"target alone S={seq_len}: {row['ms_per_step']:.1f} ms, {row['tokens_per_s']:.0f} tokens/s, "
                 f"{row['tflops']:.1f} TFLOP/s")
    del target
    _compare_full_forward(hf_config, device, dtype, rows, warmup=warmup, reps=reps)
    return rows


def _compare_full_forward(hf_config, device, dtype, rows: list[dict], *, warmup: int, reps: int) -> None:
    """Time the whole model with output_hidden_states (what capture would cost without truncation)
    beside each truncated row, so the saving is measured, not assumed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        full = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    for row in rows:
        ids = torch.randint(0, min(hf_config.vocab_size, 1024), (1, row["seq_len"]), generator=gen).to(device)

        def forward():
            with torch.inference_mode():
                full(input_ids=ids, output_hidden_states=True, use_cache=False)
        row["full_forward_ms"] = 1e3 * statistics.median(timed_reps(forward, device, warmup=warmup, reps=reps))
        row["notes"] += f"; full forward {row['full_forward_ms']:.1f} ms ({row['full_forward_ms'] / row['ms_per_step']:.2f}x)"
        progress(f"full forward S={row['seq_len']}: {row['full_forward_ms']:.1f} ms")
    del full


# ------------------------------------------------------------------------------ row 3: drafter
def _one_rank_context(cfg, device: torch.device, work: Path, isolation):
    """A Context for a world of one drafter rank: the real DrafterTrainer runs on it unchanged."""
    from datetime import timedelta

    import torch.distributed as dist
    from launcher.context import Context, schedule_from
    from launcher.topology import Groups, Topology

    store_path = work / "pg_store"
    store_path.unlink(missing_ok=True)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.run.timeout_s)
    dist.init_process_group(backend, store=dist.FileStore(str(store_path), 1), rank=0, world_size=1,
                            timeout=timeout, device_id=device if backend == "nccl" else None)
    # The order and kinds of launcher/topology.build_groups, for ranks {0} = the one drafter.
    control = dist.new_group(backend="gloo", timeout=timeout)
    startup = dist.new_group(backend="gloo", timeout=timeout)
    drafters = dist.new_group([0], timeout=timeout)
    topo = Topology(num_targets=0, num_drafters=1)   # rank 0 is the (lead) drafter
    groups = Groups(control=control, startup=startup, targets=None, drafters=drafters, unit=None)
    return Context(cfg, topo, 0, groups, device, device if backend == "nccl" else torch.device("cpu"),
                   work / "drafter_run", schedule_from(cfg, topo), 0, None, isolation)


def drafter_stage(cfg, device, seqs, *, work: Path, isolation, warmup: int, steps: int, ceiling: float,
                  profile: bool = False) -> list[dict]:
    """The real training step (launcher.drafter_role.DrafterTrainer.train_step) fed from memory.
    profile: two more steps at the last length under torch.profiler; the kernel table is printed
    and kept in that row (with dynamo's compile times)."""
    import torch.distributed as dist
    from dflash_core.compile import compile_count
    from launcher.channel import Payload
    from launcher.drafter_role import DrafterTrainer
    from launcher.schedule import TRAIN, Item

    ctx = _one_rank_context(cfg, device, work, isolation)
    rows = []
    try:
        t0 = time.perf_counter()
        with torch.device(device):  # initialise on the GPU: a 1B-parameter CPU init takes seconds
            trainer = DrafterTrainer(ctx)
        dcfg = trainer.dcfg
        params = sum(p.numel() for p in trainer.drafter.parameters())
        progress(f"drafter built in {time.perf_counter() - t0:.1f}s ({params / 1e6:.1f}M params, "
                 f"backend {cfg.drafter.backend}, {cfg.drafter.num_anchors} anchors x {dcfg.block_size})")
        width = dcfg.num_features * dcfg.hidden_size
        gen = torch.Generator(device=device).manual_seed(0)
        index = 0
        for seq_len in seqs:
            def payload(i):
                ids = torch.randint(0, min(dcfg.mask_token_id, 1024), (1, seq_len), device=device, generator=gen)
                hidden = torch.randn(1, seq_len, width, device=device, dtype=torch.bfloat16, generator=gen)
                mask = torch.ones(1, seq_len, dtype=torch.long, device=device)
                return Payload(Item(i, TRAIN, i, i, 0, 0), ids, mask, hidden, seq_len)
            payloads = [payload(index + k) for k in range(2)]

            def step():
                nonlocal index
                p = payloads[index % 2]
                # A new item index each step: new anchors, exactly as in training.
                p = Payload(Item(index, TRAIN, index, index, 0, 0), p.input_ids, p.loss_mask, p.hidden, seq_len)
                index += 1
                trainer.train_step([p])   # ends with .item() calls: synchronised

            t0 = time.perf_counter()
            for _ in range(warmup):
                step()
            warm_s = time.perf_counter() - t0
            compiles_warm = compile_count()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = []
            for _ in range(steps):
                _sync(device)
                t1 = time.perf_counter()
                step()
                _sync(device)
                times.append(time.perf_counter() - t1)
            compiles_after = compile_count()
            step_s = statistics.median(times)
            flops = drafter_step_flops(dcfg, seq_len, cfg.drafter.num_anchors)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            row = {"row": "drafter alone", "seq_len": seq_len, "ms_per_step": 1e3 * step_s,
                   "tokens_per_s": seq_len / step_s, "samples_per_s": 1 / step_s,
                   "tflops": flops / step_s / 1e12, "mfu": flops / step_s / 1e12 / ceiling,
                   "flops_per_step": flops, "peak_memory_gib": peak, "warmup_s": warm_s,
                   "compiles_after_warmup": compiles_warm, "compiles_after_timed": compiles_after,
                   "compiles_stable": compiles_after == compiles_warm, "params_m": params / 1e6,
                   "notes": (f"peak {peak:.1f} GiB, " if peak is not None else "")
                   + f"compiles {compiles_warm}->{compiles_after}, warmup {warm_s:.0f}s"}
            if profile and seq_len == seqs[-1]:
                row["profile"] = _profile(step, device)
            rows.append(row)
            progress(f"drafter alone S={seq_len}: {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s']:.0f} "
                     f"tokens/s, {row['tflops']:.1f} TFLOP/s, MFU {row['mfu']:.2f}, {row['notes']}")
        del trainer
    finally:
        dist.destroy_process_group()
    return rows


def _profile(step, device: torch.device, steps: int = 2) -> dict:
    from torch._dynamo.utils import compile_times
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
    times = compile_times(repr="str", aggregate=True)
    print(f"profile of {steps} drafter steps (sorted by {sort}):\n{table}\ncompile times:\n{times}", flush=True)
    return {"steps": steps, "table": table, "compile_times": times}


# ------------------------------------------------------------------------------ subprocesses
def stream(cmd: list[str], *, env: dict, timeout_s: float, prefix: str) -> tuple[int | None, str]:
    """Run cmd, echo its output as it comes (prefixed), return (exit code or None on timeout, tail).
    On timeout the whole process group (torchrun and every worker it started) is killed."""
    import signal
    import threading

    tail: deque[str] = deque(maxlen=60)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"  {prefix}| {line.rstrip()}", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=10)
    return code, "\n".join(tail)


def child_env(*, tiny: bool, **extra) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    # NVLink multicast stays off on shared multi-GPU hosts (the device machines set these; keep them).
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")
    if tiny:
        env["OMP_NUM_THREADS"] = "1"
    return {k: v for k, v in env.items() if v is not None}


# ------------------------------------------------------------------------------ row 4: end to end
def e2e_stage(overrides: list[str], *, topology, work: Path, tiny: bool, timeout_s: float) -> dict:
    """The real launcher under torchrun with `topology` (a launcher.topology.Topology), one process
    per rank; returns its summary.json."""
    import shutil

    run_dir = work / "e2e"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={topology.world_size}",
           "-m", "launcher.train", f"topology={topology.spec}", *overrides, f"run.dir={run_dir}",
           f"isolation.cache_root={work / 'compile_cache'}"]
    progress("end to end: " + " ".join(cmd[1:]))
    code, tail = stream(cmd, env=child_env(tiny=tiny), timeout_s=timeout_s, prefix="e2e")
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)   # the 8B drafter's final checkpoint is ~12 GB
    summary_path = run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        why = "timed out" if code is None else f"exit code {code}"
        raise RuntimeError(f"end-to-end run failed ({why}); last lines:\n{tail[-3000:]}")
    return json.loads(summary_path.read_text())


# ------------------------------------------------------------------------------ row 6: baseline
def baseline_stage(spec: dict, *, work: Path, tiny: bool, timeout_s: float, cache_dir: Path | None) -> dict:
    """launcher.thread_baseline in a fresh process (its own dynamo state, like the old trainer)."""
    spec_path, out_path = work / "baseline_spec.json", work / "baseline_result.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    out_path.unlink(missing_ok=True)
    extra = {"TORCHINDUCTOR_CACHE_DIR": str(cache_dir)} if cache_dir is not None else {}
    cmd = [sys.executable, "-m", "launcher.thread_baseline", "--spec", str(spec_path), "--out", str(out_path)]
    progress("thread baseline: " + " ".join(cmd[1:]))
    env = child_env(tiny=tiny)
    env.update(extra)
    code, tail = stream(cmd, env=env, timeout_s=timeout_s, prefix="threads")
    if not out_path.is_file():
        why = "timed out" if code is None else f"exit code {code}"
        raise RuntimeError(f"thread baseline wrote no result ({why}); last lines:\n{tail[-3000:]}")
    return json.loads(out_path.read_text())
