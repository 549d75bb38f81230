"""The config resolved once per process into the typed settings the roles receive (launcher/job.py).

Both roles must agree on what they derive from the target checkpoint (the captured layer ids,
the feature width, the mask token), so it is derived here, once, from the same files on every
rank; no role re-derives another's settings. `compile_plan` is the one place that decides
whether the drafter compiles and for which static shape it warms up.
"""
from __future__ import annotations

import dataclasses
import logging
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_core.drafter.attention import FLEX_BACKENDS, resolve_backend
from dflash_core.drafter.dflash2 import DFLASH_CONFIG_KEYS as DFLASH2_KEYS
from dflash_core.drafter.dflash2 import DFlash2Config, build_drafter
from dflash_core.drafter.model import DrafterConfig, default_target_layer_ids
from dflash_core.loss.objective import default_gamma
from dflash_core.loss.settings import StepSettings
from dflash_core.target.capture import check_target_files
from dflash_core.target.families import drafter_config_for_target, num_layers_of, text_config
from dflash_core.target.mask_token import MaskTokenError, choose_mask_token
from dflash_core.target.tiny import BUNDLED_DATASET
from launcher.config import ConfigError
from launcher.config.schema import DataSettings, DrafterSettings
from launcher.distributed.schedule import Schedule
from launcher.distributed.topology import Topology
from launcher.job import CompilePlan, Job, TargetPlan, WarmStart

log = logging.getLogger("dflash")

# Drafter shape keys that default to the target's (null in the schema).
_SHAPE_OVERRIDES = ("hidden_size", "intermediate_size", "layer_types", "sliding_window")
# The drafter.* key that sets a DrafterConfig field (the others come from the target checkpoint).
_DRAFTER_KEYS = {"num_hidden_layers": "num_layers", "block_size": "block_size", "target_layer_ids": "target_layer_ids",
                 "mask_token_id": "mask_token_id", "kind": "kind", "learn_k_norm": "learn_k_norm",
                 **{key: key for key in (*_SHAPE_OVERRIDES, *DFLASH2_KEYS)}}
_BUNDLED = {"bundled:tiny_chat": BUNDLED_DATASET}
_LENGTH_LIMITS = {"data.max_length": "truncates longer ones",
                  "data.fixed_length": "is the row length, which a conversation must fit"}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16}


# ----------------------------------------------------------------------------------- paths
def embedded_target_path(family: str) -> Path:
    """Where conf/target/tiny*.yaml keep the embedded tiny target of `family`: the only path it is built at."""
    return Path(".cache") / f"tiny-{family}"


def ensure_embedded_target(cfg: DictConfig, seed: int) -> None:
    """Build the embedded tiny target when the config asks for it and target.path, missing, is its own
    path. Any other missing path (a misspelt target.path left with the default target=tiny) is never filled
    with a fake target: target_dir refuses it."""
    own = embedded_target_path(cfg.target.tiny_family)
    path = Path(cfg.target.path)
    if cfg.target.build_tiny and not path.is_dir() and path.resolve() == own.resolve():
        from dflash_core.target.tiny import build_tiny_target
        log.info("building the embedded tiny %s target at %s", cfg.target.tiny_family, path)
        build_tiny_target(path, seed=seed, family=cfg.target.tiny_family)


