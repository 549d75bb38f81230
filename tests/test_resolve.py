from dataclasses import fields, replace

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, Qwen3_5TextConfig, Qwen3Config

from dflash_core.loss.objective import default_gamma
from dflash_core.loss.settings import StepSettings
from launcher.config import ConfigError, compose_config
from launcher.config.schema import DrafterSettings, FaultSettings, OptimSettings
from launcher.distributed.topology import Topology
from launcher.resolve import compile_plan, drafter_config, resolve, step_settings


@pytest.mark.parametrize("overrides,backend,compiled,warm_up", [
    ([], "flex", False, None),                                   # auto, varying lengths: eager layers, no warm-up
    (["data.fixed_length=256"], "flex", True, (4, 256)),         # auto, flex at one static length
    (["data.fixed_length=256"], "sdpa", False, (4, 256)),        # sdpa (CPU): eager, still warmed up
    (["drafter.compile=true"], "sdpa", True, None),
    (["data.fixed_length=256", "drafter.compile=false", "run.warm_up=false"], "flex", False, None),
])
def test_one_function_decides_compile_and_warm_up(overrides, backend, compiled, warm_up):
    plan = compile_plan(compose_config(overrides), backend, torch.device("cpu"), Qwen3Config())
    assert (plan.compiled, plan.warm_up_shape) == (compiled, warm_up)


@pytest.mark.parametrize("overrides,device,family_config,compiled", [
    (["data.fixed_length=256"], "cuda", Qwen3Config(), True),          # auto: GPU at a static length
    ([], "cuda", Qwen3Config(), False),                                 # varying lengths
    (["data.fixed_length=256"], "cpu", Qwen3Config(), False),
    (["data.fixed_length=256"], "cuda", Qwen3_5TextConfig(), False),    # recurrent layers: eager
    (["target.compile=true"], "cpu", Qwen3Config(), True),
])
def test_when_the_target_compiles(overrides, device, family_config, compiled):
    plan = compile_plan(compose_config(overrides), "flex", torch.device(device), family_config)
    assert plan.target_compiled is compiled


def test_a_compiled_recurrent_target_is_refused():
    with pytest.raises(ConfigError, match="target.compile=True: not for the qwen3_5"):
        compile_plan(compose_config(["target.compile=true"]), "flex", torch.device("cpu"), Qwen3_5TextConfig())


def test_the_step_settings_carry_the_config_keys_names_and_resolved_values(tiny_target_dir):
    """One name per setting from the config to the objective: every StepSettings field but the resolved
    compilation is a drafter.* key; the job hands the roles each section as the schema's dataclass."""
    cfg = compose_config([f"target.path={tiny_target_dir}", "target.build_tiny=false", "drafter=tiny",
                          "drafter.loss=dpace", "drafter.dpace_alpha=0.25"])
    job = resolve(cfg, Topology(1, 1), torch.device("cpu"))
    assert {f.name for f in fields(StepSettings)} - {"compiled"} <= {f.name for f in fields(DrafterSettings)}
    assert (job.step.loss, job.step.dpace_alpha, job.step.backend) == ("dpace", 0.25, "sdpa")
    assert job.step.gamma == default_gamma(cfg.drafter.block_size)   # drafter.gamma=null: the block size's default
    assert isinstance(job.fault, FaultSettings) and isinstance(job.optim, OptimSettings)


def test_step_settings_refuse_an_unresolved_backend_and_an_unknown_loss():
    settings = step_settings(DrafterSettings(), "sdpa", compiled=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="backend='auto': expected a resolved backend"):
        replace(settings, backend="auto")
    with pytest.raises(ValueError, match="loss='focal'"):
        replace(settings, loss="focal")


def test_matmul_precision_auto_is_fp32_on_cpu_and_bf16_on_a_gpu_and_bf16_is_kept_on_cpu():
    def dtype(setting, device):
        return step_settings(DrafterSettings(matmul_precision=setting), "sdpa", compiled=False,
                             device=torch.device(device)).compute_dtype
    assert dtype("auto", "cpu") == torch.float32 and dtype("auto", "cuda") == torch.bfloat16
    assert dtype("bf16", "cpu") == torch.bfloat16 and dtype("fp8", "cuda") == torch.bfloat16