def target_dir(cfg: DictConfig) -> Path:
    path = Path(cfg.target.path)
    if not path.is_dir():
        raise ConfigError(f"target.path={str(path)!r}: no such directory (a local Hugging Face model directory; "
                          f"the embedded tiny target is built only at its own path, "
                          f"{embedded_target_path(cfg.target.tiny_family)}, by target=tiny)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"target.path={str(path)!r}: no config.json (not a Hugging Face model directory)")
    return path


def dataset_paths(entries, key: str) -> list[Path]:
    """Dataset files, `datasets` directories, directories of files or bundled set names
    (`bundled:tiny_chat`), from a string or a list; `key` names the setting in errors."""
    from dflash_core.data import dataset_sources
    entries = [entries] if isinstance(entries, str) else list(entries)
    if not entries:
        raise ConfigError(f"{key}=[]: name at least one dataset file or directory")
    paths = [Path(_BUNDLED.get(str(entry), entry)) for entry in entries]
    for path in paths:
        if not path.exists():
            raise ConfigError(f"{key}: {str(path)!r} does not exist")
    sources, seen = dataset_sources(paths), {}
    for source in sources:   # a file read twice would put copies of its records on both sides of the split
        first = seen.setdefault(source.resolve(), source)
        if first is not source:
            raise ConfigError(f"{key}: {str(source)!r} is named twice (directly or through a directory; first as "
                              f"{str(first)!r}): name each dataset file once")
    return sources


def compute_dtype(setting: str, device: torch.device, cpu: torch.dtype = torch.float32) -> torch.dtype:
    """target.dtype: `auto` is bf16 on GPU and `cpu` on CPU: fp32 where a result must be exact (training's
    capture, launcher.evaluate's token-for-token lossless check), bf16 where launcher.regenerate asks for it
    (2.5x the new tokens/s of fp32 for a 135M target on 2 cores, issue 44)."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu
    return _DTYPES[setting]


def resolve_device(setting: str, key: str, local_rank: int = 0) -> torch.device:
    """`auto` | `cpu` | `cuda` -> a torch.device (this local rank's GPU, shared round-robin when
    there are fewer GPUs than ranks); `cuda` without a visible GPU is an error naming `key`."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}={setting!r}: no CUDA device is visible")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


# ----------------------------------------------------------------------------------- the job
def mask_token(cfg: DictConfig, hf_config) -> int:
    """drafter.mask_token_id, `auto` chosen from the target's tokenizer (dflash_core/target/mask_token.py);
    an id outside the target's vocabulary, or none free, is a ConfigError naming the key."""
    setting, vocab_size = cfg.drafter.mask_token_id, text_config(hf_config).vocab_size
    if setting != "auto":
        if setting >= vocab_size:
            raise ConfigError(f"drafter.mask_token_id={setting}: outside the target's vocabulary of {vocab_size} "
                              f"ids (a recipe's id for another target?); use auto or an id below {vocab_size}")
        return int(setting)
    from dflash_core.data import load_tokenizer  # a local directory, checked: never a hub lookup
    try:
        token_id, why = choose_mask_token(load_tokenizer(tokenizer_dir(cfg)), hf_config)
    except MaskTokenError as error:
        raise ConfigError(f"drafter.mask_token_id=auto: {error}; set drafter.mask_token_id=<id>") from None
    log.info("mask token %d (drafter.mask_token_id=auto): %s", token_id, why)
    return token_id


def target_layer_ids(cfg: DictConfig, hf_config) -> list[int]:
    """drafter.target_layer_ids, or (null) the published drafters' even spread over the target's layer count;
    ids this target cannot serve (another target's recipe?) are a ConfigError naming the key and the count."""
    layers, setting = num_layers_of(hf_config), cfg.drafter.target_layer_ids
    if setting is None:
        try:
            return default_target_layer_ids(layers, cfg.drafter.num_layers)
        except ValueError as error:
            raise ConfigError(f"drafter.target_layer_ids=null: {error} (one per drafter layer); list the ids, "
                              f"or lower drafter.num_layers") from None
    ids = [int(layer_id) for layer_id in setting]
    if outside := [layer_id for layer_id in ids if not 0 <= layer_id <= layers - 2]:
        raise ConfigError(f"drafter.target_layer_ids={ids}: the target has {layers} layers, so ids lie in "
                          f"0..{layers - 2} (serving engines read feature i at the input of layer i + 1: never the "
                          f"last layer, {layers - 1}); {outside} do not; null derives them from the layer count")
    return ids