def _full_table(tmp_path, style, *specials):
    """A saved tokenizer of `style` (tests/test_chat_formats.py) with `specials` added, and a Qwen3 config
    whose vocab_size is the tokenizer's size: no spare embedding row (SmolLM2's or Llama 3's table)."""
    from tests.test_chat_formats import build_tokenizer
    tokenizer = build_tokenizer(style)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    cfg = compose_config([f"data.tokenizer={tmp_path / 'tokenizer'}"])
    return cfg, Qwen3Config(vocab_size=len(tokenizer)), tokenizer


def test_a_full_vocabulary_gets_a_special_token_nothing_uses_as_its_mask(tmp_path):
    # bos, eos and the chat template's header and end-of-turn tokens are all in use: the reserved one is free.
    cfg, config, tokenizer = _full_table(tmp_path, "llama3", "<|reserved_special_token_0|>", "<|eom_id|>")
    assert drafter_config(cfg, config).mask_token_id == tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>")


def test_a_full_vocabulary_without_a_free_token_names_the_setting_and_candidates(tmp_path):
    cfg, config, tokenizer = _full_table(tmp_path, "qwen3")   # pad, and the template's <|im_start|>, <|im_end|>
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id=auto: .*fills all \d+ embedding rows") as error:
        drafter_config(cfg, config)
    # the last merge, past the added tokens (<think>, ...) that close the table
    last = max(set(range(len(tokenizer))) - set(tokenizer.added_tokens_decoder))
    assert f"{last} {tokenizer.convert_ids_to_tokens(last)!r}" in str(error.value)


def test_a_mask_token_outside_the_vocabulary_names_the_setting(tmp_path):
    cfg, config, _ = _full_table(tmp_path, "qwen3")
    cfg.drafter.mask_token_id = 128002   # the Llama 3 recipe's, on a smaller vocabulary
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id=128002: outside the target's vocabulary"):
        drafter_config(cfg, config)


def test_target_auto_reads_the_layer_ids_and_the_mask_token_from_the_checkpoint(tmp_path):
    """target=auto on a 30-layer target with a full vocabulary (SmolLM2's layout): the tiny drafter's two ids
    spread over its layers, the mask a free special token, the rest from config.json."""
    _, _, tokenizer = _full_table(tmp_path, "llama3", "<|reserved_special_token_0|>")
    target = tmp_path / "target"
    tokenizer.save_pretrained(target)
    LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                vocab_size=len(tokenizer)).save_pretrained(target)
    cfg = compose_config(["target=auto", f"target.path={target}"])
    dcfg = drafter_config(cfg, AutoConfig.from_pretrained(target))
    assert dcfg.target_layer_ids == [1, 27] and dcfg.num_target_layers == 30
    assert dcfg.mask_token_id == tokenizer.convert_tokens_to_ids("<|reserved_special_token_0|>")
    assert (dcfg.hidden_size, dcfg.num_attention_heads, dcfg.vocab_size) == (576, 9, len(tokenizer))


def test_layer_ids_that_do_not_fit_the_target_name_the_setting_and_the_layer_count():
    # The Llama 3.1 8B drafter's ids (32 layers) on a 30-layer Llama: 29 is its last layer.
    cfg = compose_config(["drafter.target_layer_ids=[1,8,15,22,29]", "drafter.mask_token_id=0"])
    with pytest.raises(ConfigError, match=r"drafter.target_layer_ids=\[1, 8, 15, 22, 29\]: the target has 30 layers, "
                                          r"so ids lie in 0..28 .*\[29\] do not"):
        drafter_config(cfg, Qwen3Config(num_hidden_layers=30))
    # null: 5 distinct ids do not fit before a 4-layer target's last layer
    cfg = compose_config(["drafter.num_layers=5", "drafter.mask_token_id=0"])
    with pytest.raises(ConfigError, match=r"target_layer_ids=null: a 4-layer target .* lower drafter.num_layers"):
        drafter_config(cfg, Qwen3Config(num_hidden_layers=4))