def data_settings(cfg: DictConfig, hf_config) -> DataSettings:
    """The `data` section with data.max_length resolved (null: the target's max_position_embeddings, the
    longest conversation it can take); lengths beyond that are a ConfigError naming the key."""
    data, max_positions = OmegaConf.to_object(cfg.data), text_config(hf_config).max_position_embeddings
    for key in ("max_length", "fixed_length"):
        length = getattr(data, key)
        if length is not None and length > max_positions:
            raise ConfigError(f"data.{key}={length} exceeds the target's max_position_embeddings ({max_positions})")
    if data.max_length is None:
        data.max_length = max_positions
    return data


def drafter_config(cfg: DictConfig, hf_config) -> DrafterConfig:
    mask_token_id = mask_token(cfg, hf_config)
    overrides = {key: (list(value) if key == "layer_types" else value)
                 for key in _SHAPE_OVERRIDES if (value := cfg.drafter.get(key)) is not None}
    dcfg = drafter_config_for_target(hf_config, num_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                                     mask_token_id=mask_token_id, target_layer_ids=target_layer_ids(cfg, hf_config),
                                     learn_k_norm=cfg.drafter.learn_k_norm, **overrides)
    if cfg.drafter.kind == "dflash2":
        return DFlash2Config(**dataclasses.asdict(dcfg), **{key: cfg.drafter[key] for key in DFLASH2_KEYS})
    return dcfg


def warm_start(cfg: DictConfig, dcfg: DrafterConfig) -> WarmStart | None:
    """drafter.init_from checked on every rank before anything loads: a directory holding an export
    whose drafter is exactly the configured one, or the DFlash backbone of a configured DFlash 2 (else a
    ConfigError naming each differing field)."""
    from dflash_core.serving.export import CONFIG_NAME, WEIGHTS_NAME, config_differences, weights_digest
    setting = cfg.drafter.init_from
    if setting is None:
        return None
    path = Path(setting)
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (path / name).is_file()]
    if missing:
        what = "no such directory" if not path.is_dir() else f"no {' and no '.join(missing)} in it"
        raise ConfigError(f"drafter.init_from={setting!r}: {what} (a DFlash export directory: {CONFIG_NAME} and "
                          f"{WEIGHTS_NAME}, as launcher.export writes them)")
    differences = config_differences(path, dcfg)
    if differences:
        said = "; ".join(f"{field}: export {theirs!r}, configured {ours!r} "
                         f"({'drafter.' + _DRAFTER_KEYS[field] if field in _DRAFTER_KEYS else 'from the target'})"
                         for field, theirs, ours in differences)
        raise ConfigError(f"drafter.init_from={setting!r}: the export's drafter differs from the configured one in "
                          f"{len(differences)} field{'s' * (len(differences) > 1)}: {said}; set those keys to the "
                          f"export's values, or start from an export of this shape")
    return WarmStart(path.resolve(), weights_digest(path))


def check_target_start(cfg: DictConfig, dcfg: DrafterConfig, path: Path) -> None:
    """drafter.init=target checked on every rank before anything loads: the target's last layers exist in
    its checkpoint with the drafter's layers' shapes (else a ConfigError saying which differ)."""
    from dflash_core.drafter.from_target import check_target_start as check
    if cfg.target.random_weights:
        raise ConfigError("drafter.init=target copies the target's trained layers, but target.random_weights=true "
                          "draws them at random: set drafter.init=random")
    with torch.device("meta"):   # the shapes alone
        shapes = {name: list(param.shape) for name, param in build_drafter(dcfg).named_parameters()}
    try:
        check(dcfg, path, shapes)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"drafter.init=target: {path}: {exc.args[0]}; set drafter.init=random") from None


def tokenizer_dir(cfg: DictConfig) -> Path:
    return Path(cfg.data.tokenizer) if cfg.data.tokenizer else target_dir(cfg)


def compile_plan(cfg: DictConfig, backend: str, device: torch.device, hf_config) -> CompilePlan:
    """Compile the drafter (auto: a flex backend at one static length, data.fixed_length; varying
    lengths would compile once per length) and warm it up for that shape before the stream (auto:
    whenever the length is static), so no target waits on a first-step compilation. Compile the
    target's layers (auto: on GPU at a static length, unless the family has recurrent layers whose
    per-document regrouping has data-dependent shapes)."""
    from dflash_core.target.families import family_of
    static = cfg.data.fixed_length is not None
    compiled = backend in FLEX_BACKENDS and static if cfg.drafter.compile == "auto" else bool(cfg.drafter.compile)
    warm_up = static if cfg.run.warm_up == "auto" else bool(cfg.run.warm_up) and static
    recurrent = family_of(hf_config).recurrent_mixer is not None
    if cfg.target.compile == "auto":
        target_compiled = device.type == "cuda" and static and not recurrent
    elif cfg.target.compile and recurrent:
        raise ConfigError(f"target.compile=True: not for the {family_of(hf_config).name} family (its recurrent "
                          f"layers are regrouped per document with data-dependent shapes); use auto or false")
    else:
        target_compiled = bool(cfg.target.compile)
    return CompilePlan(compiled, (cfg.train.micro_batch_size, cfg.data.fixed_length) if warm_up else None,
                       target_compiled)


def packing(cfg: DictConfig, hf_config) -> bool:
    """data.packing, or by default: on whenever rows have one fixed length; refused (naming why) for
    a target whose packed capture is not exact."""
    from dflash_core.target.families import packing_supported
    wanted = cfg.data.fixed_length is not None if cfg.data.packing is None else bool(cfg.data.packing)
    if wanted and cfg.data.fixed_length is None:
        raise ConfigError("data.packing=True: needs data.fixed_length (the row length documents are packed into)")
    supported, why = packing_supported(hf_config)
    if wanted and not supported:
        if cfg.data.packing:
            raise ConfigError(f"data.packing=True: {why}; set data.packing=false")
        log.warning("packing is off for this target: %s", why)
        return False
    return wanted


def target_attention(packed: bool, device: torch.device, hf_config) -> str | None:
    """Packed rows on GPU, in a family with plain causal attention: flash attention's variable-length
    kernel per document (dflash_core.target.packing.varlen_attention) rather than a dense block-diagonal
    mask, which computes every document pair and misses the causal kernels."""
    from dflash_core.target.families import VARLEN, family_of
    return VARLEN if packed and device.type == "cuda" and family_of(hf_config).varlen else None


def schedule(cfg: DictConfig, topology: Topology) -> Schedule:
    evaluates = cfg.data.eval_fraction > 0 and cfg.train.eval_batches > 0
    return Schedule(steps=cfg.train.steps, num_units=topology.num_units, num_drafters=topology.num_drafters,
                    grad_accum=cfg.train.grad_accum, eval_every=cfg.train.eval_every,
                    eval_batches=cfg.train.eval_batches if evaluates else 0)


def check_combinations(cfg: DictConfig) -> None:
    """Settings that are valid alone but not together; checked before any process group forms."""
    if cfg.target.parallel == "replicate" and cfg.target.tp_size != 1:
        raise ConfigError(f"target.tp_size={cfg.target.tp_size}: must be 1 with target.parallel=replicate "
                          f"(set target.parallel=tensor to shard the target)")
    if cfg.run.warm_up is True and cfg.data.fixed_length is None:
        raise ConfigError("run.warm_up=True: needs data.fixed_length (the one shape to compile for)")
    longest, limits = longest_conversation(cfg)
    if longest is not None and cfg.drafter.block_size > longest:
        said = "; ".join(f"{key}={longest} {_LENGTH_LIMITS[key]}" for key in limits)
        raise ConfigError(f"drafter.block_size={cfg.drafter.block_size}: a block lies within one conversation (in "
                          f"a packed row, within its document), and no conversation is longer than {longest} tokens "
                          f"({said}); lower drafter.block_size or raise {' and '.join(limits)}")


def longest_conversation(cfg: DictConfig) -> tuple[int | None, list[str]]:
    """The most tokens of one conversation a row holds, and the keys that set that bound (None, []: only the
    target's max_position_embeddings, unknown before its config is read)."""
    lengths = {"data.max_length": cfg.data.max_length, "data.fixed_length": cfg.data.fixed_length}
    longest = min((length for length in lengths.values() if length is not None), default=None)
    return longest, [key for key, length in lengths.items() if length == longest]


def check_step_device(cfg: DictConfig, device: torch.device) -> None:
    """drafter.matmul_precision=fp8, refused (naming the key, the device and why) where it cannot run."""
    from dflash_core.kernels import fp8
    if cfg.drafter.matmul_precision == "fp8":
        if (reason := fp8.unsupported_reason(device)) is not None:
            raise ConfigError(f"drafter.matmul_precision=fp8: not on device {device}: {reason}; "
                              f"use drafter.matmul_precision=bf16")
        if not fp8.torchao_available():
            raise ConfigError(f"drafter.matmul_precision=fp8: the drafter's FP8 linear layers are torchao's and "
                              f"torchao is not installed: {fp8.INSTALL_HINT}")


def step_settings(drafter: DrafterSettings, backend: str, compiled: bool, device: torch.device) -> StepSettings:
    """The drafter step's settings from the `drafter` section, with the attention backend and
    compilation already resolved (and check_step_device passed); a null drafter.gamma is the block
    size's default; matmul_precision=auto is bf16 on a GPU and fp32 on CPU."""
    precision = drafter.matmul_precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return StepSettings(num_anchors=drafter.num_anchors, loss=drafter.loss,
                        gamma=default_gamma(drafter.block_size) if drafter.gamma is None else drafter.gamma,
                        dpace_alpha=drafter.dpace_alpha, backend=backend, chunk_blocks=drafter.chunk_blocks,
                        feature_noise_std=drafter.feature_noise_std, compiled=compiled,
                        matmul_precision=precision, fp8_recipe=drafter.fp8_recipe,
                        selector_weight=drafter.selector_weight, selector_detach=drafter.selector_detach,
                        kl_weight=drafter.kl_weight)


def resolve(cfg: DictConfig, topology: Topology, device: torch.device) -> Job:
    """Everything the roles derive from the config and the target checkpoint, once."""
    from transformers import AutoConfig
    path = target_dir(cfg)
    if not cfg.target.random_weights:   # every rank names a truncated or corrupt file, before anything loads
        check_target_files(path)
    hf_config = AutoConfig.from_pretrained(path)
    dcfg = drafter_config(cfg, hf_config)
    init_from = warm_start(cfg, dcfg)
    start_from_target = cfg.drafter.init == "target" and init_from is None   # a warm start takes precedence
    if start_from_target:
        check_target_start(cfg, dcfg, path)
    backend = resolve_backend(cfg.drafter.backend, device)
    log.info("attention backend %s (drafter.backend=%s)", backend, cfg.drafter.backend)
    plan = compile_plan(cfg, backend, device, hf_config)
    check_step_device(cfg, device)
    packed = packing(cfg, hf_config)
    typed = OmegaConf.to_object   # each section as the schema's dataclass
    step = step_settings(typed(cfg.drafter), backend, plan.compiled, device)
    # With the KL term the target's last layer rides along: HF reports it after the final norm, which is
    # what the LM head reads (dflash_core/target/capture.py).
    teacher = [num_layers_of(hf_config) - 1] if step.with_teacher else []
    target = TargetPlan(path=path, hf_config=hf_config, layer_ids=[*dcfg.target_layer_ids, *teacher],
                        dtype=compute_dtype(cfg.target.dtype, device), parallel=cfg.target.parallel,
                        tp_size=cfg.target.tp_size, random_weights=cfg.target.random_weights,
                        attention=target_attention(packed, device, hf_config))
    data = data_settings(cfg, hf_config)
    return Job(topology=topology, device=device, target=target, drafter=dcfg, step=step, compile=plan,
               schedule=schedule(cfg, topology), tokenizer_dir=tokenizer_dir(cfg), packing=packed,
               data_sources=partial(dataset_paths, data.paths, "data.paths"), run=typed(cfg.run),
               train=typed(cfg.train), optim=typed(cfg.optim), data=data, channel=typed(cfg.channel),
               fault=typed(cfg.fault), cfg=cfg, init_from=init_from,
               start_from_target=start_from_target)
